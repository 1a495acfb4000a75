"""Model files uploaded by their digest, as Ollama's clients send them before a create.

    HEAD   api/blobs/sha256:<hex>        200 present / 404 absent
    POST   api/blobs/sha256:<hex>        streamed upload, 201
"""

from __future__ import annotations

import asyncio
import queue

from jupyter_server.auth.decorator import authorized
from tornado import web

from ...errors import Forbidden
from ...models.store import free_bytes, normalize_digest, storage_full
from ...scheduler import BadRequest
from .base import AUTH_RESOURCE, ClientGone, LlamaHandler, PayloadTooLarge, api_method

_ABORT = object()


@web.stream_request_body
class BlobHandler(LlamaHandler):
    """``HEAD|POST api/blobs/sha256:<hex>``: the digest is checked before anything touches disk,
    the body streams to the store (hashed on the way, bounded by ``max_upload_size``)."""

    def initialize(self, name: str, *args, **kwargs) -> None:
        super().initialize(name, *args, **kwargs)
        self._queue: queue.Queue | None = None
        self._receiver: asyncio.Future | None = None
        self._received = 0
        self._work = None
        self._refused: Exception | None = None  # answered once the body is in (see prepare)

    def _digest(self) -> str:
        digest = self.path_kwargs.get("digest", "")
        if not digest.startswith(("sha256:", "sha256-")):
            raise BadRequest(f"invalid digest {digest!r}: expected sha256:<64 hex digits>")
        return normalize_digest(digest)

    async def prepare(self):
        await super().prepare()
        if self.request.method != "POST":
            return
        # The body streams in before post() (and its @web.authenticated) would run, so who is
        # sending is checked here, before a byte is accepted: nothing from strangers touches
        # the disk (a made-up _xsrf cookie and header pass the XSRF check, not this).
        if not self._authenticated():
            raise web.HTTPError(403)  # answered as a 401 with a sentence (write_error)
        if not self.authorizer.is_authorized(self, self.current_user, "write", AUTH_RESOURCE):
            raise web.HTTPError(403, "not allowed to upload blobs")
        try:
            who, hub = self.who, self.hub
            if who is not None and hub is not None and not who.admin and not hub.user_models:
                raise Forbidden(f"{who.name} may not upload model files: this service keeps no models of users' own")
            hexd = self._digest()
            limit = self.ext.max_upload_size
            length = self.request.headers.get("Content-Length")
            size = int(length) if length is not None and length.isdigit() else None
            if size is not None and size > limit:
                raise PayloadTooLarge(f"blob of {size:,} bytes is larger than the upload limit of {limit:,} "
                                      "bytes (LlamaExtension.max_upload_size)")
        except Exception as e:  # noqa: BLE001
            await self.fail(e)
            return
        self.request.connection.set_max_body_size(limit)
        if size is not None:
            # One that cannot fit is refused before a byte is written (a 507). The answer waits
            # for the body: answering first and closing the connection (as the 413 above does)
            # resets it under a client still sending, and the client never reads the answer.
            root = self.store.root
            free = await asyncio.to_thread(free_bytes, root)
            if free is not None and size > free:
                self._refused = storage_full(root, f"the upload of blob sha256:{hexd[:12]}", size, before=True)
                return
        self._work = self.ext.work()
        self._work.__enter__()
        self._queue = queue.Queue(maxsize=64)
        store = self.store
        # the queue is bound now: the receiver first reads it later, in the thread
        self._receiver = asyncio.ensure_future(asyncio.to_thread(self._receive, store, hexd, self._queue, size))
        # an aborted upload's error is nobody's to await: mark it seen
        self._receiver.add_done_callback(lambda f: f.cancelled() or f.exception())

    @staticmethod
    def _receive(store, hexd: str, q: "queue.Queue", size: int | None):
        """``store.receive_blob`` over the queued chunks. When it stops early (the disk filled
        up), the rest of the body is still taken from the queue, and dropped: else the request
        would wait forever to hand over its next chunk, and never be answered (the 507)."""
        ended = False

        def chunks():
            nonlocal ended
            while True:
                item = q.get()
                if item is None or item is _ABORT:
                    ended = True
                    if item is _ABORT:
                        raise ClientGone("upload aborted")
                    return
                yield item

        try:
            return store.receive_blob(hexd, chunks(), size)
        except BaseException:
            while not ended:
                item = q.get()
                ended = item is None or item is _ABORT
            raise

    async def data_received(self, chunk: bytes):
        if self._queue is None:
            return
        self._received += len(chunk)
        try:
            self._queue.put_nowait(chunk)
        except queue.Full:  # back-pressure: the writer thread is behind
            await asyncio.to_thread(self._queue.put, chunk)

    def _end_upload(self, item) -> None:
        if self._queue is not None:
            q, self._queue = self._queue, None
            try:
                q.put_nowait(item)
            except queue.Full:
                # the thread drains the queue; hand over the marker without blocking the loop
                asyncio.get_running_loop().run_in_executor(None, q.put, item)

    def on_connection_close(self) -> None:
        self._end_upload(_ABORT)
        super().on_connection_close()

    def on_finish(self) -> None:
        self._end_upload(_ABORT)
        if self._work is not None:
            self._work.__exit__(None, None, None)
            self._work = None

    @web.authenticated
    @authorized
    @api_method
    async def head(self, digest: str):
        hexd = self._digest()
        present = await asyncio.to_thread(self.store.has_blob, hexd)
        self.set_status(200 if present else 404)
        self.finish()

    @web.authenticated
    @authorized
    @api_method
    async def post(self, digest: str):
        if self._refused is not None:
            raise self._refused
        if self._receiver is None:  # prepare refused it (and answered)
            return
        self._end_upload(None)
        try:
            await self._receiver
        finally:
            self._receiver = None
        self.set_status(201)
        self.finish()
