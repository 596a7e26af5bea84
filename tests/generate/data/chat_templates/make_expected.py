"""Writes each template's tokenizer_config.json and the expected renderings (cases.json).

Run once, by hand, with Hugging Face ``transformers`` installed in a scratch virtualenv
outside the project (it is not a dependency of calfsm), no network needed:

    python3 -m venv /tmp/tf && /tmp/tf/bin/pip install transformers jinja2
    /tmp/tf/bin/python tests/generate/data/chat_templates/make_expected.py

The expected strings are ``tokenizer.apply_chat_template(messages, tools=...,
add_generation_prompt=..., tokenize=False, **variables)`` of a tokenizer loaded with
``AutoTokenizer.from_pretrained`` from the tokenizer_config.json written here.
"""

import json
import sys
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, models

HERE = Path(__file__).parent
SPECIAL = {
    "qwen25": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
    "qwen3": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "chatml": {"bos_token": {"content": "<s>", "lstrip": False, "normalized": False,
                             "rstrip": False, "single_word": False, "__type": "AddedToken"},
               "eos_token": "<|im_end|>", "unk_token": "<unk>"},
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city, e.g. Zürich"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def call(i, name, args):
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": name, "arguments": args}}


SIMPLE = [{"role": "system", "content": "You are terse."},
          {"role": "user", "content": "Hello <b>there</b> & “quotes” ☃"}]
NO_SYSTEM = [{"role": "user", "content": "What is 2+2?"},
             {"role": "assistant", "content": "4"},
             {"role": "user", "content": "And 3+3?"}]
ROUND_TRIP = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        call(0, "get_weather", {"city": "Paris", "unit": "celsius"}),
        call(1, "get_time", {"city": "Paris"})]},
    {"role": "tool", "tool_call_id": "call_0", "content": "{\"temp\": 21}"},
    {"role": "tool", "tool_call_id": "call_1", "content": "14:05"},
]
ONE_CALL = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        call(0, "get_weather", {"city": "Oslo"})]},
    {"role": "tool", "tool_call_id": "call_0", "content": "rain"},
]
STRING_ARGS = [
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [
        call(0, "get_weather", "{\"city\": \"Rome\"}")]},
    {"role": "tool", "tool_call_id": "call_0", "content": "sun"},
    {"role": "assistant", "content": "Sunny."},
    {"role": "user", "content": "Thanks"},
]
THINKING = [
    {"role": "user", "content": "Pick a number."},
    {"role": "assistant", "content": "<think>\nany will do\n</think>\n\n7"},
    {"role": "user", "content": "Another?"},
    {"role": "assistant", "reasoning_content": "still any", "content": "8"},
]

CASES = {
    "qwen25": [
        ("simple", SIMPLE, None, True, {}),
        ("no_system_multi_turn", NO_SYSTEM, None, True, {}),
        ("tools_round_trip", ROUND_TRIP, [WEATHER, TIME], True, {}),
        ("tools_first_turn", SIMPLE, [WEATHER], True, {}),
        ("string_arguments", STRING_ARGS, [WEATHER], False, {}),
    ],
    "qwen3": [
        ("simple", SIMPLE, None, True, {}),
        ("no_thinking", NO_SYSTEM, None, True, {"enable_thinking": False}),
        ("tools_round_trip", ROUND_TRIP, [WEATHER, TIME], True, {}),
        ("string_arguments", STRING_ARGS, [WEATHER], True, {}),
        ("reasoning", THINKING, None, False, {}),
    ],
    "llama3": [
        ("simple", SIMPLE, None, True, {"date_string": "26 Jul 2024"}),
        ("multi_turn", NO_SYSTEM, None, False, {"date_string": "1 Jan 2025"}),
        ("tools_one_call", ONE_CALL, [WEATHER], True, {"date_string": "26 Jul 2024"}),
        ("tools_in_system", ONE_CALL, [WEATHER, TIME], True,
         {"date_string": "26 Jul 2024", "tools_in_user_message": False}),
    ],
    "chatml": [
        ("simple", SIMPLE, None, True, {}),
        ("no_system", NO_SYSTEM, None, True, {}),
        ("no_generation_prompt", NO_SYSTEM, None, False, {}),
        ("tool_message", [*ONE_CALL[:1], {"role": "tool", "content": "rain"}], None, True,
         {}),
    ],
}


def main() -> None:
    import transformers
    from transformers import AutoTokenizer
    for name, cases in CASES.items():
        folder = HERE / name
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 32768,
                  "chat_template": (folder / "template.jinja").read_text(encoding="utf-8")}
        config.update(SPECIAL[name])
        (folder / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        with tempfile.TemporaryDirectory() as tmp:
            tok = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
            tok.save(str(Path(tmp) / "tokenizer.json"))
            (Path(tmp) / "tokenizer_config.json").write_text(json.dumps(config))
            hf = AutoTokenizer.from_pretrained(tmp)
            out = []
            for case, messages, tools, gen, variables in cases:
                text = hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                              add_generation_prompt=gen, **variables)
                out.append({"name": case, "messages": messages, "tools": tools,
                            "add_generation_prompt": gen, "variables": variables,
                            "expected": text})
        (folder / "cases.json").write_text(json.dumps(
            {"rendered_by": f"transformers {transformers.__version__}", "cases": out},
            indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        print(name, len(out), "cases", file=sys.stderr)


if __name__ == "__main__":
    main()
