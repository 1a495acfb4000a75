"""When `jupyter-llama serve` is a Hub service, and what its server is told then (no Hub needed)."""

from __future__ import annotations

import pytest

from jupyter_llama.hub import service_environment
from jupyter_llama.server.serve import build_parser, server_argv

SERVICE = {"JUPYTERHUB_API_TOKEN": "t", "JUPYTERHUB_API_URL": "http://127.0.0.1:8081/hub/api",
           "JUPYTERHUB_SERVICE_PREFIX": "/services/llama/", "JUPYTERHUB_SERVICE_URL": "http://127.0.0.1:8765"}


@pytest.mark.parametrize("environ, expected", [
    (SERVICE, True),
    ({**SERVICE, "JUPYTERHUB_USER": "alice"}, False),  # a user's own server: not the Hub's service
    ({k: v for k, v in SERVICE.items() if k != "JUPYTERHUB_API_TOKEN"}, False),
    ({}, False),
])
def test_service_environment(environ, expected):
    assert service_environment(environ) is expected


def test_a_services_server(monkeypatch):
    for k, v in SERVICE.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("JUPYTERHUB_USER", raising=False)
    argv = server_argv(build_parser().parse_args([]))
    assert "--ServerApp.identity_provider_class=jupyter_llama.hub.identity.HubIdentityProvider" in argv
    assert "--ServerApp.base_url=/services/llama/" in argv
    assert "--ServerApp.ip=127.0.0.1" in argv and "--ServerApp.port=8765" in argv
    assert not any("IdentityProvider.token" in a for a in argv)
    # --no-hub: a plain server, whatever the environment says
    argv = server_argv(build_parser().parse_args(["--no-hub", "--port", "9000"]))
    assert "--ServerApp.identity_provider_class=jupyter_llama.server.identity.ApiTokenIdentityProvider" in argv
    assert "--ServerApp.port=9000" in argv


def test_hub_without_its_variables_is_said(monkeypatch, capsys):
    from jupyter_llama.server.serve import main

    for k in SERVICE:
        monkeypatch.delenv(k, raising=False)
    assert main(["--hub"]) == 2
    assert "--hub needs the Hub's service variables: JUPYTERHUB_API_TOKEN" in capsys.readouterr().err


@pytest.mark.engine
def test_a_wrong_quota_stops_the_service_with_its_sentence_and_leaves_nothing_running(engine, tmp_path):
    """The admin's mistake in the service's quotas: the service refuses to start with a sentence
    naming it (in the Hub's log), the Hub exits, and its proxy is not left behind."""
    import psutil  # type: ignore[import-untyped]  # (psutil ships no types)
    from hubutil import missing, start_hub

    why = missing()
    if why is not None:
        pytest.skip(why)

    (tmp_path / "models").mkdir()
    with pytest.raises(RuntimeError) as e:
        start_hub(tmp_path, engine_path=engine.path, models_dir=tmp_path / "models",
                  service_config={"quotas": {"default": {"per_hour": 10}}}, timeout=120)
    assert "LlamaHub.quotas.default: unknown quota 'per_hour'; the quotas are memory, models, concurrent, " \
           "per_minute" in str(e.value)
    assert not [p for p in psutil.process_iter() if _proxy_of(p, tmp_path)]


def _proxy_of(p, root) -> bool:
    """A configurable-http-proxy started for the Hub in ``root`` (its working folder)."""
    import psutil  # type: ignore[import-untyped]

    try:
        return "configurable-http-proxy" in " ".join(p.cmdline()) and p.cwd() == str(root)
    except psutil.Error:
        return False
