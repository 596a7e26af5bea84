"""The model's own chat template renders as Hugging Face ``transformers`` renders it.

The templates in data/chat_templates/ are written for these tests in the style of
Qwen2.5's and Qwen3's (tools, tool calls, tool results, reasoning), Llama 3.1's
(``bos_token``, ``strftime_now``, ``raise_exception``, ``tojson(indent=4)``) and a plain
ChatML one; each ships as a ``tokenizer_config.json`` as Hugging Face ships one, and the
expected strings were rendered once by ``transformers`` 5.25.0 (its
``apply_chat_template(..., tokenize=False)``) in a scratch virtualenv outside the project:
data/chat_templates/make_expected.py. No network, no transformers here.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

pytest.importorskip("jinja2")
tokenizers = pytest.importorskip("tokenizers")

from calfsm.errors import InvalidArgument  # noqa: E402
from calfsm.generate.chattemplate import ChatTemplate, load_chat_template  # noqa: E402
from calfsm.generate.tokenizer import HFTokenizer  # noqa: E402

DATA = Path(__file__).parent / "data" / "chat_templates"
NAMES = ("qwen25", "qwen3", "llama3", "chatml")


def _cases():
    for name in NAMES:
        for case in json.loads((DATA / name / "cases.json").read_text("utf-8"))["cases"]:
            yield pytest.param(name, case, id=f"{name}-{case['name']}")


@pytest.mark.parametrize(("name", "case"), list(_cases()))
def test_renders_as_transformers(name, case):
    template = load_chat_template(DATA / name)
    assert template is not None
    text = template.render(case["messages"], tools=case["tools"],
                           add_generation_prompt=case["add_generation_prompt"],
                           **case["variables"])
    assert text == case["expected"]


@pytest.mark.parametrize("name", NAMES)
def test_config_holds_the_template_source(name):
    config = json.loads((DATA / name / "tokenizer_config.json").read_text("utf-8"))
    assert config["chat_template"] == (DATA / name / "template.jinja").read_text("utf-8")


def test_special_tokens_from_the_config():
    # an AddedToken's dict gives its content; a null token is not given
    assert load_chat_template(DATA / "chatml").special_tokens == {
        "bos_token": "<s>", "eos_token": "<|im_end|>", "unk_token": "<unk>"}
    assert load_chat_template(DATA / "qwen3").special_tokens == {
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert load_chat_template(DATA / "llama3").render(
        [{"role": "user", "content": "x"}]).startswith("<|begin_of_text|>")


def test_strftime_now_is_today():
    t = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}")
    before = datetime.now().strftime("%Y-%m-%d")
    assert t.render([]) in (before, datetime.now().strftime("%Y-%m-%d"))


def test_loop_controls_generation_tag_and_tojson():
    t = ChatTemplate("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                     "{% if m.role == 'system' %}{% continue %}{% endif %}"
                     "{% generation %}{{ m | tojson(sort_keys=true) }}{% endgeneration %}"
                     "{% endfor %}")
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "<é>"},
            {"role": "user", "content": "never"}]
    assert t.render(msgs) == '{"content": "<é>", "role": "user"}'


def test_none_values_are_dropped_as_transformers_does():
    t = ChatTemplate("{{ 'content' in messages[0] }}")
    assert t.render([{"role": "assistant", "content": None}]) == "False"


def test_template_error_is_invalid_argument_of_the_request():
    t = load_chat_template(DATA / "llama3")
    two = [{"role": "user", "content": "x"},
           {"role": "assistant", "tool_calls": [
               {"type": "function", "function": {"name": "a", "arguments": {}}}] * 2}]
    with pytest.raises(InvalidArgument, match="only supports single tool-calls") as e:
        t.render(two, date_string="1 Jan 2025")
    assert e.value.http_status == 400
    with pytest.raises(InvalidArgument, match="refused"):
        ChatTemplate("{{ messages[0].content.upper() }}").render([])
    with pytest.raises(InvalidArgument, match="failed on the messages"):
        ChatTemplate("{{ 1 // messages|length }}").render([])


def test_the_sandbox_holds():
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(InvalidArgument):
        ChatTemplate(escape).render([{"role": "user", "content": "x"}])
    with pytest.raises(InvalidArgument, match="namespace"):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([])
    with pytest.raises(InvalidArgument):       # immutable: the inputs are not changed
        ChatTemplate("{{ messages.append(1) }}").render([])


def test_a_template_that_does_not_compile_is_a_config_error(tmp_path):
    with pytest.raises(InvalidArgument, match="does not compile") as e:
        ChatTemplate("{% for m in messages %}", origin="the test template")
    assert e.value.stage == "config"
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}!", encoding="utf-8")
    assert ChatTemplate.from_file(path).render([{"role": "user", "content": "hi"}]) == "hi!"
    with pytest.raises(InvalidArgument, match="cannot read"):
        ChatTemplate.from_file(tmp_path / "missing.jinja")


def test_named_templates_pick_tool_use_with_tools(tmp_path):
    config = {"chat_template": [{"name": "default", "template": "plain"},
                                {"name": "tool_use", "template": "tools={{ tools|length }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    t = load_chat_template(tmp_path)
    assert t.render([]) == "plain"
    assert t.render([], tools=[{"type": "function"}]) == "tools=1"


def test_chat_template_jinja_wins_over_the_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "config", "eos_token": "</s>"}))
    assert load_chat_template(tmp_path).render([]) == "config"
    (tmp_path / "chat_template.jinja").write_text("file {{ eos_token }}")
    assert load_chat_template(tmp_path).render([]) == "file </s>"


def test_hf_tokenizer_from_dir_loads_the_template(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    for f in ("tokenizer_config.json",):
        (tmp_path / f).write_text((DATA / "chatml" / f).read_text("utf-8"), "utf-8")
    hf = HFTokenizer.from_dir(tmp_path)
    text = hf.chat_template.render([{"role": "system", "content": "hi"}])
    ids = hf.encode(text, add_special_tokens=False)
    assert ids[0] == 2 and 3 in ids                # the special tokens are single ids
    assert HFTokenizer.from_file(tmp_path / "tokenizer.json").chat_template is None
    with pytest.raises(InvalidArgument, match=r"no tokenizer\.json"):
        HFTokenizer.from_dir(tmp_path / "nowhere")
