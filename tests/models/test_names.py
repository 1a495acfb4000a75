import pytest

from jupyter_llama.models.names import (
    DEFAULT_HOST,
    DEFAULT_NAMESPACE,
    InvalidName,
    ModelName,
    is_valid_name,
    parse_name,
)
from jupyter_llama.scheduler import BadRequest


@pytest.mark.parametrize("text,parts,display", [
    ("tiny", (DEFAULT_HOST, DEFAULT_NAMESPACE, "tiny", "latest"), "tiny:latest"),
    ("tiny:v1", (DEFAULT_HOST, DEFAULT_NAMESPACE, "tiny", "v1"), "tiny:v1"),
    ("me/tiny", (DEFAULT_HOST, "me", "tiny", "latest"), "me/tiny:latest"),
    ("library/tiny:2", (DEFAULT_HOST, DEFAULT_NAMESPACE, "tiny", "2"), "tiny:2"),
    ("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M",
     ("hf.co", "bartowski", "Llama-3.2-1B-Instruct-GGUF", "Q4_K_M"),
     "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M"),
    ("localhost:5000/team/model:tag", ("localhost:5000", "team", "model", "tag"), "localhost:5000/team/model:tag"),
    ("local/library/tiny:latest", (DEFAULT_HOST, DEFAULT_NAMESPACE, "tiny", "latest"), "tiny:latest"),
    ("x.gguf", (DEFAULT_HOST, DEFAULT_NAMESPACE, "x.gguf", "latest"), "x.gguf:latest"),
    ("_private-1.5b", (DEFAULT_HOST, DEFAULT_NAMESPACE, "_private-1.5b", "latest"), "_private-1.5b:latest"),
    ("  padded  ", (DEFAULT_HOST, DEFAULT_NAMESPACE, "padded", "latest"), "padded:latest"),
    ("m" * 96 + ":" + "t" * 80, (DEFAULT_HOST, DEFAULT_NAMESPACE, "m" * 96, "t" * 80), "m" * 96 + ":" + "t" * 80),
])
def test_valid_names(text, parts, display):
    n = parse_name(text)
    assert n.parts == parts
    assert n.display == display
    assert str(n) == display
    assert n.full == f"{parts[0]}/{parts[1]}/{parts[2]}:{parts[3]}"
    assert parse_name(n.full) == n
    assert parse_name(n.display) == n
    assert is_valid_name(text)


def test_names_compare_case_insensitively_but_keep_their_case():
    a, b = parse_name("Tiny:Latest"), parse_name("tiny")
    assert a == b and hash(a) == hash(b)
    assert a.display == "Tiny:Latest"
    assert parse_name("library/tiny") == parse_name("tiny")
    assert parse_name("me/tiny") != parse_name("tiny")


def test_with_tag():
    assert parse_name("hf.co/o/r").with_tag("Q8_0").display == "hf.co/o/r:Q8_0"
    with pytest.raises(InvalidName):
        parse_name("tiny").with_tag("../x")


@pytest.mark.parametrize("text,reason", [
    ("", "empty"),
    ("   ", "empty"),
    ("a/b/c/d", "too many parts"),
    ("a//b", "empty part"),
    ("/abs", "empty part"),
    ("trailing/", "empty part"),
    ("tiny:", "empty tag"),
    (":tag", "empty model"),
    ("..", "'..'"),
    ("../x", "'..'"),
    ("a/../b", "'..'"),
    ("a..b", "'..'"),
    ("x:..", "'..'"),
    (".hidden", "must start with"),
    ("-x", "must start with"),
    ("tiny:-v1", "must start with"),
    ("a\\b", "path separator"),
    ("a\nb", "control character"),
    ("a\x00b", "control character"),
    ("a\x1bb", "control character"),
    ("a b", "space"),
    ("a\tb", "U+0009"),
    ("m" * 97, "too long"),
    ("tiny:" + "t" * 81, "too long"),
    ("n" * 81 + "/tiny", "too long"),
    ("h" * 351 + "/n/m", "too long"),
    ("hf.co/repo", "host/namespace/model"),
    ("tiny@sha256:" + "0" * 64, "'@'"),
    ("https://example.com/x.gguf", "URL"),
    ("a:b:c", "':'"),
    ("ns:x/m", "':'"),
    ("a/b:c/d", "':'"),
    ("caf\u00e9", "'é'"),
    ("na*me", "'*'"),
    ("ns.x/m", "cannot contain '.'"),
])
def test_invalid_names(text, reason):
    with pytest.raises(InvalidName) as ei:
        parse_name(text)
    msg = str(ei.value)
    assert reason in msg, msg
    assert msg.startswith("invalid model name")
    assert "\n" not in msg
    assert not is_valid_name(text)


def test_invalid_name_is_a_bad_request_and_a_value_error():
    with pytest.raises(InvalidName) as ei:
        parse_name("../etc/passwd")
    assert isinstance(ei.value, BadRequest) and isinstance(ei.value, ValueError)
    assert ei.value.status == 400


def test_non_string():
    with pytest.raises(InvalidName):
        parse_name(None)  # type: ignore[arg-type]


def test_model_name_is_hashable_and_usable_as_key():
    d = {parse_name("Tiny"): 1}
    assert d[parse_name("tiny:latest")] == 1
    assert isinstance(parse_name("tiny"), ModelName)


def test_same_model_is_the_one_name_comparison():
    from jupyter_llama.models.names import same_model

    assert same_model("tiny", "tiny:latest") and same_model("TINY:Latest", "local/library/tiny:latest")
    assert same_model("me/tiny:v1", "ME/Tiny:V1") and not same_model("me/tiny:v1", "tiny:v1")
    assert not same_model("tiny:q4", "tiny") and not same_model(None, "tiny") and not same_model("tiny", "")
    assert same_model("not a name!", "NOT A NAME!") and not same_model("not a name!", "tiny")


def test_a_pulled_name_and_the_bare_name_that_finds_it_are_inverse(monkeypatch):
    from jupyter_llama.models.names import also_registry, without_registry

    monkeypatch.delenv("JUPYTER_LLAMA_REGISTRY", raising=False)
    for text, bare in [("registry.ollama.ai/library/llama3.2:1b", "llama3.2:1b"),
                       ("Registry.Ollama.AI/me/tiny:v1", "me/tiny:v1")]:
        shown = without_registry(parse_name(text))
        assert shown is not None and shown.display == bare and also_registry(shown) == parse_name(text)
    for other in ("tiny:1b", "hf.co/owner/repo:Q4_K_M", "127.0.0.1:5000/library/tiny:1b"):
        assert without_registry(parse_name(other)) is None
    monkeypatch.setenv("JUPYTER_LLAMA_REGISTRY", "http://127.0.0.1:5000")  # a mirror: its models are the short ones
    assert without_registry(parse_name("127.0.0.1:5000/library/tiny:1b")).display == "tiny:1b"
    assert without_registry(parse_name("registry.ollama.ai/library/tiny:1b")) is None
