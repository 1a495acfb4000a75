"""The CUDA engine build's decisions, and a real CUDA build's behaviour on a machine without a GPU.

The build itself (an hour on 2 cores) never runs in CI: the tests at the bottom use a CUDA
build cached on this machine by `jupyter-llama engine build --cuda`, and skip, saying so,
where there is none.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jupyter_llama.engine import binary, cuda
from jupyter_llama.engine.cuda import CudaError, Gpu, GpuProbe, Toolkit, choose_toolkit, cuda_archs, make_driver_stub

NO_GPU = GpuProbe(error="no NVIDIA driver here (NVML: NVML Shared Library Not Found)")


def test_architectures_come_from_the_gpus_here_else_the_default_list(monkeypatch):
    monkeypatch.delenv("JUPYTER_LLAMA_CUDA_ARCHS", raising=False)
    h200 = GpuProbe(driver="580.159.03", cuda=(13, 0), gpus=[Gpu(0, "NVIDIA H200", (9, 0), 143 << 30)])
    assert cuda_archs(h200) == (["90-real"], "this machine's GPUs (NVIDIA H200)")
    mixed = GpuProbe(driver="580", cuda=(13, 0), gpus=[Gpu(0, "NVIDIA L4", (8, 9), 1), Gpu(1, "NVIDIA A100", (8, 0), 1),
                                                       Gpu(2, "NVIDIA L4", (8, 9), 1)])
    assert cuda_archs(mixed)[0] == ["80-real", "89-real"]
    archs, source = cuda_archs(NO_GPU)
    assert archs == list(cuda.DEFAULT_ARCHS) and "default" in source
    assert cuda_archs(NO_GPU, "86;90")[0] == ["86", "90"] and cuda_archs(NO_GPU, "89-real, 90-real")[0] == ["89-real",
                                                                                                           "90-real"]
    monkeypatch.setenv("JUPYTER_LLAMA_CUDA_ARCHS", "120a-real")
    assert cuda_archs(h200) == (["120a-real"], "set by you")


def test_architectures_cuda_13_cannot_build_are_refused_in_words():
    with pytest.raises(CudaError, match=r"'sm_90' are not understood.*such as '86;90'"):
        cuda_archs(NO_GPU, "sm_90")
    with pytest.raises(CudaError, match=r"cannot build for 61.*7\.5 \(Turing\) and newer"):
        cuda_archs(NO_GPU, "61;86")
    pascal = GpuProbe(driver="580", cuda=(13, 0), gpus=[Gpu(0, "Tesla P100", (6, 0), 16 << 30)])
    with pytest.raises(CudaError, match="Tesla P100 has compute capability 6.0.*CPU engine"):
        cuda_archs(pascal)


def test_a_driver_older_than_cuda_13_is_told_what_to_do_before_anything_is_downloaded():
    old = GpuProbe(driver="535.183.01", cuda=(12, 2), gpus=[Gpu(0, "NVIDIA A10G", (8, 6), 24 << 30)])
    with pytest.raises(CudaError, match=r"driver 535.183.01 runs CUDA 12.2.*R580.*Update the driver.*CUDA 12 toolkit"):
        choose_toolkit("wheels", progress=lambda m: None, probe=old)
    with pytest.raises(CudaError, match="unknown toolkit 'conda'"):
        choose_toolkit("conda", probe=old)


def test_the_driver_stub_defines_every_function_cuda_h_names(tmp_path):
    header = tmp_path / "cuda.h"
    decls = [f"CUresult CUDAAPI cuFunction{i}(CUdevice dev);" for i in range(120)]
    header.write_text("\n".join(["typedef int CUresult;", *decls, "#define cuMemGetInfo cuMemGetInfo_v2",
                                 "CUresult CUDAAPI cuMemGetInfo(size_t *free, size_t *total);"]))
    stub = make_driver_stub(header, tmp_path / "stubs")
    soname = subprocess.run(["readelf", "-d", str(stub)], capture_output=True, text=True).stdout
    assert "Library soname: [libcuda.so.1]" in soname
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(stub)], capture_output=True, text=True).stdout
    assert " T cuFunction0\n" in symbols and " T cuFunction119\n" in symbols and " T cuMemGetInfo_v2\n" in symbols
    with pytest.raises(CudaError, match="not CUDA's cuda.h"):
        (tmp_path / "other.h").write_text("int cuOnly(void);")
        make_driver_stub(tmp_path / "other.h", tmp_path / "x")


def test_cuda_configure_flags_load_backends_at_run_time_and_name_this_cpu(tmp_path):
    tk = Toolkit(root=str(tmp_path), nvcc=str(tmp_path / "bin" / "nvcc"), version="13.0.88", source="wheels",
                 lib_dir=str(tmp_path / "lib"), driver_stub=str(tmp_path / "lib" / "stubs" / "libcuda.so"),
                 cublas_dir="/site/nvidia/cu13")
    args = binary.cmake_args("cuda", tk, ["90-real"])
    assert {"-DGGML_CUDA=ON", "-DGGML_BACKEND_DL=ON", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=OFF",
            "-DCMAKE_INSTALL_RPATH=$ORIGIN", "-DCMAKE_CUDA_ARCHITECTURES=90-real"} <= set(args)
    assert "-DGGML_NATIVE=ON" not in args and "-DBUILD_SHARED_LIBS=OFF" not in args
    assert f"-DCMAKE_CUDA_COMPILER={tk.nvcc}" in args and f"-DCUDA_cuda_driver_LIBRARY={tk.driver_stub}" in args
    assert "-DCUDA_cublas_LIBRARY=/site/nvidia/cu13/lib/libcublas.so.13" in args
    assert "-DGGML_AMX_INT8=OFF" in args  # AMX stays out, as in the CPU build
    flags = Path("/proc/cpuinfo").read_text()
    assert ("-DGGML_AVX2=ON" in args) == (" avx2" in flags)
    cpu = binary.cmake_args("cpu")
    assert "-DGGML_NATIVE=ON" in cpu and "-DGGML_BACKEND_DL=ON" not in cpu


def test_cuda_builds_are_keyed_by_cuda_version_and_architectures():
    name = binary.build_dir_name("cuda", "cu13.0-sm90")
    assert name.startswith(f"b{binary.LLAMA_BUILD}-cuda-cu13.0-sm90-{binary.RECIPE}-native-")
    assert binary.build_dir_name("cpu") == f"b{binary.LLAMA_BUILD}-cpu-{binary.RECIPE}-native-{binary._cpu_signature()}"


def test_cli_refuses_cuda_options_without_cuda():
    r = subprocess.run([sys.executable, "-m", "jupyter_llama.cli", "engine", "build", "--cuda-arch", "90"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--toolkit and --cuda-arch go with --cuda" in r.stderr and "Traceback" not in r.stderr


# ----------------------------------------------------------------------------- a real CUDA build


def _cached_cuda_build() -> Path:
    builds = binary.cached_builds("cuda")
    if not builds:
        pytest.skip("no CUDA build cached on this machine (`jupyter-llama engine build --cuda` makes one; "
                    "CI never builds it)")
    return builds[0]


@pytest.fixture
def cuda_build_without_gpu():
    d = _cached_cuda_build()
    if binary.gpu_devices(str(d / "bin" / "llama-server"), "cuda"):
        pytest.skip("this machine has a CUDA device: tests/gpu covers it")
    return d


def test_a_cuda_build_without_a_gpu_starts_lists_no_device_and_the_cpu_build_is_used(cuda_build_without_gpu):
    d = cuda_build_without_gpu
    stamp = json.loads((d / "build.json").read_text())
    assert stamp["backend"] == "cuda" and stamp["cuda_toolkit"]["version"].startswith("13.")
    server = d / "bin" / "llama-server"
    assert "version" in binary.check_runnable(server)
    assert binary.gpu_devices(str(server), "cuda") == []
    eng = binary.find_engine()
    assert eng.backend == "cpu" and eng.source == "cache"
    assert any(d.name in p and "sees no CUDA device" in p for p in eng.passed_over), eng.passed_over
    assert eng.reason.startswith("the CPU build, because the CUDA build") and "no NVIDIA driver here" in eng.reason
    status = subprocess.run([sys.executable, "-m", "jupyter_llama.cli", "engine", "status"], capture_output=True,
                            text=True, timeout=120)
    assert status.returncode == 0 and "sees no CUDA device" in status.stdout and "  cuda (CUDA 13" in status.stdout


async def test_a_cuda_build_alone_runs_a_model_on_the_cpu(cuda_build_without_gpu, tmp_path, monkeypatch,
                                                         stories_model):
    """Where the CUDA build is the only one, it is used, and its CPU backend serves the model."""
    from jupyter_llama.engine.runner import Runner
    from jupyter_llama.load_options import LoadOptions

    cache = tmp_path / "cache" / "jupyter-llama" / "engine"
    cache.mkdir(parents=True)
    (cache / cuda_build_without_gpu.name).symlink_to(cuda_build_without_gpu)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    eng = binary.find_engine()
    assert eng.backend == "cuda" and eng.reason.startswith("the only build here, on the CPU"), eng.reason
    r = Runner(str(stories_model), LoadOptions(num_ctx=256), binary=eng.path)
    try:
        await r.start()
        text, timings = await r.complete_text("Once upon a time", n_predict=8)
    finally:
        await r.stop()
    assert text and timings.get("predicted_n") == 8
    assert not r.alive
