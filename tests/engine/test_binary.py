"""Finding, checking and building the engine (the build itself is exercised by `make test`)."""

from __future__ import annotations

import threading

import pytest

from jupyter_llama.engine import binary
from jupyter_llama.engine.binary import (
    BuildError,
    EngineBroken,
    EngineNotFound,
    _version_info,
    build_engine,
    check_runnable,
    cmake_args,
    find_engine,
)


def _script(tmp_path, name, body):
    p = tmp_path / name
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(0o755)
    return p


def test_version_line_parsing():
    assert _version_info("version: 0.6.0-dev (build 11434, commit b11434)\nbuilt with GNU") == (
        "version: 0.6.0-dev (build 11434, commit b11434)", 11434)
    assert _version_info("version: 4567 (abcdef1)\n")[1] == 4567


def test_cmake_args_build_natively_and_download_nothing():
    args = cmake_args("cpu")
    assert "-DGGML_NATIVE=ON" in args and "-DCMAKE_BUILD_TYPE=Release" in args
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in args and "-DLLAMA_BUILD_UI=OFF" in args  # the UI would be fetched
    assert f"-DLLAMA_BUILD_NUMBER={binary.LLAMA_BUILD}" in args
    assert f"-DLLAMA_BUILD_COMMIT={binary.LLAMA_COMMIT}" in args
    assert "-DGGML_CUDA=ON" in cmake_args("cuda") and "-DGGML_VULKAN=ON" in cmake_args("vulkan")


def test_cache_is_keyed_by_this_cpu():
    name = binary.build_dir_name("cpu")
    assert name.startswith(f"b{binary.LLAMA_BUILD}-cpu-{binary.RECIPE}-native-")
    assert name == binary.build_dir_name("cpu")


def test_sigill_binary_is_reported_not_hung_on(tmp_path):
    fake = _script(tmp_path, "llama-server", "kill -ILL $$")
    with pytest.raises(EngineBroken, match="signal 4.*illegal instruction.*engine build"):
        check_runnable(fake)


def test_missing_libraries_are_reported(tmp_path):
    fake = _script(tmp_path, "llama-server",
                   "echo 'llama-server: error while loading shared libraries: libcuda.so.1: cannot open' >&2; exit 127")
    with pytest.raises(EngineBroken, match="libcuda.so.1"):
        check_runnable(fake)


def test_a_hanging_binary_times_out(tmp_path):
    fake = _script(tmp_path, "llama-server", "sleep 30")
    with pytest.raises(EngineBroken, match="did not answer"):  # had it waited, the script would exit 0
        check_runnable(fake, timeout=0.5)


def test_explicit_setting_wins_and_must_exist(tmp_path, monkeypatch):
    fake = _script(tmp_path, "llama-server", "echo 'version: 0.1 (build 42, commit x)'")
    monkeypatch.setenv("JUPYTER_LLAMA_SERVER", str(fake))
    eng = find_engine()
    assert eng.path == str(fake) and eng.source == "setting" and eng.build_number == 42
    monkeypatch.setenv("JUPYTER_LLAMA_SERVER", str(tmp_path / "absent"))
    with pytest.raises(EngineNotFound, match="does not exist"):
        find_engine()


def test_path_lookup_order(tmp_path, monkeypatch):
    monkeypatch.delenv("JUPYTER_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no cached build
    _script(tmp_path, "llama-server", "echo 'version: 0.1 (build 1, commit a)'")
    _script(tmp_path, "llama-server-vulkan", "echo 'version: 0.1 (build 2, commit b)'")
    monkeypatch.setenv("PATH", str(tmp_path))
    eng = find_engine()
    assert eng.source == "path" and eng.path.endswith("llama-server-vulkan")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(EngineNotFound, match="jupyter-llama engine build"):
        find_engine()


def test_missing_tools_name_the_debian_packages(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BuildError, match="apt-get install cmake build-essential"):
        binary._require_tools("cpu")


def test_a_wrong_sdist_is_refused(tmp_path, monkeypatch):
    bad = tmp_path / binary.SDIST_FILE
    bad.write_bytes(b"not the llama.cpp source")
    monkeypatch.setenv("JUPYTER_LLAMA_ENGINE_SDIST", str(bad))
    with pytest.raises(BuildError, match="sha256"):
        binary.fetch_sdist(tmp_path / "dl")


@pytest.mark.engine
def test_concurrent_build_waits_for_the_lock_then_reuses_the_cache(engine):
    from filelock import FileLock

    if engine.source != "cache":
        pytest.skip("the engine in use is not this project's cached build")
    root = binary.engine_root()
    lock = FileLock(str(root / f".{binary.build_dir_name('cpu')}.lock"))
    done = threading.Event()
    result = {}

    def second_build():
        result["dir"] = build_engine("cpu", progress=lambda m: None)
        done.set()

    with lock:  # a first build in progress
        t = threading.Thread(target=second_build)
        t.start()
        assert not done.wait(1.0), "the second build must wait for the first"
    t.join(30)
    assert done.is_set() and (result["dir"] / "bin" / "llama-server").is_file()
