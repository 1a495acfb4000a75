"""A real Jupyter server (pytest-jupyter's fixtures) with the jupyter_llama extension and real
llama-server children, on the same event loop as the test (pytest-asyncio's).

pytest-jupyter runs async tests on its own loop through two global hooks; this directory
imports its fixtures only (not the hooks) and points ``jp_asyncio_loop`` at the loop
pytest-asyncio runs the test in, so the server, its children and the test share one loop.

Config per test: ``@pytest.mark.llama_config(max_queue=1, ...)`` sets ``LlamaExtension``
traits. Every test gets its own model store with ``tiny`` (and ``other``) in it.
"""

from __future__ import annotations

import time

import httpx
import pytest
from jupyter_server.utils import url_path_join

try:
    from pytest_jupyter.jupyter_server import (  # noqa: F401 - fixtures
        echo_kernel_spec,
        http_server,
        http_server_client,
        http_server_port,
        io_loop,
        jp_argv,
        jp_auth_header,
        jp_base_url,
        jp_config_dir,
        jp_configurable_serverapp,
        jp_data_dir,
        jp_env_config_path,
        jp_env_jupyter_path,
        jp_environ,
        jp_fetch,
        jp_home_dir,
        jp_http_port,
        jp_kernel_dir,
        jp_logging_stream,
        jp_nbconvert_templates,
        jp_root_dir,
        jp_runtime_dir,
        jp_server_cleanup,
        jp_serverapp,
        jp_system_config_path,
        jp_system_jupyter_path,
        jp_template_dir,
        jp_web_app,
    )
except ImportError:  # pytest-jupyter[server] is a test dependency; without it, skip this directory
    collect_ignore_glob = ["test_*.py"]

from srvutil import OTHER, TINY, is_alive, our_children


def pytest_configure(config):
    config.addinivalue_line("markers", "llama_config(**traits): LlamaExtension settings for this test's server")


@pytest.fixture
def jp_asyncio_loop(request):
    """pytest-asyncio's loop for this test (so the server runs where the test runs)."""
    try:
        runner = request.getfixturevalue("_function_scoped_runner")  # pytest-asyncio >= 1.0
        return runner.get_loop()
    except pytest.FixtureLookupError:  # pragma: no cover - pytest-asyncio 0.2x
        return request.getfixturevalue("event_loop")


@pytest.fixture
def models_dir(tmp_path):
    return tmp_path / "models"


@pytest.fixture
def store(models_dir, make_model):
    from jupyter_llama.models.store import ModelStore

    s = ModelStore(models_dir)
    s.create("tiny", make_model("srv-tiny", **TINY))
    s.create("other", make_model("srv-other", **OTHER))
    return s


@pytest.fixture
def jp_server_config(request, engine, store, models_dir):
    traits = {"models_dir": str(models_dir), "server_binary": engine.path, "keep_alive": "30s",
              "activity_interval": 0.1}
    marker = request.node.get_closest_marker("llama_config")
    if marker:
        traits.update(marker.kwargs)
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_llama": True, "jupyter_server_terminals": False}},
        "LlamaExtension": traits,
    }


@pytest.fixture
def ext(jp_serverapp):
    """The running LlamaExtension instance."""
    return jp_serverapp.extension_manager.extension_points["jupyter_llama"].app


@pytest.fixture
def token(jp_serverapp) -> str:
    return jp_serverapp.identity_provider.token


@pytest.fixture
def server_root(http_server_client, jp_base_url) -> str:
    """http://127.0.0.1:<port><base_url>"""
    return http_server_client.get_url(jp_base_url)


@pytest.fixture
def llama_url(server_root) -> str:
    return url_path_join(server_root, "llama")


@pytest.fixture
async def http(llama_url, token):
    """An httpx client at <server>/llama/ with the token (streams read as they arrive)."""
    async with httpx.AsyncClient(base_url=llama_url + "/", headers={"Authorization": f"token {token}"},
                                 timeout=httpx.Timeout(60.0), trust_env=False) as c:
        yield c


@pytest.fixture(autouse=True)
def _no_children_left(request):
    """After each test (and its server's clean-up), no llama-server child of ours is left.

    pytest sets autouse fixtures up in name order, so this one (``_n...``) is set up before
    pytest-jupyter's ``jp_server_cleanup`` and torn down after it: the check runs once the
    server has stopped."""
    yield
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [pid for pid in our_children() if is_alive(pid)]
        if not alive:
            return
        time.sleep(0.1)
    pytest.fail(f"llama-server children outlived the test: {alive}")
