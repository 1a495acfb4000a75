"""Ollama's REST wire format (REFERENCE section 6) as pure functions.

- :mod:`.fields`: a request's JSON body (:func:`parse_body`) and the readers of its fields.
- :mod:`.messages`: chat messages and images as llama-server's chat route takes them.
- :mod:`.requests`: ``parse_*``, each request as a small dataclass of what goes to
  llama-server, with the model's preset (a Modelfile's parameters, system message,
  messages and template) applied as Ollama applies it.
- :mod:`.stream`: the chunks of streamed answers, and the translators from llama-server's
  events to them.
- :mod:`.bodies`: the answers that are not streamed (``/api/ps``, ``/api/tags``,
  ``/api/show``, ``/api/embed``) and the model's capabilities.

No I/O and no HTTP here: the handlers call these. Every name is importable from here, as
it was when this was one module.
"""

from __future__ import annotations

from .bodies import (
    BARE_PROMPT_TEMPLATE,
    OLLAMA_VERSION,
    capabilities_of,
    check_capabilities,
    embed_body,
    mean_pool_normalize,
    model_capabilities,
    ps_body,
    ps_model,
    show_body,
    tags_body,
    unit_vectors,
)
from .fields import MAX_JSON_DEPTH, model_name, parse_body
from .requests import (
    MAX_TOP_LOGPROBS,
    ChatRequest,
    CreateRequest,
    EmbedRequest,
    GenerateRequest,
    PullRequest,
    check_context,
    parse_chat,
    parse_copy,
    parse_create,
    parse_delete,
    parse_embed,
    parse_embeddings,
    parse_generate,
    parse_pull,
    parse_show,
)
from .stream import (
    ChatTranslator,
    ContextGenerateTranslator,
    GenerateTranslator,
    TemplatedChatTranslator,
    ThinkingGenerateTranslator,
    error_chunk,
    load_chunk,
    ndjson,
    rfc3339,
    stats_from_timings,
)

__all__ = [
    "OLLAMA_VERSION",
    "parse_body",
    "GenerateRequest",
    "ChatRequest",
    "EmbedRequest",
    "PullRequest",
    "CreateRequest",
    "parse_generate",
    "parse_chat",
    "parse_embed",
    "parse_embeddings",
    "parse_show",
    "parse_pull",
    "parse_copy",
    "parse_delete",
    "parse_create",
    "check_context",
    "rfc3339",
    "GenerateTranslator",
    "ContextGenerateTranslator",
    "ChatTranslator",
    "load_chunk",
    "error_chunk",
    "stats_from_timings",
    "ps_body",
    "ps_model",
    "tags_body",
    "show_body",
    "embed_body",
    "mean_pool_normalize",
    "unit_vectors",
    # also used by the handlers and tests
    "MAX_JSON_DEPTH",
    "MAX_TOP_LOGPROBS",
    "BARE_PROMPT_TEMPLATE",
    "model_name",
    "ndjson",
    "TemplatedChatTranslator",
    "ThinkingGenerateTranslator",
    "capabilities_of",
    "model_capabilities",
    "check_capabilities",
]
