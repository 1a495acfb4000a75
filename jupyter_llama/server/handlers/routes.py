"""The route table under ``<base_url>llama/``: each path pattern and the handler that answers it.

The last pattern takes any path no other one matched (a JSON 404 that names it), so the
order matters: every route goes before it.
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
)
from .anthropic import AnthropicHandler
from .blobs import BlobHandler
from .ollama import (
    ChatHandler,
    CopyHandler,
    CreateHandler,
    DeleteHandler,
    EmbeddingsHandler,
    EmbedHandler,
    GenerateHandler,
    PsHandler,
    PullHandler,
    PushHandler,
    RootHandler,
    ShowHandler,
    TagsHandler,
    VersionHandler,
)
from .openai import OpenAIHandler, OpenAIModelsHandler

__all__ = ["default_handlers"]


def default_handlers() -> list[tuple]:
    p = "/llama"
    return [
        (p + r"/?", RootHandler),
        (p + r"/api/generate", GenerateHandler),
        (p + r"/api/chat", ChatHandler),
        (p + r"/api/embed", EmbedHandler),
        (p + r"/api/embeddings", EmbeddingsHandler),
        (p + r"/api/ps", PsHandler),
        (p + r"/api/tags", TagsHandler),
        (p + r"/api/show", ShowHandler),
        (p + r"/api/pull", PullHandler),
        (p + r"/api/copy", CopyHandler),
        (p + r"/api/delete", DeleteHandler),
        (p + r"/api/prune", PruneHandler),
        (p + r"/api/create", CreateHandler),
        (p + r"/api/blobs/(?P<digest>[^/]+)", BlobHandler),
        (p + r"/api/version", VersionHandler),
        (p + r"/api/me", MeHandler),
        (p + r"/metrics", MetricsHandler),
        (p + r"/api/devices", DevicesHandler),
        (p + r"/api/estimate", EstimateHandler),
        (p + r"/api/log", LogHandler),
        (p + r"/api/events", EventsHandler),
        (p + r"/api/openapi\.json", OpenAPIHandler),
        (p + r"/v1/models", OpenAIModelsHandler),
        (p + r"/v1/models/(?P<model>.+)", OpenAIModelsHandler),
        (p + r"/v1/(?P<route>chat/completions|completions|embeddings|responses|responses/input_tokens)",
         OpenAIHandler),
        (p + r"/v1/(?P<route>messages|messages/count_tokens)", AnthropicHandler),
        (p + r"/api/push", PushHandler),
        (p + r"/(?P<path>.+)", UnknownRouteHandler),  # last: anything else is a JSON 404
    ]
