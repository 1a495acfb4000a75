"""Presets as pure functions: the Modelfile reader and writer, Go prompt templates, and how
``create``, ``generate``, ``chat`` and ``show`` parse and apply a preset (no server, no engine)."""

from __future__ import annotations

import pytest

from jupyter_llama.api import ollama as oa
from jupyter_llama.api.gotemplate import GoTemplate, TemplateSyntaxError, TemplateUnsupported
from jupyter_llama.api.modelfile import ModelfileError, parse_modelfile, read_modelfile, write_modelfile
from jupyter_llama.api.options import OLLAMA_SAMPLING_DEFAULTS, parameters_text, parse_parameters
from jupyter_llama.errors import BadRequest
from jupyter_llama.models.preset import Preset

MARIO = '''# Mario, from a GGUF next to this file
FROM ./weights/tiny.gguf

parameter temperature 1
PARAMETER num_ctx 2048
PARAMETER stop "<|im_end|>"
PARAMETER stop ###
PARAMETER use_mmap false
  # an indented comment
System """
You are Mario from Super Mario Bros.
Answer as Mario, the assistant, only.
"""
TEMPLATE """{{ if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}<|im_start|>user
{{ .Prompt }}<|im_end|>
<|im_start|>assistant
"""
MESSAGE user Is Toad a friend?
message assistant "Yes, Toad is
a friend."
LICENSE """MIT License

Copyright (c) Nintendo? No."""
LICENSE Apache-2.0
'''


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "tiny.gguf").write_bytes(b"GGUF")
    return tmp_path


# ----------------------------------------------------------------------------- reading


def test_a_modelfile_reads_into_ollamas_create_request(folder):
    mf = parse_modelfile(MARIO, folder)
    assert mf.from_files == [str(folder / "weights" / "tiny.gguf")] and mf.from_model is None
    assert mf.parameters == {"temperature": 1.0, "num_ctx": 2048, "stop": ["<|im_end|>", "###"], "use_mmap": False}
    assert isinstance(mf.parameters["temperature"], float) and isinstance(mf.parameters["num_ctx"], int)
    assert mf.system == "\nYou are Mario from Super Mario Bros.\nAnswer as Mario, the assistant, only.\n"
    assert mf.template.startswith("{{ if .System }}<|im_start|>system\n") and mf.template.endswith("assistant\n")
    assert mf.messages == [{"role": "user", "content": "Is Toad a friend?"},
                           {"role": "assistant", "content": "Yes, Toad is\na friend."}]
    assert mf.license == ["MIT License\n\nCopyright (c) Nintendo? No.", "Apache-2.0"]
    body = mf.create_body("mario", {"tiny.gguf": "sha256:" + "a" * 64})
    assert body["files"] == {"tiny.gguf": "sha256:" + "a" * 64} and "from" not in body
    assert body["parameters"]["stop"] == ["<|im_end|>", "###"] and body["license"][1] == "Apache-2.0"
    # and the server takes that body as it is
    req = oa.parse_create(body)
    assert req.preset.system == mf.system and req.preset.parameters == mf.parameters and not req.notes


def test_from_a_model_name_and_from_a_file_read_from_the_modelfiles_folder(folder, tmp_path_factory):
    mf = parse_modelfile("FROM tiny:latest\nSYSTEM hi", folder)
    assert mf.from_model == "tiny:latest" and not mf.from_files
    assert mf.create_body("x") == {"model": "x", "from": "tiny:latest", "system": "hi"}
    path = folder / "Modelfile"
    path.write_text("FROM weights/tiny.gguf\n")
    elsewhere = tmp_path_factory.mktemp("cwd")
    import os

    old = os.getcwd()
    os.chdir(elsewhere)  # relative to the Modelfile, not to where the command runs
    try:
        assert read_modelfile(path).from_files == [str(folder / "weights" / "tiny.gguf")]
    finally:
        os.chdir(old)


@pytest.mark.parametrize("text, line, words", [
    ("FROM tiny\nFORM tiny", 2, ['unknown instruction "FORM"', "did you mean FROM?"]),
    ("FROM tiny\n\n# fine\nSYSTME hi", 4, ['unknown instruction "SYSTME"', "did you mean SYSTEM?"]),
    ("FROM tiny\nADAPTER ./lora.gguf", 2, ["adapters (ADAPTER) are not supported", "llama-export-lora"]),
    ("FROM tiny\nPARAMETER temprature 0.5", 2, ['unknown parameter "temprature"', 'did you mean "temperature"']),
    ("FROM tiny\nPARAMETER num_ctx lots", 2, ['PARAMETER num_ctx: "lots" is not a whole number']),
    ("FROM tiny\nPARAMETER temperature warm", 2, ['"warm" is not a number']),
    ("FROM tiny\nPARAMETER use_mmap maybe", 2, ['"maybe" is not true or false']),
    ("FROM tiny\nPARAMETER num_ctx 4", 2, ["num_ctx 4 is too small"]),
    ("FROM tiny\nPARAMETER", 2, ["PARAMETER needs a parameter name and a value"]),
    ("FROM tiny\nSYSTEM", 2, ["SYSTEM needs a value"]),
    ("FROM tiny\nMESSAGE robot hello", 2, ['role of a MESSAGE is system, user or assistant, not "robot"']),
    ('FROM tiny\n\nSYSTEM """You are\nnever closed', 3, ['the """ that opens SYSTEM here is never closed']),
    ('FROM tiny\nSYSTEM "a" b', 2, ["text after the closing"]),
    ("FROM ./missing.gguf", 1, ["there is no such file", "relative paths are read from the Modelfile's folder"]),
    ("SYSTEM no from here", 0, ["there is no FROM line"]),
    ("FROM tiny\n!!! what", 2, ['"!!!" is not an instruction']),
])
def test_bad_modelfiles_name_the_line_and_what_to_write(folder, text, line, words):
    with pytest.raises(ModelfileError) as e:
        parse_modelfile(text, folder)
    msg = str(e.value)
    assert isinstance(e.value, BadRequest) and e.value.line == line
    assert msg.startswith(f"Modelfile line {line}: " if line else "Modelfile: ")
    for w in words:
        assert w in msg, msg
    assert "Traceback" not in msg and "{'" not in msg


def test_deprecated_parameters_are_dropped_with_a_warning_and_bom_and_crlf_are_read(folder):
    mf = parse_modelfile("\ufeffFROM tiny\r\nPARAMETER low_vram true\r\nPARAMETER top_k 5\r\n", folder)
    assert mf.parameters == {"top_k": 5}
    assert mf.warnings == ["line 2: the parameter low_vram is no longer used; it is ignored"]


def test_written_modelfiles_read_back_the_same(folder):
    preset = dict(system="  leading and trailing  ", template="{{ .Prompt }}\n",
                  parameters={"stop": ["\n", "</s>", 'say "hi"'], "temperature": 0.25, "num_ctx": 512,
                              "flash_attn": "on"},
                  messages=[{"role": "user", "content": 'multi\n"line"'}], license=["one", "two\nlines"])
    text = write_modelfile(["tiny"], header=["# a header"], **preset)
    assert text.startswith("# a header\nFROM tiny\nTEMPLATE ") and "PARAMETER temperature 0.25\n" in text
    mf = parse_modelfile(text, folder)
    assert (mf.from_model, mf.system, mf.template, mf.parameters, mf.messages, mf.license) == (
        "tiny", preset["system"], preset["template"], preset["parameters"], preset["messages"], preset["license"])


# ----------------------------------------------------------------------------- templates

CHATML_MESSAGES = '''{{- range $i, $m := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 -}}
<|im_start|>{{ $m.Role }}
{{ $m.Content }}{{ if not $last }}<|im_end|>
{{ end }}
{{- if and (ne $m.Role "assistant") $last }}<|im_end|>
<|im_start|>assistant
{{ end }}
{{- end }}'''

LEGACY = '''{{ if .System }}[SYS]{{ .System }}[/SYS]{{ end }}[USER]{{ .Prompt }}[/USER]{{ .Response }}</s>'''

CONVO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"},
         {"role": "user", "content": "and again"}]


def test_a_messages_template_renders_the_whole_conversation():
    t = GoTemplate.parse(CHATML_MESSAGES)
    assert t.uses_messages
    assert t.render(CONVO) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                               "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nAgain\n\nand again"
                               "<|im_end|>\n<|im_start|>assistant\n")


def test_a_legacy_template_runs_once_per_exchange_and_the_last_is_cut_at_the_response():
    t = GoTemplate.parse(LEGACY)
    assert t.render(CONVO) == ("[SYS]Be brief.[/SYS][USER]Hi[/USER]Hello!</s>"
                               "[USER]Again\n\nand again[/USER]")
    # a template naming neither .Messages nor .Response gets {{ .Response }} at its end
    assert GoTemplate.parse("Q: {{ .Prompt }}\nA:").render([{"role": "user", "content": "why?"}]) == "Q: why?\nA:"


def test_template_language_pieces():
    values = {"Messages": [{"Role": "user", "Content": "a"}, {"Role": "assistant", "Content": "b"}],
              "System": "sys", "N": 3, "Empty": ""}
    cases = {
        "{{- /* a comment */ -}}  x  {{- .System -}}  y": "xsysy",
        '{{ if eq .System "sys" "other" }}yes{{ else }}no{{ end }}': "yes",
        "{{ if .Empty }}a{{ else if .N }}b{{ else }}c{{ end }}": "b",
        "{{ range $i, $m := .Messages }}{{ $i }}={{ .Role }};{{ end }}": "0=user;1=assistant;",
        "{{ range .Messages }}{{ if eq .Role \"assistant\" }}{{ break }}{{ end }}{{ .Content }}{{ end }}": "a",
        "{{ range .Nothing }}x{{ else }}none{{ end }}": "none",
        "{{ with .System }}[{{ . }}]{{ end }}{{ with .Empty }}no{{ else }}-{{ end }}": "[sys]-",
        "{{ $x := .N }}{{ $x = 4 }}{{ $x }}": "4",
        "{{ (index .Messages 1).Content }}{{ len .Messages }}{{ .System | len }}": "b23",
        '{{ printf "%s/%d/%q" .System .N "q" }}': 'sys/3/"q"',
        "{{ json .Messages }}": '[{"Role":"user","Content":"a"},{"Role":"assistant","Content":"b"}]',
        "{{ and .System .Empty }}|{{ or .Empty .N }}|{{ not .N }}|{{ lt 1 2 }}": "|3|false|true",
    }
    for src, want in cases.items():
        assert GoTemplate.parse(src).execute(values) == want, src


@pytest.mark.parametrize("src, err, words", [
    ("{{ if .System }}x", TemplateSyntaxError, "has no {{ end }}"),
    ("{{ .System ", TemplateSyntaxError, "every {{ needs its }}"),
    ("x {{ end }}", TemplateSyntaxError, "unexpected {{ end }}"),
    ("{{ range .Messages }}{{ end }}{{ break }}", TemplateSyntaxError, "outside a range"),
    ('{{ define "t" }}x{{ end }}', TemplateUnsupported, "define"),
    ("{{ toTypeScriptType .Tools }}", TemplateUnsupported, "toTypeScriptType"),
    ("{{ .Method 1 }}", TemplateUnsupported, "method call"),
])
def test_templates_we_cannot_run_are_told_apart_from_text_that_is_no_template(src, err, words):
    with pytest.raises(err) as e:
        GoTemplate.parse(src)
    assert words in str(e.value)


# ----------------------------------------------------------------------------- the wire


def test_create_parses_ollamas_preset_fields_and_refuses_bad_ones_in_words():
    req = oa.parse_create({"model": "mario", "from": "tiny", "system": "You are Mario",
                           "parameters": {"stop": "###", "num_predict": 3.0, "temperature": 1},
                           "messages": [{"role": "user", "content": "hi"}], "license": "MIT",
                           "template": "{{ define \"x\" }}{{ end }}{{ .Prompt }}"})
    assert req.from_ == "tiny" and req.preset.system == "You are Mario" and req.preset.license == ["MIT"]
    assert req.preset.parameters == {"stop": ["###"], "num_predict": 3, "temperature": 1.0}
    assert req.preset.messages == [{"role": "user", "content": "hi"}]
    assert req.notes and "cannot run" in req.notes[0] and "model's own chat template" in req.notes[0]
    bad = {
        "parameters": ({"temprature": 1}, 'unknown parameter "temprature" (did you mean "temperature"?)'),
        "parameters ": ({"num_ctx": "big"}, 'parameter num_ctx must be a whole number, not "big"'),
        "parameters  ": ({"stop": [1, 2]}, "parameter stop must be a string or a list of strings, not [1, 2]"),
        "parameters   ": ([1], "parameters must be an object of parameter names and values"),
        "license": (7, "license must be a string or a list of strings"),
        "messages": ([{"role": "robot", "content": "x"}], 'messages[0].role must be system, user or assistant, '
                                                          'not "robot"'),
        "template": ("{{ if .System }}", "has no {{ end }}"),
        "adapters": ({"a": "sha256:" + "1" * 64}, "adapters (LoRA) are not supported"),
    }
    for key, (value, words) in bad.items():
        with pytest.raises(BadRequest) as e:
            oa.parse_create({"model": "m", "from": "tiny", key.strip(): value})
        assert words in str(e.value), str(e.value)


def test_a_preset_is_the_default_of_every_request_and_the_request_wins():
    preset = Preset(system="You are Mario", parameters={"num_ctx": 512, "num_predict": 3, "stop": ["###"],
                                                          "temperature": 0.5},
                    messages=[{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "Mario"}])
    g = oa.parse_generate({"model": "mario", "prompt": "hi"}, preset)
    assert g.options.num_ctx == 512
    assert g.sampling == {**OLLAMA_SAMPLING_DEFAULTS, "n_predict": 3, "stop": ["###"], "temperature": 0.5}
    assert g.prompt_messages() == [{"role": "system", "content": "You are Mario"}, *preset.messages,
                                   {"role": "user", "content": "hi"}]
    g = oa.parse_generate({"model": "mario", "prompt": "hi", "system": "You are Luigi",
                           "options": {"num_ctx": 1024, "stop": "!"}}, preset)
    assert g.options.num_ctx == 1024 and g.sampling["stop"] == ["!"] and g.sampling["n_predict"] == 3
    assert g.prompt_messages()[0] == {"role": "system", "content": "You are Luigi"}
    raw = oa.parse_generate({"model": "mario", "prompt": "hi", "raw": True}, preset)
    assert not raw.default_system and not raw.history and raw.sampling["n_predict"] == 3
    assert oa.parse_generate({"model": "mario", "prompt": ""}, preset).is_load_only  # the preset's system: no prompt

    c = oa.parse_chat({"model": "mario", "messages": [{"role": "user", "content": "hi"}]}, preset)
    assert [m["content"] for m in c.all_messages] == ["You are Mario", "Who are you?", "Mario", "hi"]
    c = oa.parse_chat({"model": "mario", "messages": [{"role": "system", "content": "Be Luigi"},
                                                      {"role": "user", "content": "hi"}]}, preset)
    assert [m["content"] for m in c.all_messages] == ["Who are you?", "Mario", "Be Luigi", "hi"]
    assert oa.parse_chat({"model": "mario", "messages": []}, preset).is_load_only
    assert oa.parse_embed({"model": "mario", "input": "x"}, preset).options.num_ctx == 512


def test_a_preset_template_renders_the_prompt_unless_the_request_needs_llama_servers_chat_route():
    preset = Preset(template="Q: {{ .Prompt }} A:")
    g = oa.parse_generate({"model": "m", "prompt": "why"}, preset)
    assert g.template.render(g.prompt_messages()) == "Q: why A:"
    g = oa.parse_generate({"model": "m", "prompt": "why", "template": "<{{ .Prompt }}>"}, preset)
    assert g.template.render(g.prompt_messages()) == "<why>"  # the request's template wins
    assert oa.parse_generate({"model": "m", "prompt": "why", "raw": True}, preset).template is None
    with pytest.raises(BadRequest, match="cannot run"):
        oa.parse_generate({"model": "m", "prompt": "x", "template": "{{ template \"t\" }}"})
    msgs = [{"role": "user", "content": "hi"}]
    assert oa.parse_chat({"model": "m", "messages": msgs}, preset).templated is not None
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert oa.parse_chat({"model": "m", "messages": msgs, "tools": tools}, preset).templated is None
    unsupported = Preset(template="{{ toTypeScriptType .X }}")
    assert oa.parse_chat({"model": "m", "messages": msgs}, unsupported).templated is None


def test_show_gives_ollamas_preset_fields_and_a_modelfile_that_recreates_the_model(tmp_path):
    preset = Preset(system="You are Mario", template="{{ .Prompt }}", license=["MIT", "Apache-2.0"],
                    parameters={"stop": ["<|im_end|>", "###"], "temperature": 0.5, "num_ctx": 2048},
                    messages=[{"role": "user", "content": "hi"}])
    show = {"name": "mario:latest", "preset": preset.to_dict(), "template": "{% jinja %}", "info": {},
            "files": [{"role": "model", "path": "/store/blobs/sha256-aa"},
                      {"role": "system", "path": "/store/blobs/sha256-bb"}]}
    body = oa.show_body(show)
    assert body["system"] == "You are Mario" and body["template"] == "{{ .Prompt }}"
    assert body["license"] == "MIT\nApache-2.0" and body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["parameters"].splitlines() == [
        'stop                           "<|im_end|>"', 'stop                           "###"',
        "temperature                    0.5", "num_ctx                        2048"]
    assert parameters_text(parse_parameters({"seed": 7})) == "seed                           7"
    mf = parse_modelfile(body["modelfile"].replace("/store/blobs/sha256-aa", "tiny"), tmp_path)
    assert mf.from_model == "tiny" and "FROM /store/blobs/sha256-aa\n" in body["modelfile"]
    assert Preset(mf.system, mf.template, mf.parameters, mf.messages, mf.license) == preset
    plain = oa.show_body({"name": "tiny", "template": "{% jinja %}", "info": {}, "files": []})
    assert plain["parameters"] == "" and plain["system"] == "" and plain["template"] == "{% jinja %}"
