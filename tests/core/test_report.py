import pytest

from jupyter_llama.memory.report import COMPUTE, KV, OUTPUT, WEIGHTS, MemoryReport, MiB, device_of_backend, format_bytes


@pytest.mark.parametrize("backend,device", [
    ("CPU", "cpu"), ("CPU_Mapped", "cpu"), ("CPU_REPACK", "cpu"), ("BLAS", "cpu"), ("CUDA_Host", "cpu"),
    ("CUDA0_Host", "cpu"), ("Vulkan_Host", "cpu"), ("CUDA0", "cuda:0"), ("CUDA1", "cuda:1"),
    ("CUDA0_Mapped", "cuda:0"), ("Vulkan0", "vulkan:0"), ("ROCm1", "rocm:1"), ("Metal", "metal:0"),
])
def test_device_of_backend(backend, device):
    assert device_of_backend(backend) == device


def test_report_totals_and_roundtrip():
    r = MemoryReport("actual", layers_offloaded=3, layers_total=5, n_ctx=2048)
    r.add("cuda:0", WEIGHTS, 100 * MiB)
    r.add("cpu", WEIGHTS, 20 * MiB)
    r.add("cuda:0", KV, 8 * MiB)
    r.add("cuda:0", KV, 8 * MiB)
    r.add("cpu", OUTPUT, 1 * MiB)
    r.set("cuda:0", COMPUTE, 3 * MiB)
    assert r.devices == ["cpu", "cuda:0"]
    assert r.total() == 140 * MiB
    assert r.total(device="cuda:0") == 119 * MiB
    assert r.total(component=KV) == 16 * MiB
    assert r.gpu_total == 119 * MiB and r.host_total == 21 * MiB
    back = MemoryReport.from_dict(r.to_dict())
    assert back == r
    assert "cuda:0" in r.table() and "119.00" in r.table()
    with pytest.raises(ValueError, match="unknown memory component"):
        r.add("cpu", "bogus", 1)


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * MiB) == "3.0 MiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
