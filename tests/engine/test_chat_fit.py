"""A chat longer than the context, against a real child: what is kept (Ollama's chatPrompt),
the retry the runner makes when the child refuses it, and truncate false."""

from __future__ import annotations

import json

import pytest

from jupyter_llama.engine.runner import Runner, _turn_start
from jupyter_llama.errors import BadRequest
from jupyter_llama.load_options import LoadOptions

pytestmark = pytest.mark.engine

SHAPE = dict(layers=2, embd=64, heads=4, kv_heads=2, ctx=4096, seed=3)
OPTS = LoadOptions(num_ctx=256, num_parallel=1, num_thread=1)


def long_chat(turns: int) -> list[dict]:
    """A system message, ``turns`` user/assistant pairs of about 40 tokens each (a synthetic
    vocabulary spells most words letter by letter), a last question."""
    msgs = [{"role": "system", "content": "system"}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"q{i} " + "x" * 32})
        msgs.append({"role": "assistant", "content": f"a{i} " + "y" * 32})
    return msgs + [{"role": "user", "content": "last?"}]


async def prompt_tokens(r: Runner, messages: list[dict]) -> int:
    prompt = (await r.post("/apply-template", {"messages": messages}))["prompt"]
    return len((await r.post("/tokenize", {"content": prompt, "add_special": True}))["tokens"])


def test_a_tool_result_is_never_cut_from_its_call():
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    msgs = [{"role": "system"}, {"role": "user"}, {"role": "assistant", "tool_calls": calls},
            {"role": "tool"}, {"role": "tool"}, {"role": "user"}, {"role": "tool"}]
    assert [_turn_start(msgs, i) for i in range(len(msgs))] == [0, 1, 2, 2, 2, 5, 6]


async def test_what_a_chat_longer_than_the_context_keeps(start_runner, make_model):
    r = await start_runner(make_model("fit-chat", **SHAPE), OPTS)
    msgs = long_chat(8)  # ~700 tokens, in a context of 256
    assert await prompt_tokens(r, msgs) > 256
    kept = await r.fit_chat(msgs, reserve=32)
    assert kept[0] == msgs[0], "the system message stays"
    assert kept[-1] == msgs[-1], "the latest message stays"
    assert kept[1:] == msgs[len(msgs) - len(kept) + 1:], "then the newest messages, in order"
    assert 2 < len(kept) < len(msgs)
    assert await prompt_tokens(r, kept) <= 256 - 32
    one_more = [msgs[0]] + msgs[len(msgs) - len(kept):]
    assert await prompt_tokens(r, one_more) > 256 - 32 - 1, "no older message would have fitted"


async def test_the_runner_answers_a_chat_the_child_refused_as_too_long(start_runner, make_model):
    r = await start_runner(make_model("fit-chat", **SHAPE), OPTS)
    msgs = long_chat(8)
    events: list[dict] = []
    await r.relay_chat(msgs, lambda batch: events.extend(json.loads(d) for d in batch), n_predict=4)
    final = events[-1]
    assert final["choices"][0]["finish_reason"] == "length" and final["timings"]["predicted_n"] == 4
    assert final["timings"]["prompt_n"] + final["timings"]["cache_n"] <= 256 - 4
    with pytest.raises(BadRequest, match="longer than the context.*allow truncate"):
        await r.relay_chat(msgs, lambda batch: None, truncate=False, n_predict=4)
    # what must stay (the last message) longer than the context on its own: a 400 that says so
    with pytest.raises(BadRequest, match=r"the chat's last message and its system messages, which a cut chat keeps, "
                                         r"are longer than the context of .* \([\d,]+ tokens, where the context of "
                                         r"256 has room for 251 beside the answer\)"):
        await r.relay_chat([{"role": "user", "content": "z" * 400}], lambda batch: None, n_predict=4)
