"""HTTP handlers under ``<base_url>llama/``: thin shells that parse, call the core, stream.

Routes (Ollama-compatible unless noted):

    POST   api/generate  api/chat        NDJSON stream (``stream: false``: one object)
    POST   api/embed  api/embeddings
    GET    api/ps  api/tags  api/version
    POST   api/show  api/pull  api/copy  api/create
    DELETE api/delete
    HEAD   api/blobs/sha256:<hex>        200 present / 404 absent
    POST   api/blobs/sha256:<hex>        streamed upload, 201
    POST   v1/chat/completions  v1/completions  v1/embeddings     (OpenAI; SSE when streaming)
    POST   v1/responses                                           (OpenAI Responses; named SSE events)
    POST   v1/responses/input_tokens                              (OpenAI: what a Responses input counts)
    POST   v1/messages  v1/messages/count_tokens                  (Anthropic; named SSE events)
    GET    v1/models  v1/models/<name>                            (OpenAI)
    POST   api/push                      501: not supported
    GET    api/devices  api/events  api/log  api/me  metrics    POST api/estimate  api/prune (ours)
    GET    api/openapi.json              this API's OpenAPI 3.1 description (server/openapi.json)

The modules: :mod:`.base` (who is asking, errors, the one streaming interface, activity),
:mod:`.ollama` (``api/*``), :mod:`.blobs` (``api/blobs``), :mod:`.openai` (``v1/*``),
:mod:`.anthropic` (``v1/messages``), :mod:`.admin` (our own routes), and :mod:`.routes`
(the table the extension serves, :func:`default_handlers`).
"""

from __future__ import annotations

from .admin import (
    DevicesHandler,
    EstimateHandler,
    EventsHandler,
    LogHandler,
    MeHandler,
    MetricsHandler,
    OpenAPIHandler,
    PruneHandler,
    UnknownRouteHandler,
    openapi_body,
)
from .anthropic import AnthropicHandler
from .base import (
    AUTH_RESOURCE,
    NDJSON,
    SSE,
    ClientGone,
    LlamaHandler,
    PayloadTooLarge,
    api_method,
    closing,
    dumps,
    error_status,
    finite,
)
from .blobs import BlobHandler
from .ollama import (
    ChatHandler,
    CopyHandler,
    CreateHandler,
    DeleteHandler,
    EmbeddingsHandler,
    EmbedHandler,
    GenerateHandler,
    GenerationHandler,
    PsHandler,
    PullHandler,
    PushHandler,
    RootHandler,
    ShowHandler,
    TagsHandler,
    VersionHandler,
)
from .openai import OpenAIHandler, OpenAIModelsHandler
from .routes import default_handlers

__all__ = [
    "AUTH_RESOURCE", "NDJSON", "SSE", "AnthropicHandler", "BlobHandler", "ChatHandler", "ClientGone", "CopyHandler",
    "CreateHandler", "DeleteHandler", "DevicesHandler", "EmbedHandler", "EmbeddingsHandler", "EstimateHandler",
    "EventsHandler", "GenerateHandler", "GenerationHandler", "LlamaHandler", "LogHandler", "MeHandler",
    "MetricsHandler", "OpenAIHandler", "OpenAIModelsHandler", "OpenAPIHandler", "PayloadTooLarge", "PruneHandler",
    "PsHandler", "PullHandler", "PushHandler", "RootHandler", "ShowHandler", "TagsHandler", "UnknownRouteHandler",
    "VersionHandler", "api_method", "closing", "default_handlers", "dumps", "error_status", "finite", "openapi_body",
]

# jupyter_server's Prometheus metrics label each request with its handler's module and class
# (``handler="jupyter_llama.server.handlers.TagsHandler"``). The handlers keep the module
# name they had before this package was split into modules, so those labels, and the
# dashboards and alerts that select on them, stay as they were.
for _route in default_handlers():
    _route[1].__module__ = __name__
del _route
