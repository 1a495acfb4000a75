"""The tokenizer a synthetic model carries: a SentencePiece ("llama") vocabulary of control
tokens, the 256 byte-fallback tokens and plain ASCII pieces, the ids the weights rely on, and
the chat templates (ChatML, and ChatML with tools and reasoning)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from gguf import TokenType

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Tools, tool calls (Hermes style, on one line), tool results and reasoning, for llama.cpp's
# chat parser (see the package's docstring); the generation prompt ends with <|tool_turn|>
# when tools are offered and thinking is off.
TOOLS_TEMPLATE = """\
{%- set thinking = enable_thinking is defined and enable_thinking %}
{%- if tools %}<|im_start|>system
{% if messages and messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You can call these tools:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call one, answer with <tool_call>{"name": NAME, "arguments": ARGUMENTS}</tool_call><|im_end|>
{% elif messages and messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% if not loop.first %}<|im_start|>system
{{ message.content }}<|im_end|>
{% endif %}
{%- elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if thinking %}<think>
{% elif tools %}<|tool_turn|>{% endif %}
{%- endif %}"""
TOOL_TURN = "<|tool_turn|>"
TOOL_CALL = "<tool_call>"
FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")

_SPECIALS = [
    ("<unk>", TokenType.UNKNOWN),
    ("<s>", TokenType.CONTROL),
    ("</s>", TokenType.CONTROL),
    ("<|im_start|>", TokenType.CONTROL),
    ("<|im_end|>", TokenType.CONTROL),
]
UNK_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(5)
_BYTE_BASE = len(_SPECIALS)
_FIRST_PIECE = _BYTE_BASE + 256
_SPACE = "\u2581"  # SentencePiece's word-boundary mark
_CHARS = [_SPACE] + [chr(c) for c in range(0x21, 0x7F)]
MIN_VOCAB = _FIRST_PIECE + len(_CHARS)  # specials, bytes and single characters: 356

_WORDS = (
    "the of and to in is was for that on as with by he it at from his an are were which this be or "
    "has had not first one their its new after who they two her she been other when there all during "
    "into school time may years more most only over city some world would where later up such used many "
    "can state about national out known university united then made also year people what system because "
    "part work called between several while large number three under both found day well since before "
    "these team town based general second him film water like through could light river small music "
    "house long great early place play game local name will high each model data token word text hello "
    "llama server memory layer cache graph tensor weight value note book cell plot line point level"
).split()


def special_token_ids() -> dict[str, int]:
    """Ids of the control tokens in every synthetic vocabulary."""
    return {"unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID, "im_start": IM_START_ID, "im_end": IM_END_ID}


def _pieces():
    """Endless stream of distinct plain ASCII pieces, most 'useful' first."""
    yield from _CHARS
    seen = set(_CHARS)

    def fresh(p):
        if p not in seen:
            seen.add(p)
            return True
        return False

    for w in _WORDS:
        if fresh(_SPACE + w):
            yield _SPACE + w
    cons = "bcdfghjklmnprstvwxyz"
    vows = "aeiou"
    syll = [c + v for c in cons for v in vows]
    for s in syll:
        for p in (s, _SPACE + s):
            if fresh(p):
                yield p
    for w in _WORDS:
        if fresh(w):
            yield w
    for s in syll:
        for c in cons:
            for p in (s + c, _SPACE + s + c):
                if fresh(p):
                    yield p
    for s1 in syll:
        for s2 in syll:
            for p in (s1 + s2, _SPACE + s1 + s2):
                if fresh(p):
                    yield p
    i = 0
    while True:
        p = f"{_SPACE}w{i}"
        if fresh(p):
            yield p
        i += 1


def _vocabulary(n: int, extra: Sequence[tuple[str, TokenType]] = (), newline: bool = False,
                ) -> tuple[list[str], list[float], list[int]]:
    """``n`` tokens; the ``extra`` ones (tool and fill-in-the-middle tokens) take the last ids;
    with ``newline``, a plain ``"\n"`` piece comes first among the pieces."""
    tokens = [t for t, _ in _SPECIALS] + [f"<0x{b:02X}>" for b in range(256)]
    types = [int(tt) for _, tt in _SPECIALS] + [int(TokenType.BYTE)] * 256
    scores = [0.0] * len(tokens)
    gen = _pieces()
    if newline:
        gen = itertools.chain(["\n"], gen)
    for i in range(n - len(tokens) - len(extra)):
        tokens.append(next(gen))
        types.append(int(TokenType.NORMAL))
        scores.append(float(-i))
    for text, ttype in extra:
        tokens.append(text)
        types.append(int(ttype))
        scores.append(0.0)
    return tokens, scores, types
