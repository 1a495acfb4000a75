"""A pull's statuses as text for a terminal: :func:`render_progress` (one line) and
:class:`ProgressPrinter` (one rewritten line per status, with a rate for downloads)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..store import fmt_bytes

__all__ = ["render_progress", "ProgressPrinter"]

def render_progress(status: dict, width: int = 25, rate: float | None = None) -> str:
    """One line of text for a status dict: ``pulling 3f2a1b9c8d7e  42% ▕██████    ▏ 210 MB/500 MB``."""
    if "error" in status:
        return f"error: {status['error']}"
    text = str(status.get("status", ""))
    total = status.get("total")
    completed = status.get("completed")
    if total and completed is not None:
        frac = max(0.0, min(1.0, completed / total))
        filled = int(frac * width)
        bar = "█" * filled + " " * (width - filled)
        line = f"{text} {frac * 100:3.0f}% ▕{bar}▏ {fmt_bytes(completed)}/{fmt_bytes(total)}"
        if rate:
            line += f"  {fmt_bytes(rate)}/s"
            if completed < total:
                left = (total - completed) / rate
                line += f"  {int(left // 60)}m{int(left % 60):02d}s" if left >= 60 else f"  {left:.0f}s"
        return line
    if completed is not None:
        return f"{text} {fmt_bytes(completed)}"
    return text


@dataclass
class ProgressPrinter:
    """Feeds status dicts to a terminal: one rewritten line per status, a rate for downloads."""

    write: Callable[[str], None] = field(default=lambda s: print(s, end="", flush=True))
    width: int = 25
    _last: str | None = None
    _t0: dict = field(default_factory=dict)

    def __call__(self, status: dict) -> None:
        text = str(status.get("status", ""))
        rate = None
        if status.get("total") and status.get("completed") is not None:
            now = time.monotonic()
            t0, c0 = self._t0.setdefault(text, (now, status["completed"]))
            if now - t0 > 0.2:
                rate = (status["completed"] - c0) / (now - t0)
        line = render_progress(status, self.width, rate)
        if text == self._last:
            self.write("\r\x1b[K" + line)
        else:
            self.write(("\n" if self._last is not None else "") + line)
        self._last = text
        if text == "success":
            self.write("\n")
