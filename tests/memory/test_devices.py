"""Host memory, cgroup caps, NVML discovery and memory budgets (jupyter_llama.memory.devices)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from jupyter_llama.config import ConfigError
from jupyter_llama.memory import devices as dv
from jupyter_llama.memory.devices import (
    GPU,
    Budgets,
    DeviceState,
    HostMemory,
    HostMemoryError,
    Inventory,
    budgets_from_env,
    format_inventory,
    inventory,
    list_gpus,
    parse_memory_limit,
    read_host_memory,
)

KiB, MiB, GiB = 1024, 1024**2, 1024**3
V1_UNLIMITED = "9223372036854771712"


def make_root(tmp_path: Path, meminfo_total=64 * GiB, meminfo_avail=60 * GiB, meminfo: str | None = None,
              files: dict[str, str] | None = None) -> Path:
    root = tmp_path / "root"
    (root / "proc").mkdir(parents=True)
    if meminfo is None:
        meminfo = (f"MemTotal:       {meminfo_total // KiB} kB\n"
                   f"MemFree:        {meminfo_avail // KiB // 2} kB\n"
                   f"MemAvailable:   {meminfo_avail // KiB} kB\n"
                   f"Buffers:        1024 kB\n")
    (root / "proc/meminfo").write_text(meminfo)
    for rel, text in (files or {}).items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


# ---------------------------------------------------------------- host memory and cgroups

def test_no_cgroup_files_means_no_cap(tmp_path):
    host = read_host_memory(make_root(tmp_path))
    assert host == HostMemory(total=64 * GiB, available=60 * GiB, cgroup_limit=None, cgroup_usage=None)


def test_cgroup_v2_limit_caps_total_and_available(tmp_path):
    root = make_root(tmp_path, files={"sys/fs/cgroup/memory.max": f"{4 * GiB}\n",
                                      "sys/fs/cgroup/memory.current": f"{1 * GiB}\n"})
    host = read_host_memory(root)
    assert host.total == 4 * GiB
    assert host.available == 3 * GiB
    assert host.cgroup_limit == 4 * GiB and host.cgroup_usage == 1 * GiB


def test_cgroup_v2_max_means_no_cap(tmp_path):
    root = make_root(tmp_path, files={"sys/fs/cgroup/memory.max": "max\n",
                                      "sys/fs/cgroup/memory.current": f"{1 * GiB}\n"})
    host = read_host_memory(root)
    assert (host.total, host.available, host.cgroup_limit) == (64 * GiB, 60 * GiB, None)


def test_cgroup_v2_limit_above_ram_keeps_ram(tmp_path):
    root = make_root(tmp_path, meminfo_total=8 * GiB, meminfo_avail=6 * GiB,
                     files={"sys/fs/cgroup/memory.max": f"{32 * GiB}", "sys/fs/cgroup/memory.current": f"{1 * GiB}"})
    host = read_host_memory(root)
    assert (host.total, host.available) == (8 * GiB, 6 * GiB)


def test_cgroup_v2_usage_over_limit_gives_zero_available(tmp_path):
    root = make_root(tmp_path, files={"sys/fs/cgroup/memory.max": f"{2 * GiB}",
                                      "sys/fs/cgroup/memory.current": f"{3 * GiB}"})
    assert read_host_memory(root).available == 0


def test_cgroup_v2_inactive_file_cache_counts_as_available(tmp_path):
    root = make_root(tmp_path, files={"sys/fs/cgroup/memory.max": f"{4 * GiB}",
                                      "sys/fs/cgroup/memory.current": f"{3 * GiB}",
                                      "sys/fs/cgroup/memory.stat":
                                          f"anon 123\ninactive_file {2 * GiB}\nactive_file 5\n"})
    host = read_host_memory(root)
    assert host.available == 3 * GiB  # working set 1 GiB
    assert host.cgroup_usage == 3 * GiB  # reported raw


def test_cgroup_v2_nested_path_from_proc_self_cgroup(tmp_path):
    # The process lives in a child cgroup; the tightest limit along the chain wins.
    root = make_root(tmp_path, files={
        "proc/self/cgroup": "0::/user.slice/jupyter.scope\n",
        "sys/fs/cgroup/memory.max": "max",
        "sys/fs/cgroup/user.slice/memory.max": f"{16 * GiB}",
        "sys/fs/cgroup/user.slice/memory.current": f"{10 * GiB}",
        "sys/fs/cgroup/user.slice/jupyter.scope/memory.max": f"{6 * GiB}",
        "sys/fs/cgroup/user.slice/jupyter.scope/memory.current": f"{2 * GiB}",
    })
    host = read_host_memory(root)
    assert (host.total, host.available, host.cgroup_limit) == (6 * GiB, 4 * GiB, 6 * GiB)


def test_cgroup_v1_huge_value_means_no_cap(tmp_path):
    root = make_root(tmp_path, files={"sys/fs/cgroup/memory/memory.limit_in_bytes": V1_UNLIMITED + "\n",
                                      "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{5 * GiB}\n"})
    host = read_host_memory(root)
    assert (host.total, host.available, host.cgroup_limit) == (64 * GiB, 60 * GiB, None)


def test_cgroup_v1_real_limit(tmp_path):
    root = make_root(tmp_path, files={"sys/fs/cgroup/memory/memory.limit_in_bytes": f"{8 * GiB}\n",
                                      "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{2 * GiB}\n"})
    host = read_host_memory(root)
    assert (host.total, host.available) == (8 * GiB, 6 * GiB)
    assert (host.cgroup_limit, host.cgroup_usage) == (8 * GiB, 2 * GiB)


def test_cgroup_v1_host_path_missing_in_container_uses_mount_root(tmp_path):
    # Without a cgroup namespace /proc/self/cgroup names the host's path, absent inside.
    root = make_root(tmp_path, files={
        "proc/self/cgroup": "5:memory:/docker/abc123\n0::/\n",
        "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{8 * GiB}",
        "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{1 * GiB}",
    })
    assert read_host_memory(root).available == 7 * GiB


def test_cgroup_v1_nested_unlimited_chain(tmp_path):
    root = make_root(tmp_path, files={
        "proc/self/cgroup": "4:memory:/process_api/abc\n0::/\n",
        "sys/fs/cgroup/memory/memory.limit_in_bytes": V1_UNLIMITED,
        "sys/fs/cgroup/memory/process_api/memory.limit_in_bytes": V1_UNLIMITED,
        "sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes": f"{12 * GiB}",
        "sys/fs/cgroup/memory/process_api/abc/memory.usage_in_bytes": f"{2 * GiB}",
    })
    host = read_host_memory(root)
    assert (host.total, host.available) == (12 * GiB, 10 * GiB)


def test_cgroup_limit_without_usage_caps_total_only(tmp_path):
    root = make_root(tmp_path, files={"sys/fs/cgroup/memory.max": f"{4 * GiB}"})
    host = read_host_memory(root)
    assert (host.total, host.available, host.cgroup_usage) == (4 * GiB, 4 * GiB, None)


def test_garbage_cgroup_file_is_ignored(tmp_path):
    root = make_root(tmp_path, files={"sys/fs/cgroup/memory.max": "banana"})
    assert read_host_memory(root).cgroup_limit is None


def test_malformed_meminfo_raises_clear_error(tmp_path):
    root = make_root(tmp_path, meminfo="this is not\nmeminfo at all\nMemTotal: lots kB\n")
    with pytest.raises(HostMemoryError, match="MemTotal") as err:
        read_host_memory(root)
    assert "meminfo" in str(err.value)


def test_missing_meminfo_under_fake_root_raises(tmp_path):
    root = tmp_path / "empty"
    root.mkdir()
    with pytest.raises(HostMemoryError, match="meminfo"):
        read_host_memory(root)


def test_meminfo_without_memavailable_estimates_from_free_and_caches(tmp_path):
    root = make_root(tmp_path,
                     meminfo="MemTotal: 1048576 kB\nMemFree: 262144 kB\nBuffers: 1024 kB\nCached: 261120 kB\n")
    host = read_host_memory(root)
    assert (host.total, host.available) == (1 * GiB, 512 * MiB)


def test_real_host_memory_is_plausible():
    host = read_host_memory("/")
    assert host.total > 1 * GiB
    assert 0 <= host.available <= host.total


# ---------------------------------------------------------------- parse_memory_limit / budgets

@pytest.mark.parametrize("text, expected", [
    ("8GiB", 8 * GiB),
    ("8G", 8 * GiB),
    ("8000MB", 8000 * 1000**2),
    ("512MiB", 512 * MiB),
    ("1073741824", GiB),
    (" 1.5 GiB ", int(1.5 * GiB)),
])
def test_parse_memory_limit_single_size_applies_everywhere(text, expected):
    assert parse_memory_limit(text) == {"*": expected}


def test_parse_memory_limit_per_device():
    assert parse_memory_limit("cuda:0=20GiB,cpu=6GiB") == {"cuda:0": 20 * GiB, "cpu": 6 * GiB}
    assert parse_memory_limit(" CUDA:1 = 512MiB , vulkan:0=1G, rocm:2=3GB, metal:0=100 ") == {
        "cuda:1": 512 * MiB, "vulkan:0": GiB, "rocm:2": 3 * 1000**3, "metal:0": 100}
    assert parse_memory_limit("gpu=10GiB,cpu=4GiB") == {"gpu": 10 * GiB, "cpu": 4 * GiB}
    assert parse_memory_limit("CUDA0=1GiB") == {"cuda:0": GiB}  # as llama.cpp's logs spell it
    assert parse_memory_limit("*=2GiB,cuda:0=1GiB") == {"*": 2 * GiB, "cuda:0": GiB}


@pytest.mark.parametrize("text", [None, "", "   "])
def test_parse_memory_limit_empty(text):
    assert parse_memory_limit(text) == {}


@pytest.mark.parametrize("text, needle", [
    ("lots", "not a size"),
    ("8 parsecs", "unknown unit"),
    ("-1GiB", "not a size"),
    ("cuda:0=big", "cuda:0"),
    ("tpu:0=8GiB", "unknown device"),
    ("cuda=8GiB", "unknown device"),
    ("cuda:x=8GiB", "unknown device"),
    ("cpu=", "device=size"),
    ("=8GiB", "device=size"),
    ("cpu=1GiB,cpu=2GiB", "more than once"),
    ("8GiB,4GiB", "without devices"),
    ("cpu=1GiB,4GiB", "device=size"),
])
def test_parse_memory_limit_errors_name_the_variable(text, needle):
    with pytest.raises(ConfigError) as err:
        parse_memory_limit(text)
    msg = str(err.value)
    assert "JUPYTER_LLAMA_MEMORY_LIMIT" in msg
    assert needle in msg


def test_parse_memory_limit_error_says_what_to_write():
    with pytest.raises(ConfigError, match=r"cuda:0=20GiB,cpu=6GiB"):
        parse_memory_limit("npu:0=1GiB")


def test_parse_memory_limit_custom_name():
    with pytest.raises(ConfigError, match="memory_limit trait"):
        parse_memory_limit("nope", what="memory_limit trait")


def test_budgets_from_env():
    b = budgets_from_env({"JUPYTER_LLAMA_MEMORY_LIMIT": "cuda:0=20GiB,cpu=6GiB",
                          "JUPYTER_LLAMA_GPU_OVERHEAD": "512MiB", "UNRELATED": "x"})
    assert b.limits == {"cuda:0": 20 * GiB, "cpu": 6 * GiB}
    assert b.gpu_overhead == 512 * MiB
    assert b.limits_source == "JUPYTER_LLAMA_MEMORY_LIMIT"
    assert b.overhead_source == "JUPYTER_LLAMA_GPU_OVERHEAD"
    assert "JUPYTER_LLAMA_MEMORY_LIMIT" in b.describe() and "512.0 MiB" in b.describe()


def test_budgets_from_env_defaults_and_plain_byte_overhead():
    b = budgets_from_env({})
    assert (b.limits, b.gpu_overhead) == ({}, 0)
    assert "none" in b.describe()
    assert budgets_from_env({"JUPYTER_LLAMA_GPU_OVERHEAD": "1073741824"}).gpu_overhead == GiB
    assert budgets_from_env({"JUPYTER_LLAMA_MEMORY_LIMIT": ""}).limits == {}


def test_budgets_from_env_bad_overhead_names_variable():
    with pytest.raises(ConfigError, match="JUPYTER_LLAMA_GPU_OVERHEAD"):
        budgets_from_env({"JUPYTER_LLAMA_GPU_OVERHEAD": "a bit"})


def test_budgets_from_env_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("JUPYTER_LLAMA_MEMORY_LIMIT", "3GiB")
    monkeypatch.delenv("JUPYTER_LLAMA_GPU_OVERHEAD", raising=False)
    assert budgets_from_env().limits == {"*": 3 * GiB}


def test_limit_for_precedence():
    b = Budgets({"*": 30 * GiB, "gpu": 20 * GiB, "cuda:1": 10 * GiB, "cpu": 5 * GiB}, 0)
    assert b.limit_for("cpu") == 5 * GiB
    assert b.limit_for("cuda:1") == 10 * GiB
    assert b.limit_for("cuda:0") == 20 * GiB
    assert b.limit_for("vulkan:0") == 20 * GiB
    assert Budgets({"*": 30 * GiB, "gpu": 20 * GiB}, 0).limit_for("cpu") == 30 * GiB
    assert Budgets({"gpu": 20 * GiB}, 0).limit_for("cpu") is None
    assert Budgets({}, 0).limit_for("cuda:0") is None


# ---------------------------------------------------------------- DeviceState / Inventory

def test_usable_gpu_subtracts_overhead_and_respects_budget():
    assert DeviceState("cuda:0", "H200", 140 * GiB, 100 * GiB, None, overhead=2 * GiB).usable == 98 * GiB
    assert DeviceState("cuda:0", "H200", 140 * GiB, 100 * GiB, 20 * GiB, overhead=2 * GiB).usable == 20 * GiB
    assert DeviceState("cuda:0", "H200", 140 * GiB, 10 * GiB, 20 * GiB, overhead=2 * GiB).usable == 8 * GiB
    assert DeviceState("cuda:0", "H200", 140 * GiB, 1 * GiB, None, overhead=2 * GiB).usable == 0


def test_usable_cpu_ignores_gpu_overhead():
    assert DeviceState("cpu", "host", 64 * GiB, 50 * GiB, None, overhead=2 * GiB).usable == 50 * GiB
    assert DeviceState("cpu", "host", 64 * GiB, 50 * GiB, 6 * GiB).usable == 6 * GiB
    assert DeviceState("cpu", "host", 64 * GiB, 4 * GiB, 6 * GiB).usable == 4 * GiB


def _fake_inventory(budgets: Budgets) -> Inventory:
    host = HostMemory(total=64 * GiB, available=40 * GiB, cgroup_limit=None, cgroup_usage=None)
    gpus = [GPU(0, "cuda:0", "NVIDIA H200", "GPU-aaaa", 140 * GiB, 130 * GiB, 10 * GiB),
            GPU(1, "cuda:1", "NVIDIA H200", "GPU-bbbb", 140 * GiB, 50 * GiB, 90 * GiB)]
    return Inventory(host, gpus, budgets)


def test_inventory_devices_apply_budgets_and_overhead():
    inv = _fake_inventory(Budgets({"cuda:0": 20 * GiB, "*": 45 * GiB}, 1 * GiB))
    devs = inv.devices()
    assert [d.id for d in devs] == ["cpu", "cuda:0", "cuda:1"]
    assert [d.usable for d in devs] == [40 * GiB, 20 * GiB, 45 * GiB]
    assert inv.device("cuda:1").budget == 45 * GiB
    assert inv.device("cuda:1").overhead == 1 * GiB
    assert inv.device("cpu").overhead == 0
    assert inv.device("cuda:7") is None
    d = inv.to_dict()
    assert d["devices"][1] == {"id": "cuda:0", "name": "NVIDIA H200", "total": 140 * GiB, "free": 130 * GiB,
                               "budget": 20 * GiB, "overhead": GiB, "usable": 20 * GiB,
                               "kind": "gpu", "reachable": True, "error": None, "held_by": None}
    assert d["gpus"][1]["uuid"] == "GPU-bbbb"
    assert d["host"]["total"] == 64 * GiB
    assert d["budgets"]["limits"] == {"cuda:0": 20 * GiB, "*": 45 * GiB}


def test_format_inventory_fake_gpus_mentions_budgets_and_unknown_devices():
    b = budgets_from_env({"JUPYTER_LLAMA_MEMORY_LIMIT": "cuda:0=20GiB,cuda:5=1GiB",
                          "JUPYTER_LLAMA_GPU_OVERHEAD": "1GiB"})
    text = format_inventory(_fake_inventory(b))
    assert "cuda:1" in text and "NVIDIA H200" in text and "20.00 GiB" in text
    assert "from JUPYTER_LLAMA_MEMORY_LIMIT" in text and "from JUPYTER_LLAMA_GPU_OVERHEAD" in text
    assert "cuda:5" in text and "does not have" in text


def test_format_inventory_shows_cgroup(tmp_path):
    root = make_root(tmp_path, files={"sys/fs/cgroup/memory.max": f"{4 * GiB}",
                                      "sys/fs/cgroup/memory.current": f"{1 * GiB}"})
    inv = inventory(environ={"CUDA_VISIBLE_DEVICES": ""}, root=root)
    assert inv.device("cpu").total == 4 * GiB
    text = format_inventory(inv)
    assert "cgroup limit 4.00 GiB" in text


def test_format_inventory_on_this_machine():
    inv = inventory()
    text = format_inventory(inv)
    assert "cpu" in text
    assert "memory budgets" in text
    assert inv.devices()[0].id == "cpu"


# ---------------------------------------------------------------- NVML

def test_list_gpus_without_gpu_returns_empty():
    # This machine has no NVIDIA driver; on one that has, the list is well formed.
    gpus = list_gpus()
    assert isinstance(gpus, list)
    for i, g in enumerate(gpus):
        assert g.id == f"cuda:{i}" and g.total >= g.free >= 0


def test_list_gpus_nvml_init_error(monkeypatch):
    import pynvml

    def boom():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", boom)
    assert list_gpus() == []
    assert dv.last_gpu_error and "NVML" in dv.last_gpu_error


def test_list_gpus_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    assert list_gpus() == []
    assert "pynvml" in dv.last_gpu_error


class _Mem:
    def __init__(self, total, free):
        self.total, self.free, self.used = total, free, total - free


def _fake_pynvml(devices, fail_on=None):
    """A stand-in for pynvml with ``devices`` = [(name, uuid, total, free)]."""
    mod = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    calls = {"shutdown": 0}

    def check(op):
        if fail_on == op:
            raise NVMLError(f"{op} failed")

    mod.NVMLError = NVMLError
    mod.nvmlInit = lambda: check("init")
    mod.nvmlShutdown = lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1)
    mod.nvmlDeviceGetCount = lambda: (check("count"), len(devices))[1]
    mod.nvmlDeviceGetHandleByIndex = lambda i: i
    mod.nvmlDeviceGetHandleByUUID = lambda u: next(i for i, d in enumerate(devices) if d[1] == u)
    mod.nvmlDeviceGetUUID = lambda h: devices[h][1]
    mod.nvmlDeviceGetName = lambda h: devices[h][0].encode()  # old bindings return bytes
    mod.nvmlDeviceGetMemoryInfo = lambda h: (check("memory"), _Mem(devices[h][2], devices[h][3]))[1]
    mod.calls = calls
    return mod


FAKE_DEVICES = [("NVIDIA A", "GPU-aaaa-1111", 80 * GiB, 70 * GiB),
                ("NVIDIA B", "GPU-bbbb-2222", 40 * GiB, 30 * GiB),
                ("NVIDIA C", "GPU-cccc-3333", 24 * GiB, 20 * GiB)]


def test_list_gpus_with_fake_nvml(monkeypatch):
    fake = _fake_pynvml(FAKE_DEVICES)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    gpus = list_gpus(environ={})
    assert [(g.id, g.name, g.uuid, g.total, g.free, g.used) for g in gpus] == [
        ("cuda:0", "NVIDIA A", "GPU-aaaa-1111", 80 * GiB, 70 * GiB, 10 * GiB),
        ("cuda:1", "NVIDIA B", "GPU-bbbb-2222", 40 * GiB, 30 * GiB, 10 * GiB),
        ("cuda:2", "NVIDIA C", "GPU-cccc-3333", 24 * GiB, 20 * GiB, 4 * GiB),
    ]
    assert fake.calls["shutdown"] == 1


@pytest.mark.parametrize("visible, names", [
    ("2,0", ["NVIDIA C", "NVIDIA A"]),
    ("GPU-bbbb", ["NVIDIA B"]),
    ("1,7,0", ["NVIDIA B"]),  # CUDA stops at the first entry it cannot use
    ("1,junk,0", ["NVIDIA B"]),
    ("", []),
    ("-1", []),
])
def test_list_gpus_follows_cuda_visible_devices(monkeypatch, visible, names):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(FAKE_DEVICES))
    gpus = list_gpus(environ={"CUDA_VISIBLE_DEVICES": visible})
    assert [g.name for g in gpus] == names
    assert [g.id for g in gpus] == [f"cuda:{i}" for i in range(len(names))]


@pytest.mark.parametrize("fail_on", ["init", "count", "memory"])
def test_list_gpus_any_nvml_error_gives_empty(monkeypatch, fail_on):
    fake = _fake_pynvml(FAKE_DEVICES, fail_on=fail_on)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert list_gpus(environ={}) == []
    assert fail_on in dv.last_gpu_error


def test_inventory_with_fake_nvml_and_budgets(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(FAKE_DEVICES))
    inv = inventory(environ={"JUPYTER_LLAMA_MEMORY_LIMIT": "gpu=25GiB,cpu=6GiB",
                             "JUPYTER_LLAMA_GPU_OVERHEAD": "2GiB"}, root=make_root(tmp_path))
    assert [(d.id, d.usable) for d in inv.devices()] == [
        ("cpu", 6 * GiB), ("cuda:0", 25 * GiB), ("cuda:1", 25 * GiB), ("cuda:2", 18 * GiB)]
    assert inv.gpu_error is None
    assert "GPUs: none" not in format_inventory(inv)


def test_importing_module_does_not_import_pynvml():
    import subprocess
    code = ("import sys; import jupyter_llama.memory.devices; "
            "print('pynvml' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
