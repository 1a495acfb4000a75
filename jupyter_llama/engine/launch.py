"""The llama-server command line for a model under its load options.

Secrets never go on the command line (any local user can read another process's argv):
the per-child API key travels in the child's environment as ``LLAMA_API_KEY``.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..load_options import LoadOptions, memory_args

# The chat template a model without one of its own is run with: Ollama's default template,
# ``{{ .Prompt }}`` (the bare prompt), as llama-server's Jinja. Ollama renders a conversation
# through it turn by turn, and only the users' texts come out: no system text, no earlier
# answers, no role markers. Without it llama-server falls back to ChatML, whose control words
# a base model has never seen and goes on writing.
BARE_PROMPT_CHAT_TEMPLATE = ("{%- for message in messages -%}{%- if message['role'] == 'user' -%}"
                             "{{ message['content'] }}{%- endif -%}{%- endfor -%}")

# Verbosity 4 makes libllama print its INFO lines: the memory figures we read back.
LOG_ARGS = ("--log-verbosity", "4", "--no-log-prefix", "--no-log-timestamps")


def build_argv(binary: str | os.PathLike, model: str | os.PathLike, options: LoadOptions, *,
               port: int, host: str = "127.0.0.1", alias: str | None = None) -> list[str]:
    """The llama-server command line for ``model`` under ``options`` (no secrets in it)."""
    o = options
    argv = [str(binary), "--model", str(Path(model)), "--host", host, "--port", str(port)]
    if alias:
        argv += ["--alias", alias]
    argv += memory_args(o)
    if o.num_thread is not None:
        argv += ["-t", str(o.num_thread)]
    if o.use_mmap is not None:  # this llama.cpp spells it --load-mode (--no-mmap is gone)
        argv += ["--load-mode", "mmap" if o.use_mmap else "none"]
    if o.kv_unified is not None:
        argv += ["-kvu" if o.kv_unified else "-no-kvu"]
    if o.mmproj:
        argv += ["--mmproj", str(o.mmproj)]
        if not o.mmproj_offload:
            argv += ["--no-mmproj-offload"]
    if o.embedding:
        argv += ["--embedding"]
    if o.fit is not None:
        argv += ["-fit", "on" if o.fit else "off"]
    if o.fit_target_mib is not None and o.gpu_automatic and o.fit is not False:
        argv += ["--fit-target", ",".join(str(x) for x in o.fit_target_mib)]
    # No web UI in a managed child; the manager is the front end. The Jinja chat templates
    # (tools, reasoning, the model's own template) are this build's default; said anyway, so
    # an older llama-server found on PATH runs them too.
    argv += ["--no-webui", "--jinja", *LOG_ARGS]
    return argv
