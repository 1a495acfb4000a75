"""The safety margin is a setting a person can lower: the refusal that says only the margin
does not fit names JUPYTER_LLAMA_SAFETY_MARGIN, so it must be read (engine-free, quick)."""

from __future__ import annotations

import pytest

from jupyter_llama.config import ConfigError
from jupyter_llama.scheduler import SchedulerSettings


@pytest.mark.parametrize("text, margin", [("4%", 0.04), ("0.04", 0.04), (" 12.5% ", 0.125), ("0", 0.0), ("100%", 1.0)])
def test_the_margin_from_the_environment(text, margin):
    assert SchedulerSettings.from_env({"JUPYTER_LLAMA_SAFETY_MARGIN": text}).safety_margin == pytest.approx(margin)


def test_the_margin_defaults_to_ten_percent_and_bad_values_name_the_variable():
    assert SchedulerSettings.from_env({}).safety_margin == 0.10
    assert SchedulerSettings.from_env({"JUPYTER_LLAMA_SAFETY_MARGIN": ""}).safety_margin == 0.10
    with pytest.raises(ConfigError, match=r"JUPYTER_LLAMA_SAFETY_MARGIN must be a percentage \(10%\) or a fraction"):
        SchedulerSettings.from_env({"JUPYTER_LLAMA_SAFETY_MARGIN": "a little"})
    for wrong in ("10", "-1%", "150%", "nan"):  # (10 is a thousand percent: written 10% for ten)
        with pytest.raises(ConfigError, match=r"JUPYTER_LLAMA_SAFETY_MARGIN must be 0% to 100%"):
            SchedulerSettings.from_env({"JUPYTER_LLAMA_SAFETY_MARGIN": wrong})


def test_the_margin_is_read_from_the_environment_beside_the_traits(monkeypatch):
    """The extension's traits do not name the margin: ``from_values`` (what the extension
    calls) reads its variable from the environment, and names that variable in errors."""
    label = lambda k: f"LlamaExtension.{k}"  # noqa: E731
    assert SchedulerSettings.from_values({}, label, {"JUPYTER_LLAMA_SAFETY_MARGIN": "5%"}).safety_margin == 0.05
    monkeypatch.setenv("JUPYTER_LLAMA_SAFETY_MARGIN", "2%")
    assert SchedulerSettings.from_values({"keep_alive": "1m"}, label).safety_margin == 0.02
    assert SchedulerSettings.from_values({"safety_margin": 0.07}, label).safety_margin == 0.07  # given: it wins
    monkeypatch.setenv("JUPYTER_LLAMA_SAFETY_MARGIN", "much")
    with pytest.raises(ConfigError, match=r"^JUPYTER_LLAMA_SAFETY_MARGIN must be"):
        SchedulerSettings.from_values({}, label)
