"""Proving that a client runs as the server's own user: a server that is asked for a file by
path answers a 400 naming its key file, which only that user can read; the client sends the
key from then on."""

from __future__ import annotations

import os
import stat

import httpx

from .address import _is_loopback


def _local_key(r: httpx.Response) -> str | None:
    """The key a server asks this user's own clients to prove themselves with (it answers a
    file path with a 400 naming its key file). Read only from a file that is plainly such a key:
    the right name, a regular file of this user's, readable by nobody else, a few bytes."""
    from ..models.store import LOCAL_KEY_FILE_HEADER

    path = r.headers.get(LOCAL_KEY_FILE_HEADER)
    if r.status_code != 400 or not path or not _is_loopback(str(r.url)):
        return None
    name = os.path.basename(path)
    if not (name.startswith("jupyter-llama-local-") and name.endswith(".key")):
        return None
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077 or st.st_size > 128:
            return None
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _prove_local(headers: httpx.Headers, r: httpx.Response) -> bool:
    """Asked to prove this client runs as the server's user: send the key from now on (in
    ``headers``, its HTTP client's)."""
    from ..models.store import LOCAL_KEY_HEADER

    key = None if LOCAL_KEY_HEADER in headers else _local_key(r)
    if key:
        headers[LOCAL_KEY_HEADER] = key
    return key is not None
