"""Downloads into the store: Ollama's registry, Hugging Face repos and plain http(s) URLs.

Sources (see :func:`parse_source`):

* a registry name, ``[host/][namespace/]model[:tag]`` (``llama3.2:1b``): Ollama's registry
  protocol (see :mod:`jupyter_llama.models.registry`): the manifest, then its layers as blobs: the GGUF, a
  projector, and the template, system, params, license and messages layers, which become the
  model's preset. The registry is ``JUPYTER_LLAMA_REGISTRY`` (default
  https://registry.ollama.ai); the model is filed under the registry's name
  (``registry.ollama.ai/library/llama3.2:1b``), which the bare name also finds and is shown
  by (``llama3.2:1b``, unless a model made here has that name). Pulling it again fetches the
  manifest again and downloads only the blobs the store lacks.
* ``hf.co/OWNER/REPO[:QUANT]``, ``huggingface.co/OWNER/REPO[:QUANT]``, ``hf://OWNER/REPO[:QUANT]``,
  ``https://huggingface.co/OWNER/REPO`` (a repo: the GGUF is chosen by quantisation tag and
  the multimodal projector, ``mmproj*.gguf``, comes along when the repo has one), and
  ``https://huggingface.co/OWNER/REPO/resolve/REV/FILE.gguf`` (that one file).
  The Hub is ``HF_ENDPOINT`` (default https://huggingface.co); the token (``HF_TOKEN``, else
  the one ``huggingface-cli login`` saved) is sent as a bearer token to it, and to nothing
  else. A file already in the Hugging Face cache (``HF_HOME``; what ``huggingface_hub``
  downloaded) with the sha256 the Hub states is hard-linked (else copied) into the store
  instead of downloaded again (see :mod:`jupyter_llama.models.hfcache`).
* any other ``http://`` or ``https://`` URL of a GGUF file.

How a blob is fetched:

* into ``partial/<key>.partial`` in the store; a pull that is interrupted (dropped
  connection, Ctrl-C, a closed stream) keeps the partial file, and the next pull of the same
  blob resumes it with ``Range`` (``If-Range`` guards against a changed file);
* a dropped connection is retried with ``Range`` a few times before it becomes an error;
* the sha256 is computed while the bytes arrive, and compared with the one the source
  states (the Hub's LFS oid, the registry's digest); a mismatch discards the download; the
  GGUF header (or a preset layer's text or JSON) is checked before the blob lands
  (atomically, by rename) and the manifest is written;
* a pull that fails after some of its blobs landed puts them back in ``partial/``, whole:
  nothing but resumable partial files is left behind, and the next pull finishes them
  without downloading them again;
* two pulls of the same blob at once download it once: in one process through a registry
  of downloads in flight (the second one follows the first's progress), across processes
  through a file lock per blob (the waiter reports the partial file's growth).

Progress is a stream of Ollama's status dicts: ``pulling manifest``, ``pulling <12 hex>``
with ``digest``, ``total``, ``completed``, ``verifying sha256 digest``, ``writing manifest``,
``success``. :func:`pull_stream` is an async generator of them (the download itself runs in a
worker thread, so nothing blocks the event loop); :func:`pull` is the same, synchronous,
calling ``progress(dict)``. Errors are raised (:class:`PullError` and subclasses); a server
turns them into a final ``{"error": ...}`` line.

Transfers use httpx (see :mod:`.download`): redirects are followed, and proxies come from the
environment (``https_proxy``, ``http_proxy``, ``all_proxy``, ``no_proxy``; credentials in the
proxy's URL are sent to it), never for this machine's loopback.

The package's parts: :mod:`.sources` (what the user typed, sorted), :mod:`.from_registry` and
:mod:`.from_hub` (what a source's files are), :mod:`.download` (one file, resumable, hashed),
:mod:`.puller` (a whole pull, into the store), :mod:`.progress` (statuses as text), and
:mod:`.errors`.
"""

from __future__ import annotations

from .download import BUFFER, _Sink
from .errors import (
    BadManifest,
    DiskFull,
    HashMismatch,
    NotAModel,
    NotInRegistry,
    PullCancelled,
    PullError,
    RegistryUnreachable,
)
from .from_hub import DEFAULT_QUANT_ORDER, PROJECTOR_PREFERENCE, choose_files
from .http_client import MAX_REDIRECTS
from .progress import ProgressPrinter, render_progress
from .puller import DISK_MARGIN, Puller, apull, pull, pull_stream
from .sources import DEFAULT_ENDPOINT, RemoteFile, Source, derive_name, parse_source

__all__ = [
    "PullError",
    "PullCancelled",
    "DiskFull",
    "HashMismatch",
    "NotAModel",
    "NotInRegistry",
    "RegistryUnreachable",
    "BadManifest",
    "Source",
    "RemoteFile",
    "Puller",
    "parse_source",
    "derive_name",
    "choose_files",
    "pull",
    "apull",
    "pull_stream",
    "render_progress",
    "ProgressPrinter",
    "DEFAULT_ENDPOINT",
    "DEFAULT_QUANT_ORDER",
    "PROJECTOR_PREFERENCE",
    "MAX_REDIRECTS",
    "DISK_MARGIN",
    "BUFFER",
    "_Sink",  # tests wrap its file to fill the disk part-way
]
