import math

import pytest

from jupyter_llama.config import ConfigError, format_duration, parse_duration, parse_size


@pytest.mark.parametrize("text,expected", [
    ("8GiB", 8 * 2**30), ("8G", 8 * 2**30), ("8000MB", 8_000_000_000), ("512MiB", 512 * 2**20),
    ("1024", 1024), (4096, 4096), ("1.5GiB", int(1.5 * 2**30)), (" 2 gb ", 2_000_000_000), ("0", 0),
])
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "lots", "8XB", "-1GiB", "GiB", "8 GiB 2", -5, True])
def test_bad_sizes_name_the_setting(bad):
    with pytest.raises(ConfigError, match="JUPYTER_LLAMA_MEMORY_LIMIT"):
        parse_size(bad, "JUPYTER_LLAMA_MEMORY_LIMIT")


@pytest.mark.parametrize("value,expected", [
    (300, 300.0), (0, 0.0), (-1, math.inf), ("10m", 600.0), ("1h30m", 5400.0), ("-1", math.inf),
    ("-5m", math.inf), ("250ms", 0.25), ("45", 45.0), ("2.5s", 2.5), (1.5, 1.5), ("0s", 0.0),
])
def test_durations(value, expected):
    assert parse_duration(value) == expected


@pytest.mark.parametrize("bad", ["soon", "10 minutes", "5d", "", "m5", None, True, float("nan"), "1h 30m"])
def test_bad_durations(bad):
    with pytest.raises(ConfigError, match="keep_alive"):
        parse_duration(bad)


def test_format_duration():
    assert format_duration(math.inf) == "forever"
    assert format_duration(42) == "42s"
    assert format_duration(300) == "5m"
    assert format_duration(5400) == "1h30m"
