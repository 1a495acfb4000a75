/* The token relay below Python (see native.py): a llama-server child's chunked stream of
 * server-sent events, read from one socket, and the client's chunked stream written on
 * another, in a thread of its own that holds no Python lock.
 *
 * It relays only the events it can write exactly as the Python relay would (a token of
 * text, one event per line of "data: ..."), and stops at the first chunk that holds any
 * other line (the last event with its timings, an error, a tool call, [DONE], the end of the
 * body), leaving that chunk and everything after it, unread by it, to the Python relay. It
 * also stops when the child's connection ends, when the client hangs up, and when told to
 * (a byte on `stop`).
 *
 * Two ways to write an event:
 *   JL_TEMPLATE  an Ollama line: the event must start as the spec's pattern says (literal
 *                bytes, and \001 for digits, \002 for a JSON string, captured, that is not "",
 *                \003 for digits and commas); the line is head, the time (RFC 3339, UTC,
 *                microseconds), key, the captured string as the child spelled it, tail.
 *   JL_SSE       the event as it came ("data: ", its JSON, a blank line), with its first
 *                `from` replaced by `to` when `from` is given (the model's name).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

enum { JL_TEMPLATE = 0, JL_SSE = 1 };
enum { JL_GIVE_BACK = 1, JL_CHILD_ENDED = 2, JL_CLIENT_GONE = 3, JL_STOPPED = 4 };

struct jl_spec {
    int mode;
    const char *pat; int pat_len;
    const char *head; int head_len;
    const char *key; int key_len;
    const char *tail; int tail_len;
    const char *from; int from_len;
    const char *to; int to_len;
};

struct jl_state {
    long events;      /* events relayed */
    int left_off, left_len;      /* the child's bytes not relayed, in buf */
    int unsent_off, unsent_len;  /* our bytes the client has not taken, in out */
};

#define FRAME 12 /* room before a chunk's data for its size line */

/* The end of a JSON string starting at p (its opening quote), or NULL. */
static const char *json_string_end(const char *p, const char *end) {
    if (p >= end || *p != '"') return NULL;
    for (p++; p < end; p++) {
        if (*p == '\\') { if (++p >= end) return NULL; }
        else if (*p == '"') return p + 1;
    }
    return NULL;
}

/* Does the event d[0..n) start as the pattern says? Sets the captured string. */
static int match(const struct jl_spec *s, const char *d, int n, const char **cap, int *cap_len) {
    const char *p = d, *end = d + n, *q = s->pat, *qend = s->pat + s->pat_len;
    *cap = NULL;
    while (q < qend) {
        char c = *q++;
        if (c == '\001') {
            const char *b = p;
            while (p < end && *p >= '0' && *p <= '9') p++;
            if (p == b) return 0;
        } else if (c == '\002') {
            const char *e = json_string_end(p, end);
            if (e == NULL || e - p == 2) return 0; /* "" is not a token of text */
            *cap = p; *cap_len = (int)(e - p); p = e;
        } else if (c == '\003') {
            while (p < end && ((*p >= '0' && *p <= '9') || *p == ',')) p++;
        } else {
            if (p >= end || *p != c) return 0;
            p++;
        }
    }
    return *cap != NULL;
}

/* An error event ({"error": ...}) goes to Python, which tells it as one. */
static int looks_like_error(const char *d, int n) {
    if (n < 1 || d[0] != '{') return 0;
    int i = 1;
    while (i < n && (d[i] == ' ' || d[i] == '\t' || d[i] == '\r' || d[i] == '\n')) i++;
    return n - i >= 7 && memcmp(d + i, "\"error\"", 7) == 0;
}

static int put(char *out, int *o, int ocap, const char *p, int n) {
    if (*o + n > ocap) return 0;
    memcpy(out + *o, p, n);
    *o += n;
    return 1;
}

/* Our bytes for one line of an event's chunk: 1 written, 0 no room, -1 not ours to write. */
static int one_line(const struct jl_spec *s, const char *line, int n, char *out, int *o, int ocap,
                    const char *stamp, int stamp_len) {
    if (n == 0) return 1; /* the blank line that ends an event */
    if (n < 6 || memcmp(line, "data: ", 6) != 0) return -1;
    const char *d = line + 6;
    int dn = n - 6;
    int start = *o;
    if (s->mode == JL_TEMPLATE) {
        const char *cap; int cap_len;
        if (!match(s, d, dn, &cap, &cap_len)) return -1;
        if (put(out, o, ocap, s->head, s->head_len) && put(out, o, ocap, stamp, stamp_len)
            && put(out, o, ocap, s->key, s->key_len) && put(out, o, ocap, cap, cap_len)
            && put(out, o, ocap, s->tail, s->tail_len))
            return 1;
    } else {
        if ((dn == 6 && memcmp(d, "[DONE]", 6) == 0) || looks_like_error(d, dn)) return -1;
        const char *at = s->from_len ? memmem(d, dn, s->from, s->from_len) : NULL;
        int ok = put(out, o, ocap, "data: ", 6);
        if (at != NULL)
            ok = ok && put(out, o, ocap, d, (int)(at - d)) && put(out, o, ocap, s->to, s->to_len)
                 && put(out, o, ocap, at + s->from_len, dn - (int)(at - d) - s->from_len);
        else
            ok = ok && put(out, o, ocap, d, dn);
        if (ok && put(out, o, ocap, "\n\n", 2)) return 1;
    }
    *o = start;
    return 0;
}

/* n's last `width` decimal digits at p. */
static void digits(char *p, long n, int width) {
    for (int i = width - 1; i >= 0; i--) { p[i] = (char)('0' + n % 10); n /= 10; }
}

/* Now as RFC 3339, UTC, microseconds: 2026-01-02T03:04:05.123456+00:00 (32 bytes). Written by
 * hand, as the size line is: snprintf's machinery for the size line alone was 6% of this
 * thread's time (perf, one stream), and strftime is heavier. */
static int stamp_now(char *buf) {
    struct timespec t;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &t);
    gmtime_r(&t.tv_sec, &tm);
    memcpy(buf, "0000-00-00T00:00:00.000000+00:00", 32);
    digits(buf, tm.tm_year + 1900L, 4);
    digits(buf + 5, tm.tm_mon + 1, 2);
    digits(buf + 8, tm.tm_mday, 2);
    digits(buf + 11, tm.tm_hour, 2);
    digits(buf + 14, tm.tm_min, 2);
    digits(buf + 17, tm.tm_sec, 2);
    digits(buf + 20, t.tv_nsec / 1000, 6);
    return 32;
}

/* A chunk's size line ("%x\r\n") ending at end: its length. */
static int size_line(char *end, int n) {
    char *p = end;
    *--p = '\n'; *--p = '\r';
    do { *--p = "0123456789abcdef"[n & 15]; n >>= 4; } while (n);
    return (int)(end - p);
}

/* Wait until the client takes out[*off..*off+*len): 0 when it has, else why not. */
static int send_all(int dst, int stop, char *out, int *off, int *len) {
    while (*len > 0) {
        ssize_t n = send(dst, out + *off, *len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) { *off += (int)n; *len -= (int)n; continue; }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return JL_CLIENT_GONE;
        struct pollfd p[2] = {{dst, POLLOUT | POLLRDHUP, 0}, {stop, POLLIN, 0}};
        if (poll(p, 2, -1) < 0 && errno != EINTR) return JL_STOPPED;
        if (p[1].revents) return JL_STOPPED;
        if (p[0].revents & (POLLRDHUP | POLLHUP | POLLERR)) return JL_CLIENT_GONE;
    }
    return 0;
}

static int relay(int ep, int src, int dst, int stop, const struct jl_spec *s, char *buf, int cap, char *out,
                 int ocap, struct jl_state *st) {
    int have = 0, pos = 0, why = 0;
    char stamp[32];
    for (;;) {
        /* the complete chunks read so far, into one chunk of ours */
        int o = FRAME, relayed = 0, stamp_len = 0;
        int full = 0;
        while (!why) {
            const char *c = buf + pos, *end = buf + have;
            const char *eol = memchr(c, '\r', end - c);
            if (eol == NULL || eol + 1 >= end) break; /* its size line is still to come */
            long size = 0;
            const char *h = c;
            for (; h < eol; h++) {
                int v = (*h >= '0' && *h <= '9') ? *h - '0' : (*h >= 'a' && *h <= 'f') ? *h - 'a' + 10
                        : (*h >= 'A' && *h <= 'F') ? *h - 'A' + 10 : -1;
                if (v < 0 || size > (1L << 24)) break;
                size = size * 16 + v;
            }
            if (h != eol || h == c || eol[1] != '\n' || size == 0) { why = JL_GIVE_BACK; break; }
            const char *data = eol + 2;
            if (data + size + 2 > end) {
                if ((long)(data - buf) + size + 2 > cap) why = JL_GIVE_BACK; /* larger than our buffer */
                break;
            }
            if (data[size] != '\r' || data[size + 1] != '\n' || data[size - 1] != '\n') { why = JL_GIVE_BACK; break; }
            if (s->mode == JL_TEMPLATE && stamp_len == 0) stamp_len = stamp_now(stamp);
            int mark = o, n_events = 0, ok = 1;
            for (const char *l = data; l < data + size;) {
                const char *nl = memchr(l, '\n', data + size - l);
                int ln = (int)(nl - l);
                if (ln > 0 && l[ln - 1] == '\r') ln--;
                int r = one_line(s, l, ln, out, &o, ocap - 2, stamp, stamp_len);
                if (r < 0) { why = JL_GIVE_BACK; ok = 0; break; }
                if (r == 0) { full = 1; ok = 0; break; }
                n_events += ln > 0;
                l = nl + 1;
            }
            if (!ok) { o = mark; break; } /* this chunk is left whole: to Python, or for the next round */
            relayed += n_events;
            pos = (int)(data + size + 2 - buf);
        }
        if (full && o == FRAME) why = JL_GIVE_BACK; /* one event larger than all of ours */
        if (o > FRAME) {
            int hl = size_line(out + FRAME, o - FRAME);
            out[o++] = '\r'; out[o++] = '\n';
            int off = FRAME - hl, len = o - off;
            int r = send_all(dst, stop, out, &off, &len);
            st->events += relayed;
            if (r) {
                st->unsent_off = off; st->unsent_len = len;
                st->left_off = pos; st->left_len = have - pos;
                return r;
            }
        }
        if (why) break;
        if (full) continue; /* more complete chunks are waiting for room in ours */
        if (pos > 0) { memmove(buf, buf + pos, have - pos); have -= pos; pos = 0; }
        if (have == cap) { why = JL_GIVE_BACK; break; }
        struct epoll_event ev[3];
        int n_ev = epoll_wait(ep, ev, 3, -1);
        if (n_ev < 0) {
            if (errno == EINTR) continue;
            why = JL_STOPPED; break;
        }
        unsigned got[3] = {0, 0, 0};
        for (int i = 0; i < n_ev; i++) got[ev[i].data.u32] |= ev[i].events;
        if (got[2]) { why = JL_STOPPED; break; }
        if (got[1] & (EPOLLRDHUP | EPOLLHUP | EPOLLERR)) { why = JL_CLIENT_GONE; break; }
        if (got[0]) {
            ssize_t n = recv(src, buf + have, cap - have, MSG_DONTWAIT);
            if (n > 0) have += (int)n;
            else if (n == 0) { why = JL_CHILD_ENDED; break; }
            else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) { why = JL_CHILD_ENDED; break; }
        }
    }
    st->left_off = pos; st->left_len = have - pos;
    return why;
}

static void unwatch(int ep, const int *fds, int n) {
    for (int i = 0; i < n; i++) epoll_ctl(ep, EPOLL_CTL_DEL, fds[i], NULL);
}

/* Watch src for the child's bytes, dst for the client hanging up and stop for a byte, on the
 * thread's own epoll set `ep` (one wait a token, where a poll of the three set up and took down
 * three waits each time): 0, or -1 when they cannot be watched. */
static int watch(int ep, const int fds[3]) {
    const unsigned what[3] = {EPOLLIN, EPOLLRDHUP, EPOLLIN};
    for (int i = 0; i < 3; i++) {
        struct epoll_event e = {.events = what[i], .data.u32 = (unsigned)i};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, fds[i], &e) < 0) {
            unwatch(ep, fds, i);
            return -1;
        }
    }
    return 0;
}

int jl_relay(int ep, int src, int dst, int stop, const struct jl_spec *s, char *buf, int cap, char *out, int ocap,
             struct jl_state *st) {
    const int fds[3] = {src, dst, stop};
    st->events = 0; st->unsent_off = st->unsent_len = 0; st->left_off = st->left_len = 0;
    if (watch(ep, fds) < 0) return JL_GIVE_BACK; /* (nothing read: Python goes on with it) */
    int why = relay(ep, src, dst, stop, s, buf, cap, out, ocap, st);
    unwatch(ep, fds, 3);
    return why;
}
