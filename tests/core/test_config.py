import math
import re

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


def test_one_parser_for_every_setting_whatever_its_source(monkeypatch):
    """The environment and the extension's traits go through SchedulerSettings.from_values,
    with the same booleans everywhere, and each error names where the value came from."""
    from jupyter_llama.config import ConfigError, parse_bool
    from jupyter_llama.scheduler import SchedulerSettings
    from jupyter_llama.server.app import LlamaExtension

    said = [parse_bool(v, "x") for v in ("1", "YES", "on", "True", "0", "no", "Off", "false")]
    assert said == [True] * 4 + [False] * 4
    with pytest.raises(ConfigError, match="EVICT_PINNED: expected 1/0"):
        SchedulerSettings.from_env({"JUPYTER_LLAMA_EVICT_PINNED": "sometimes"})
    env = {"JUPYTER_LLAMA_KEEP_ALIVE": "90s", "JUPYTER_LLAMA_EVICT_PINNED": "on", "JUPYTER_LLAMA_NUM_PARALLEL": "2",
           "JUPYTER_LLAMA_MEMORY_LIMIT": "cpu=1GiB", "JUPYTER_LLAMA_RPC_WORKERS": "127.0.0.1:50052"}
    from_env = SchedulerSettings.from_env(env, binary="/x")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    from_traits = LlamaExtension().scheduler_settings("/x")
    for s in (from_env, from_traits):
        assert s.keep_alive == 90 and s.evict_pinned is True and s.num_parallel == 2
        assert s.budgets.limits == {"cpu": 1 << 30} and s.rpc_workers == ("127.0.0.1:50052",)
    monkeypatch.setenv("JUPYTER_LLAMA_LOAD_TIMEOUT", "later")
    with pytest.raises(ConfigError, match=r"LlamaExtension\.load_timeout \(JUPYTER_LLAMA_LOAD_TIMEOUT\)"):
        LlamaExtension().scheduler_settings("/x")
    monkeypatch.delenv("JUPYTER_LLAMA_LOAD_TIMEOUT")
    ext = LlamaExtension(keep_alive="2m")  # configuration wins over the environment
    assert ext.keep_alive == "2m" and ext.scheduler_settings("/x").keep_alive == 120
    # values every load or request would then fail on (in words blaming the request) are refused at start
    for key, value, said in (("NUM_PARALLEL", "-2",
                              "must be 0 (automatic) or 1 to 256 request slots per model, got -2"),
                             ("LOAD_TIMEOUT", "0", "must be a duration above 0 (how long a loading model may stay "
                                                   "silent; -1 for never), got 0s")):
        with pytest.raises(ConfigError, match=re.escape(f"JUPYTER_LLAMA_{key} {said}")):
            SchedulerSettings.from_env({f"JUPYTER_LLAMA_{key}": value}, binary="/x")
    assert SchedulerSettings.from_env({"JUPYTER_LLAMA_LOAD_TIMEOUT": "-1"}, binary="/x").load_timeout == math.inf


def test_a_keep_alive_past_a_century_is_forever():
    assert parse_duration(1e18) == math.inf and parse_duration("9999999999999999999999h") == math.inf
    assert parse_duration("5m") == 300 and parse_duration(-1) == math.inf


def test_values_in_messages_are_spelled_as_json_and_cut_when_long():
    """Client errors quote the value they refuse as the client wrote it (JSON), never Python's
    repr (True, None, {'': True})."""
    from jupyter_llama.api import ollama as oa
    from jupyter_llama.config import shown
    from jupyter_llama.errors import BadRequest

    assert (shown(True), shown(None), shown("x"), shown({"": True})) == ("true", "null", '"x"', '{"": true}')
    assert len(shown("y" * 500)) == 60 and shown("y" * 500).endswith("...")
    with pytest.raises(BadRequest, match=r'raw must be true or false, got \{"": true\}$'):
        oa.parse_generate({"model": "m", "prompt": "p", "raw": {"": True}})


def test_the_default_context_setting_and_ollamas(caplog):
    from jupyter_llama.config import context_length

    ours, theirs = "JUPYTER_LLAMA_CONTEXT_LENGTH", "OLLAMA_CONTEXT_LENGTH"
    assert context_length({}) is None
    assert context_length({ours: "8192"}) == (8192, ours)
    assert context_length({theirs: "8192"}) == (8192, theirs)
    assert context_length({ours: "2048", theirs: "8192"}) == (2048, ours)
    assert context_length({ours: "0", theirs: "8192"}) == (8192, theirs)  # 0 is unset, for both
    assert context_length({ours: " ", theirs: "0"}) is None
    assert context_length({theirs: '"8192"'}) == (8192, theirs)  # quotes dropped, as Ollama drops them
    assert context_length({theirs: "4"}) == (16, theirs)  # Ollama takes it; a load takes no less than 16
    for bad, said in (("lots", "expected a whole number"), ("8", "0 \\(unset\\) or 16 to"), ("-1", "16 to")):
        with pytest.raises(ConfigError, match=f"JUPYTER_LLAMA_CONTEXT_LENGTH.*{said}"):
            context_length({ours: bad})
    with caplog.at_level("WARNING", logger="jupyter_llama"):  # Ollama's: left out with a warning, as Ollama does
        assert context_length({theirs: "4k"}) is None
        assert context_length({theirs: "4k"}) is None
    assert [r.getMessage() for r in caplog.records].count(
        "jupyter-llama: OLLAMA_CONTEXT_LENGTH=\"4k\" is not a whole number of tokens; it is left out, as Ollama "
        "leaves it out") == 1
