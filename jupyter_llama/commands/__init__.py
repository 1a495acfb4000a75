"""One grammar for ``%llama WORDS`` and ``jupyter-llama WORDS``, and the commands behind it.

The parser and the command functions are shared; only the front end differs. A front end
implements :class:`Frontend` (how to print, stream, show progress, and which manager to
talk to): the CLI prints to the terminal, the magic updates display handles in a cell.
Commands raise :class:`CommandError` for anything the user can fix; the CLI turns it into
an exit status and a one-line message, the magic into a ``UsageError``.

- :mod:`.frontend`: :class:`Frontend`, :class:`RunResult`, :class:`CommandError`, exit statuses.
- :mod:`.grammar`: the parser (:func:`build_parser`, :func:`parse`) and :func:`execute`.
- :mod:`.options`: the options several commands share.
- :mod:`.helpers`: what the commands share (prompts, client calls, sizes).
- :mod:`.run`: ``run``, ``chat``, ``load``: answers streamed.
- :mod:`.manager`: ``status``, ``ps``, ``stop``, ``log``, ``explain``.
- :mod:`.models`: ``list``, ``show``, ``pull``, ``create``, ``synth``, ``cp``, ``rm``,
  ``prune``, ``inspect``.
- :mod:`.memory`: ``estimate``, ``devices``, ``plot``.
- :mod:`.engine`: ``engine build``, ``engine status``, ``worker``.

Every name the front ends and tests use is importable from here, as it was when this was one
module. A test that replaces a name a command looks up (``monkeypatch.setattr``) replaces it
in the module that defines the command, such as :mod:`.run`.
"""

from __future__ import annotations

from .engine import cmd_engine_build, cmd_engine_status, cmd_worker
from .frontend import (
    EXIT_FAIL,
    EXIT_OK,
    EXIT_USAGE,
    CommandError,
    Frontend,
    RunResult,
    StreamStopped,
)
from .grammar import _HelpShown, build_parser, close_matches, cmd_help, execute, parse
from .helpers import ModelMissing, fill_placeholders
from .manager import _until, cmd_explain, cmd_log, cmd_ps, cmd_status, cmd_stop, describe_event, human_duration
from .memory import cmd_devices, cmd_estimate, cmd_plot
from .models import cmd_cp, cmd_create, cmd_inspect, cmd_list, cmd_prune, cmd_pull, cmd_rm, cmd_show, cmd_synth
from .options import (
    DEFAULT_NUM_PREDICT,
    LOAD_OPTIONS,
    SAMPLING_OPTIONS,
    SHAPE_FIELDS,
    SYNTH_FIELDS,
    _options,
)
from .run import LOADING_NOTE_AFTER, _generate, _placement, cmd_chat, cmd_load, cmd_run

__all__ = [
    "EXIT_OK",
    "EXIT_FAIL",
    "EXIT_USAGE",
    "CommandError",
    "Frontend",
    "RunResult",
    "StreamStopped",
    "ModelMissing",
    "build_parser",
    "parse",
    "execute",
    "close_matches",
    "fill_placeholders",
    "describe_event",
    "human_duration",
    "DEFAULT_NUM_PREDICT",
    "LOAD_OPTIONS",
    "SAMPLING_OPTIONS",
    "SHAPE_FIELDS",
    "SYNTH_FIELDS",
    "LOADING_NOTE_AFTER",
    "cmd_run",
    "cmd_chat",
    "cmd_load",
    "cmd_stop",
    "cmd_status",
    "cmd_ps",
    "cmd_log",
    "cmd_list",
    "cmd_show",
    "cmd_pull",
    "cmd_create",
    "cmd_synth",
    "cmd_cp",
    "cmd_rm",
    "cmd_prune",
    "cmd_estimate",
    "cmd_explain",
    "cmd_devices",
    "cmd_inspect",
    "cmd_engine_build",
    "cmd_engine_status",
    "cmd_worker",
    "cmd_plot",
    "cmd_help",
    # private, used by the front ends and tests
    "_HelpShown",
    "_options",
    "_until",
    "_generate",
    "_placement",
]
