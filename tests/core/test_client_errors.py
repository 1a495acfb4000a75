"""The client's error classes and the manager's errors come from one table: each status the
manager answers a refusal with raises, in the client, the class of that status."""

from __future__ import annotations

from jupyter_llama import client, errors
from jupyter_llama.models import pull  # noqa: F401  (the errors of pulls and of the server's
from jupyter_llama.server import handlers  # noqa: F401  handlers are among the manager's too)


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_refusal_status_has_its_client_class():
    # (499: a pull its own client cancelled, which no client is there to read)
    refusals = {c.status for c in _subclasses(errors.JupyterLlamaError)
                if (400 <= c.status < 500 or c.status in (503, 507)) and c.status != 499}
    assert refusals == {400, 403, 404, 409, 413, 429, 503, 507}
    for status in refusals:
        e = client._error(status, "what was wrong, and what to do")
        assert type(e) is not client.LlamaError and e.status == status
        assert str(e) == f"what was wrong, and what to do (HTTP {status})"
    assert isinstance(client._error(429, "quota"), client.QuotaExceededError)
    assert type(client._error(500, "a bug")) is client.LlamaError
