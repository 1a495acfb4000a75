/* The token relay below Python (see native.py): llama-server children's chunked streams of
 * server-sent events, each read from one socket, and the clients' chunked streams written on
 * others, all of them by one thread that holds no Python lock (the hub, jl_hub_run), waiting
 * on one epoll set: a batch of eight slots' tokens wakes it fewer times than it would eight
 * threads, one a stream.
 *
 * It relays only the events it can write exactly as the Python relay would (a token of
 * text, one event per line of "data: ..."), and stops at the first chunk that holds any
 * other line (the last event with its timings, an error, a tool call, [DONE], the end of the
 * body), leaving that chunk and everything after it, unread by it, to the Python relay. It
 * also stops when the child's connection ends, when the client hangs up, and when told to
 * (a byte on the stream's `stop`). Each time a stream stops, its number goes to its
 * `notify` pipe (its event loop's, which reads it), for Python to take it back.
 *
 * One exception: a JL_SSE spec with an `end` (what Python writes for the child's [DONE],
 * "data: [DONE]" and a blank line) ends the client's answer itself. A chunk whose events
 * are all its own and whose last is [DONE] goes out with `end` in place of the [DONE],
 * then the body's last chunk (0 and a blank line), and the stream stops (JL_FINISHED) with
 * the child's bytes after that chunk (its own body's end) left to Python, which writes
 * nothing more for it. The client has all of its answer without waiting for Python.
 *
 * Two ways to write an event:
 *   JL_TEMPLATE  an Ollama line: the event must start as the spec's pattern says (literal
 *                bytes, and \001 for digits, \002 for a JSON string, captured, that is not "",
 *                \003 for digits and commas); the line is head, the time (RFC 3339, UTC,
 *                microseconds), key, the captured string as the child spelled it, tail.
 *   JL_SSE       the event as it came ("data: ", its JSON, a blank line), with its first
 *                `from` replaced by `to` when `from` is given (the model's name).
 *
 * A stream may also be started before the child's answer has begun, with our answer's head
 * (`ours`), which the handler has made and not sent: the relay then reads the child's head
 * first. When it is "HTTP/1.1 200" with chunked framing, ours goes out at once, as Python
 * would send it (llama-server sends its head as it takes the request, and the client reads
 * ours while the first token is made), without the Python beside the child's prompt; any
 * other head (an error's status, a body of fixed length) stops it, with every byte of it
 * left unread, and ours unsent, for Python (jl_state.head says which).
 *
 * A JL_TEMPLATE spec with a `done` pattern ends the client's answer too: the child's last
 * event (one that starts as that pattern says, with its stop type and timings) becomes
 * Ollama's last line, head, the time, `done_key`, the reason ("length" for a stop at the
 * token limit, else "stop"), the durations and counts Python's stats_from_timings gives
 * (the total from the spec's `started` to now), "}" and a line end; then the body's last
 * chunk, and the stream stops (JL_FINISHED), as with [DONE] above. An event that says
 * less than that (no timings, say) goes to Python, which writes its line.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

enum { JL_TEMPLATE = 0, JL_SSE = 1 };
enum { JL_GIVE_BACK = 1, JL_CHILD_ENDED = 2, JL_CLIENT_GONE = 3, JL_STOPPED = 4, JL_FINISHED = 5 };

struct jl_spec {
    int mode;
    const char *pat; int pat_len;
    const char *head; int head_len;
    const char *key; int key_len;
    const char *tail; int tail_len;
    const char *from; int from_len;
    const char *to; int to_len;
    const char *end; int end_len; /* JL_SSE: written for [DONE], then the body's end (none: [DONE] is Python's) */
    /* JL_TEMPLATE: the child's last event, as a pattern (none: it is Python's), our last line's
     * bytes between the time and the reason, and its load duration (',"load_duration":N') */
    const char *done; int done_len;
    const char *done_key; int done_key_len;
    const char *load; int load_len;
    long long started; /* the request's start, CLOCK_MONOTONIC, in ns */
};

struct jl_state {
    long events;      /* events relayed */
    int left_off, left_len;      /* the child's bytes not relayed, in buf */
    int unsent_off, unsent_len;  /* our bytes the client has not taken, in out */
    int head;         /* started with ours: JL_HEAD_SENT once the child's was read (200, chunked) and ours put out */
};

enum { JL_HEAD_SENT = 1 };

#define FRAME 12 /* room before a chunk's data for its size line */
#define LAST "\r\n0\r\n\r\n" /* a chunk's end, then the body's last chunk */
#define ROOM 7 /* (its length: kept free at the end of ours) */

/* The end of a JSON string starting at p (its opening quote), or NULL. */
static const char *json_string_end(const char *p, const char *end) {
    if (p >= end || *p != '"') return NULL;
    for (p++; p < end; p++) {
        if (*p == '\\') { if (++p >= end) return NULL; }
        else if (*p == '"') return p + 1;
    }
    return NULL;
}

static int put(char *out, int *o, int ocap, const char *p, int n) {
    if (*o + n > ocap) return 0;
    memcpy(out + *o, p, n);
    *o += n;
    return 1;
}

/* Does the event d[0..n) start as the pattern pat[0..pat_len) says? Sets the captured string. */
static int starts_as(const char *pat, int pat_len, const char *d, int n, const char **cap, int *cap_len) {
    const char *p = d, *end = d + n, *q = pat, *qend = pat + pat_len;
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
    return 1;
}

/* The last key (its quoted name and colon) in d[0..n), or NULL. A key inside a JSON string
 * cannot match: its quotes there are escaped. */
static const char *last_key(const char *d, int n, const char *key) {
    int k = (int)strlen(key);
    if (n < k) return NULL;
    for (const char *p = d + n - k; p >= d; p--)
        if (*p == '"' && memcmp(p, key, k) == 0) return p + k;
    return NULL;
}

/* The JSON number at p (before end), as text, NUL-terminated in num; 0 when there is none. */
static int number_at(const char *p, const char *end, char *num, int cap) {
    int i = 0;
    while (p + i < end && i < cap - 1
           && ((p[i] >= '0' && p[i] <= '9') || p[i] == '-' || p[i] == '+' || p[i] == '.' || p[i] == 'e' || p[i] == 'E'))
        { num[i] = p[i]; i++; }
    num[i] = 0;
    return i > 0 && p + i < end && (p[i] == ',' || p[i] == '}');
}

/* The last value of a key in t[0..end) when it is a JSON number, as text in num; 0 when not. */
static int number_of(const char *t, const char *end, const char *key, char *num, int cap) {
    const char *p = last_key(t, (int)(end - t), key);
    return p != NULL && number_at(p, end, num, cap);
}

/* An integer key's value, as Python's int() of the JSON number it is. */
static int int_of(const char *t, const char *end, const char *key, long long *v) {
    char num[40], *e;
    if (!number_of(t, end, key, num, sizeof num)) return 0;
    *v = strtoll(num, &e, 10);
    return *e == 0;
}

/* A milliseconds key's value in ns, as Python's int(float(ms) * 1e6). */
static int ns_of(const char *t, const char *end, const char *key, long long *v) {
    char num[40], *e;
    if (!number_of(t, end, key, num, sizeof num)) return 0;
    double ms = strtod(num, &e);
    if (*e != 0 || !(ms * 1e6 > -9.2e18 && ms * 1e6 < 9.2e18)) return 0;
    *v = (long long)(ms * 1e6);
    return 1;
}

static int put_int(char *out, int *o, int ocap, long long v) {
    char b[24];
    int i = 24, neg = v < 0;
    unsigned long long u = neg ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do { b[--i] = (char)('0' + u % 10); u /= 10; } while (u);
    if (neg) b[--i] = '-';
    return put(out, o, ocap, b + i, 24 - i);
}

/* Ollama's last line for the child's last event d[0..n): 1 written, 0 no room, -1 not ours
 * (the event says less than the line needs: Python writes it). */
static int done_line(const struct jl_spec *s, const char *d, int n, char *out, int *o, int ocap,
                     const char *stamp, int stamp_len) {
    const char *end = d + n, *cap;
    int cap_len;
    if (!starts_as(s->done, s->done_len, d, n, &cap, &cap_len)) return -1;
    const char *why = last_key(d, n, "\"stop_type\":");
    const char *t = last_key(d, n, "\"timings\":");
    if (why == NULL || t == NULL || *t != '{') return -1;
    const char *why_end = json_string_end(why, end);
    if (why_end == NULL) return -1;
    int limit = why_end - why == 7 && memcmp(why, "\"limit\"", 7) == 0;
    const char *t_end = memchr(t, '}', end - t); /* (its values are numbers: the first } closes it) */
    long long prompt_n, cache_n, prompt_ns, predicted_n, predicted_ns;
    if (t_end == NULL || !int_of(t, t_end + 1, "\"prompt_n\":", &prompt_n) || !int_of(t, t_end + 1, "\"cache_n\":", &cache_n)
        || !ns_of(t, t_end + 1, "\"prompt_ms\":", &prompt_ns) || !int_of(t, t_end + 1, "\"predicted_n\":", &predicted_n)
        || !ns_of(t, t_end + 1, "\"predicted_ms\":", &predicted_ns))
        return -1;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    long long total = (long long)now.tv_sec * 1000000000LL + now.tv_nsec - s->started;
    int start = *o;
    if (put(out, o, ocap, s->head, s->head_len) && put(out, o, ocap, stamp, stamp_len)
        && put(out, o, ocap, s->done_key, s->done_key_len)
        && put(out, o, ocap, limit ? "length" : "stop", limit ? 6 : 4)
        && put(out, o, ocap, "\",\"total_duration\":", 19) && put_int(out, o, ocap, total < 0 ? 0 : total)
        && put(out, o, ocap, s->load, s->load_len)
        && put(out, o, ocap, ",\"prompt_eval_count\":", 21) && put_int(out, o, ocap, prompt_n + cache_n)
        && put(out, o, ocap, ",\"prompt_eval_duration\":", 24) && put_int(out, o, ocap, prompt_ns)
        && put(out, o, ocap, ",\"eval_count\":", 14) && put_int(out, o, ocap, predicted_n)
        && put(out, o, ocap, ",\"eval_duration\":", 17) && put_int(out, o, ocap, predicted_ns)
        && put(out, o, ocap, "}\n", 2))
        return 1;
    *o = start;
    return 0;
}

/* An error event ({"error": ...}) goes to Python, which tells it as one. */
static int looks_like_error(const char *d, int n) {
    if (n < 1 || d[0] != '{') return 0;
    int i = 1;
    while (i < n && (d[i] == ' ' || d[i] == '\t' || d[i] == '\r' || d[i] == '\n')) i++;
    return n - i >= 7 && memcmp(d + i, "\"error\"", 7) == 0;
}

/* Our bytes for one line of an event's chunk: 1 written, 2 written and it was [DONE] (the
 * answer's end, with a spec's `end`), 0 no room, -1 not ours to write. */
static int one_line(const struct jl_spec *s, const char *line, int n, char *out, int *o, int ocap,
                    const char *stamp, int stamp_len) {
    if (n == 0) return 1; /* the blank line that ends an event */
    if (n < 6 || memcmp(line, "data: ", 6) != 0) return -1;
    const char *d = line + 6;
    int dn = n - 6;
    int start = *o;
    if (s->mode == JL_TEMPLATE) {
        const char *cap; int cap_len;
        if (!starts_as(s->pat, s->pat_len, d, dn, &cap, &cap_len) || cap == NULL) {
            if (s->done_len == 0) return -1;
            int r = done_line(s, d, dn, out, o, ocap, stamp, stamp_len);
            return r == 1 ? 2 : r;
        }
        if (put(out, o, ocap, s->head, s->head_len) && put(out, o, ocap, stamp, stamp_len)
            && put(out, o, ocap, s->key, s->key_len) && put(out, o, ocap, cap, cap_len)
            && put(out, o, ocap, s->tail, s->tail_len))
            return 1;
    } else {
        if (dn == 6 && memcmp(d, "[DONE]", 6) == 0) {
            if (s->end_len == 0) return -1;
            if (put(out, o, ocap, s->end, s->end_len)) return 2;
            *o = start;
            return 0;
        }
        if (looks_like_error(d, dn)) return -1;
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
 * hand, as the size line is: snprintf's machinery for the size line alone was 6% of the relay's
 * time (perf, one stream), strftime is heavier, and gmtime_r takes glibc's time-zone lock. The
 * date from the days since 1970 by the civil calendar (eras of 400 years, March-based years). */
static int stamp_now(char *buf) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    long days = t.tv_sec / 86400, secs = t.tv_sec % 86400;
    long z = days + 719468, era = z / 146097;
    long doe = z - era * 146097;                                  /* [0, 146096] */
    long yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365; /* [0, 399] */
    long doy = doe - (365 * yoe + yoe / 4 - yoe / 100);           /* [0, 365] */
    long mp = (5 * doy + 2) / 153;                                /* [0, 11], from March */
    long day = doy - (153 * mp + 2) / 5 + 1, month = mp < 10 ? mp + 3 : mp - 9;
    long year = yoe + era * 400 + (month <= 2);
    memcpy(buf, "0000-00-00T00:00:00.000000+00:00", 32);
    digits(buf, year, 4);
    digits(buf + 5, month, 2);
    digits(buf + 8, day, 2);
    digits(buf + 11, secs / 3600, 2);
    digits(buf + 14, secs / 60 % 60, 2);
    digits(buf + 17, secs % 60, 2);
    digits(buf + 20, t.tv_nsec / 1000, 6);
    return 32;
}

/* Is line[0..len) a header named `name` (with its colon), in any case, whose value has `has`? */
static int header_has(const char *line, int len, const char *name, const char *has) {
    int n = (int)strlen(name), h = (int)strlen(has);
    if (len < n || strncasecmp(line, name, n) != 0) return 0;
    for (const char *p = line + n; p + h <= line + len; p++)
        if (strncasecmp(p, has, h) == 0) return 1;
    return 0;
}

/* A chunk's size line ("%x\r\n") ending at end: its length. */
static int size_line(char *end, int n) {
    char *p = end;
    *--p = '\n'; *--p = '\r';
    do { *--p = "0123456789abcdef"[n & 15]; n >>= 4; } while (n);
    return (int)(end - p);
}

/* One stream the hub relays. Python holds its memory (jl_stream_size bytes) and reads its
 * outcome with jl_result once its number has come through `notify`. */
struct jl_stream {
    int src, dst, stop, id, notify;
    const struct jl_spec *spec;
    const char *ours; int ours_len; /* our answer's head, to go once the child's has come */
    int in_head;            /* the child's head is still to be read */
    char *buf; int cap;     /* the child's bytes: [pos, have) not parsed yet */
    char *out; int ocap;    /* ours: [unsent_off, unsent_off + unsent_len) not taken by the client */
    int have, pos;
    int why;                /* why it stops (once what is unsent has gone, for a GIVE_BACK) */
    int sending;            /* waiting for the client to take what is unsent (src not watched) */
    int over;               /* stopped: events still in this wait's batch are not for it */
    int drained;            /* the last read emptied the child's socket: wait for epoll, not read again */
    struct jl_state st;
    pthread_mutex_t lock;   /* held by jl_start while it adds the sockets, and by the hub for an event */
};

enum { SRC = 0, DST = 1, STOP = 2 };

/* The child's head, at the start of what has come: 1 read (a 200 with chunked framing: s->pos
 * is past it), 0 not all here yet, -1 not one the relay goes on from (nothing is consumed). */
static int child_head(struct jl_stream *s) {
    const char *b = s->buf + s->pos, *end = s->buf + s->have;
    const char *e = memmem(b, end - b, "\r\n\r\n", 4);
    if (e == NULL) return s->have == s->cap ? -1 : 0;
    if (e - b < 12 || memcmp(b, "HTTP/1.1 200", 12) != 0 || (e - b > 12 && b[12] != ' ' && b[12] != '\r')) return -1;
    int chunked = 0;
    for (const char *l = memchr(b, '\n', e - b); l != NULL && l < e;) {
        l++; /* (past the previous line's end) */
        const char *nl = memchr(l, '\n', e + 2 - l);
        int len = (int)((nl != NULL ? nl : e) - l);
        if (len > 0 && l[len - 1] == '\r') len--;
        if (header_has(l, len, "content-length:", "")) return -1; /* (a body of its own length: Python's) */
        if (header_has(l, len, "transfer-encoding:", "chunked")) chunked = 1;
        l = nl;
    }
    if (!chunked) return -1;
    s->pos = (int)(e + 4 - s->buf);
    s->in_head = 0;
    return 1;
}

static int arm(int ep, int op, int fd, unsigned events, struct jl_stream *s, int role) {
    struct epoll_event e = {.events = events, .data.u64 = (uint64_t)(uintptr_t)s | (uint64_t)role};
    return epoll_ctl(ep, op, fd, &e);
}

/* Read into chunks of ours what has come complete, in order, until one is not ours to write
 * (s->why = JL_GIVE_BACK), one ends the answer (s->why = JL_FINISHED: see the top) or ours is
 * full: ours is then at out[FRAME, o), and s->pos past the chunks it holds. Returns o. */
static int translate(struct jl_stream *s, int *relayed, int *full) {
    const struct jl_spec *sp = s->spec;
    char *buf = s->buf, stamp[32];
    int o = FRAME, stamp_len = 0;
    *relayed = 0; *full = 0;
    while (!s->why) {
        const char *c = buf + s->pos, *end = buf + s->have;
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
        if (h != eol || h == c || eol[1] != '\n' || size == 0) { s->why = JL_GIVE_BACK; break; }
        const char *data = eol + 2;
        if (data + size + 2 > end) {
            if ((long)(data - buf) + size + 2 > s->cap) s->why = JL_GIVE_BACK; /* larger than our buffer */
            break;
        }
        if (data[size] != '\r' || data[size + 1] != '\n' || data[size - 1] != '\n') { s->why = JL_GIVE_BACK; break; }
        if (sp->mode == JL_TEMPLATE && stamp_len == 0) stamp_len = stamp_now(stamp);
        int mark = o, n_events = 0, ok = 1, ended = 0;
        for (const char *l = data; l < data + size;) {
            const char *nl = memchr(l, '\n', data + size - l);
            int ln = (int)(nl - l);
            if (ln > 0 && l[ln - 1] == '\r') ln--;
            /* (after [DONE], only the blank line that ends it) */
            int r = ended && ln > 0 ? -1 : one_line(sp, l, ln, s->out, &o, s->ocap - ROOM, stamp, stamp_len);
            if (r < 0) { s->why = JL_GIVE_BACK; ok = 0; break; }
            if (r == 0) { *full = 1; ok = 0; break; }
            if (r == 2) ended = 1;
            else n_events += ln > 0;
            l = nl + 1;
        }
        if (!ok) { o = mark; break; } /* this chunk is left whole: to Python, or for the next round */
        *relayed += n_events;
        s->pos = (int)(data + size + 2 - buf);
        if (ended) { s->why = JL_FINISHED; break; }
    }
    if (*full && o == FRAME) s->why = JL_GIVE_BACK; /* one event larger than all of ours */
    return o;
}

/* Move the stream on as far as it goes without waiting: send what is unsent, translate and
 * send what has come, read what the child has sent. 0: it waits (for the child's bytes, or
 * for the client to take ours); else why it stops. */
static int pump(int ep, struct jl_stream *s) {
    for (;;) {
        while (s->st.unsent_len > 0) {
            ssize_t n = send(s->dst, s->out + s->st.unsent_off, s->st.unsent_len, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (n > 0) { s->st.unsent_off += (int)n; s->st.unsent_len -= (int)n; continue; }
            if (n < 0 && errno == EINTR) continue;
            if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return JL_CLIENT_GONE;
            if (!s->sending) { /* the client is behind: wait for it alone, reading nothing meanwhile */
                s->sending = 1;
                if (epoll_ctl(ep, EPOLL_CTL_DEL, s->src, NULL) < 0
                    || arm(ep, EPOLL_CTL_MOD, s->dst, EPOLLOUT | EPOLLRDHUP, s, DST) < 0)
                    return JL_STOPPED;
            }
            return 0;
        }
        if (s->sending) {
            s->sending = 0;
            if (arm(ep, EPOLL_CTL_MOD, s->dst, EPOLLRDHUP, s, DST) < 0 || arm(ep, EPOLL_CTL_ADD, s->src, EPOLLIN, s, SRC) < 0)
                return JL_STOPPED;
        }
        if (s->why) return s->why; /* (what came before the chunk it stopped at has gone) */
        if (s->in_head) {
            int r = child_head(s);
            if (r < 0) return JL_GIVE_BACK; /* (all of it unread: Python's) */
            if (r > 0) { /* ours goes now, as the child's came: the client reads it while the first token is made */
                memcpy(s->out, s->ours, s->ours_len);
                s->st.unsent_off = 0; s->st.unsent_len = s->ours_len;
                s->st.head = JL_HEAD_SENT;
                continue;
            }
        }
        int relayed = 0, full = 0, o = s->in_head ? FRAME : translate(s, &relayed, &full);
        if (o > FRAME) {
            int hl = size_line(s->out + FRAME, o - FRAME);
            int tail = s->why == JL_FINISHED ? ROOM : 2; /* (the body's last chunk too) */
            memcpy(s->out + o, LAST, tail);
            o += tail;
            s->st.unsent_off = FRAME - hl; s->st.unsent_len = o - s->st.unsent_off;
            s->st.events += relayed;
            continue; /* send it, then go on */
        }
        if (s->why) return s->why;
        if (full) continue;
        if (s->pos > 0) { memmove(s->buf, s->buf + s->pos, s->have - s->pos); s->have -= s->pos; s->pos = 0; }
        if (s->have == s->cap) return JL_GIVE_BACK;
        /* A read that took less than it asked for emptied the socket: another now would
         * almost always find nothing (a system call a token, a quarter of the relay's), and
         * the set is level-triggered, so what comes meanwhile wakes the hub at once. */
        if (s->drained) { s->drained = 0; return 0; }
        int room = s->cap - s->have;
        ssize_t n = recv(s->src, s->buf + s->have, room, MSG_DONTWAIT);
        if (n > 0) { s->have += (int)n; s->drained = n < room; continue; }
        if (n == 0) return JL_CHILD_ENDED;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        if (errno == EINTR) continue;
        return JL_CHILD_ENDED;
    }
}

int jl_stream_size(void) { return (int)sizeof(struct jl_stream); }

/* Start relaying a stream on the hub's set `ep`: 0, or -1 when its sockets cannot be watched
 * (nothing is read then: Python goes on with it, and does not start this one again, which
 * the hub may still be about to look at). The hub may hear of a socket before the next is
 * added: the lock keeps it waiting until all three are. Its number goes to `notify` when
 * it stops. With `ours` (ours_len > 0, less than half of ocap), the child's head is still
 * to come: see the top. */
int jl_start(int ep, struct jl_stream *s, int src, int dst, int stop, int id, int notify,
             const struct jl_spec *spec, char *buf, int cap, char *out, int ocap, const char *ours, int ours_len) {
    memset(s, 0, sizeof *s);
    pthread_mutex_init(&s->lock, NULL);
    s->src = src; s->dst = dst; s->stop = stop; s->id = id; s->notify = notify; s->spec = spec;
    s->buf = buf; s->cap = cap; s->out = out; s->ocap = ocap;
    if (ours_len > 0 && ours_len < ocap / 2) { s->ours = ours; s->ours_len = ours_len; s->in_head = 1; }
    const int fds[3] = {src, dst, stop};
    const unsigned what[3] = {EPOLLIN, EPOLLRDHUP, EPOLLIN};
    int ok = 1;
    pthread_mutex_lock(&s->lock);
    for (int i = 0; i < 3 && ok; i++) {
        if (arm(ep, EPOLL_CTL_ADD, fds[i], what[i], s, i) < 0) {
            for (int j = 0; j < i; j++) epoll_ctl(ep, EPOLL_CTL_DEL, fds[j], NULL);
            s->over = 1;
            ok = 0;
        }
    }
    pthread_mutex_unlock(&s->lock);
    return ok ? 0 : -1;
}

/* A stopped stream's outcome: why it stopped, and its counts and leftovers in st. */
int jl_result(const struct jl_stream *s, struct jl_state *st) {
    *st = s->st;
    st->left_off = s->pos; st->left_len = s->have - s->pos;
    return s->why;
}

#define BATCH 64

/* Numbers to one notify pipe, whole (a pipe takes up to 4 KiB in one write). */
static void tell(int fd, const int *ids, int n) {
    const char *p = (const char *)ids;
    size_t left = (size_t)n * sizeof(int);
    while (left > 0) {
        ssize_t w = write(fd, p, left);
        if (w > 0) { p += w; left -= (size_t)w; }
        else if (w < 0 && errno != EINTR) break;
    }
}

/* The hub: relay every stream started on `ep` until `ep` fails (it is never closed while the
 * process lives). A stopped stream's sockets leave the set at once; its number goes to its
 * `notify` after the rest of the batch, which may still name it (and is then passed by). */
void jl_hub_run(int ep) {
    struct epoll_event ev[BATCH];
    int ended[BATCH], to[BATCH];
    for (;;) {
        int n = epoll_wait(ep, ev, BATCH, -1);
        if (n < 0) {
            if (errno == EINTR) continue;
            return;
        }
        int n_ended = 0;
        for (int i = 0; i < n; i++) {
            struct jl_stream *s = (struct jl_stream *)(uintptr_t)(ev[i].data.u64 & ~(uint64_t)3);
            int role = (int)(ev[i].data.u64 & 3);
            unsigned e = ev[i].events;
            pthread_mutex_lock(&s->lock);
            int why = 0;
            if (s->over) why = 0;
            else if (role == STOP) why = JL_STOPPED;
            else if (role == DST && (e & (EPOLLRDHUP | EPOLLHUP | EPOLLERR))) why = JL_CLIENT_GONE;
            else why = pump(ep, s);
            /* (told to stop while the answer's end waits for the client: it is still the end,
             * and what the client has not taken goes back to Python as unsent) */
            if (why == JL_STOPPED && s->why == JL_FINISHED) why = JL_FINISHED;
            if (why) {
                s->why = why; s->over = 1;
                if (!s->sending) epoll_ctl(ep, EPOLL_CTL_DEL, s->src, NULL);
                epoll_ctl(ep, EPOLL_CTL_DEL, s->dst, NULL);
                epoll_ctl(ep, EPOLL_CTL_DEL, s->stop, NULL);
                to[n_ended] = s->notify;
                ended[n_ended++] = s->id;
            }
            pthread_mutex_unlock(&s->lock);
        }
        for (int i = 0, j; i < n_ended; i = j) { /* (one write for each run of the same pipe) */
            for (j = i + 1; j < n_ended && to[j] == to[i]; j++) {}
            tell(to[i], ended + i, j - i);
        }
    }
}
