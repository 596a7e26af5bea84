"""A realistic tokenizer for the tests and benchmarks of the qwen3 manifests, built here.

No model hub is reachable from a test, so this builds a Qwen-like one from text that is on
every machine: a byte-level BPE (Qwen2's pre-tokenizer regex, NFC, byte-level decoder)
trained with the ``tokenizers`` library on the sources of the running Python's standard
library, with Qwen3's added tokens at Qwen3's ids, padded to the 151,936 ids of the
qwen3 manifests' vocabulary:

- ids ``0..151642``: the learned BPE (the standard library yields ~146,600 merges: the
  ids it does not fill are unused special tokens ``<|bpe_unused_N|>``);
- ``151643 <|endoftext|>``, ``151644 <|im_start|>``, ``151645 <|im_end|>`` ... ``151657
  <tool_call>``, ``151658 </tool_call>`` ... ``151667 <think>``, ``151668 </think>``, as
  in Qwen3's ``tokenizer.json`` (tool-call and think tags not special: decoding keeps
  them);
- ``151669..151935``: ``<|reserved_N|>`` (every id the model can sample decodes).

It is saved as Hugging Face saves a tokenizer (``tokenizer.json``, and
``tokenizer_config.json`` with ``eos_token`` ``<|im_end|>``, ``pad_token``
``<|endoftext|>`` and a Qwen-style chat template with tools), so
``HFTokenizer.from_dir`` and ``calfsm serve --tokenizer DIR`` load it.

The build is deterministic for a given Python (its standard library is the corpus) and
``tokenizers`` version, and takes ~16 s on 2 idle cores (most of it reading and counting
the 31 MB corpus, not merging); :func:`cached_tokenizer` builds it once per machine into
a cache (``$CALFSM_CACHE_DIR``, else ``$XDG_CACHE_HOME/calfsm``, else ``~/.cache/calfsm``),
keyed by what it depends on, and atomically (two builds at once leave one). Run
``python -m calfsm.tools.make_tokenizer [OUT_DIR]`` to build it (by default into the
cache) and print where it is.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["BPE_IDS", "QWEN3_ADDED_TOKENS", "QWEN_CHAT_TEMPLATE", "VOCAB", "build_tokenizer",
           "cache_dir", "cached_tokenizer", "main"]

#: the qwen3 manifests' vocabulary (the logits' last dimension)
VOCAB = 151_936
#: ids of the learned BPE; Qwen's added tokens start here
BPE_IDS = 151_643
#: Qwen3's added tokens, from id BPE_IDS on: (text, special)
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
)
#: Qwen2's pre-tokenizer: contractions, words, single digits, punctuation runs, newlines
_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
          r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
#: bumped when the build changes what it makes (part of the cache key)
_BUILD_VERSION = 1

#: a ChatML template with tools and Hermes-style tool calls (Qwen's format), written for
#: this tokenizer: what ``calfsm serve --tokenizer DIR`` renders chats with
QWEN_CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions. Their signatures:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each call, return {"name": ..., "arguments": ...} within \
<tool_call></tool_call> tags.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{%- set call = call.function if call.function is defined else call %}
{%- if loop.first and message.content or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{%- if call.arguments is string %}{{- call.arguments }}{%- else %}\
{{- call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}\
{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}\
{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as e:
        raise SystemExit(f"calfsm: error: building the tokenizer needs the tokenizers "
                         f"package (pip install \"calfsm[hf]\"): {e}") from None
    return tokenizers


def corpus_files() -> list[Path]:
    """The corpus: the standard library's ``.py`` files (no site-packages), by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def _texts(files: list[Path], max_chars: int | None, seen: list[int]) -> Iterator[str]:
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if max_chars is not None and seen[0] + len(text) > max_chars:
            text = text[:max_chars - seen[0]]
        seen[0] += len(text)
        seen[1] += 1
        yield text
        if max_chars is not None and seen[0] >= max_chars:
            return


def _key(max_chars: int | None) -> str:
    tokenizers = _tokenizers()
    what = json.dumps([_BUILD_VERSION, VOCAB, max_chars, sys.version, tokenizers.__version__,
                       sysconfig.get_paths()["stdlib"]])
    return hashlib.sha256(what.encode()).hexdigest()[:12]


def build_tokenizer(out_dir: str | Path, *, max_chars: int | None = None) -> dict[str, Any]:
    """Train and save the tokenizer in ``out_dir`` (made if missing); ``max_chars``:
    train on the corpus' first characters only (fewer merges learned, the rest of the
    151,643 BPE ids unused). Returns what the build measured (also saved beside it, as
    ``calfsm-build.json``)."""
    tk = _tokenizers()
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
    start = time.perf_counter()
    tok = tk.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_IDS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    seen = [0, 0]
    tok.train_from_iterator(_texts(corpus_files(), max_chars, seen), trainer)
    trained_s = time.perf_counter() - start
    learned = tok.get_vocab_size()
    tok.add_special_tokens([tk.AddedToken(f"<|bpe_unused_{i}|>", special=True,
                                          normalized=False)
                            for i in range(BPE_IDS - learned)])
    for text, special in QWEN3_ADDED_TOKENS:
        tok.add_tokens([tk.AddedToken(text, special=special, normalized=False)])
    reserved = VOCAB - tok.get_vocab_size()
    tok.add_special_tokens([tk.AddedToken(f"<|reserved_{i}|>", special=True,
                                          normalized=False) for i in range(reserved)])
    if tok.get_vocab_size() != VOCAB or tok.token_to_id("<|endoftext|>") != BPE_IDS:
        raise RuntimeError(f"the tokenizer came out with {tok.get_vocab_size()} ids and "
                           f"<|endoftext|> at {tok.token_to_id('<|endoftext|>')}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 40960,
              "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "unk_token": None, "chat_template": QWEN_CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n",
                                               encoding="utf-8")
    info = {"vocab": VOCAB, "learned_bpe": learned, "corpus_files": seen[1],
            "corpus_chars": seen[0], "max_chars": max_chars, "train_s": round(trained_s, 2),
            "total_s": round(time.perf_counter() - start, 2), "python": sys.version,
            "tokenizers": tk.__version__, "cpus": os.cpu_count()}
    (out / "calfsm-build.json").write_text(json.dumps(info, indent=2) + "\n",
                                           encoding="utf-8")
    return info


def cache_dir() -> Path:
    """Where built tokenizers are kept: ``$CALFSM_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/calfsm``, else ``~/.cache/calfsm``."""
    if os.environ.get("CALFSM_CACHE_DIR"):
        return Path(os.environ["CALFSM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "calfsm"


def cached_tokenizer(cache: str | Path | None = None, *, max_chars: int | None = None
                     ) -> Path:
    """The directory of the built tokenizer in ``cache`` (None: :func:`cache_dir`),
    built there first if missing. Atomic: built in a temporary directory beside it, then
    renamed (a concurrent build that finishes first wins; this one's is dropped)."""
    root = Path(cache) if cache is not None else cache_dir()
    final = root / "tokenizers" / f"qwenlike-{VOCAB}-{_key(max_chars)}"
    if (final / "calfsm-build.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build_tokenizer(tmp, max_chars=max_chars)
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "calfsm-build.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> int:
    """``python -m calfsm.tools.make_tokenizer [OUT_DIR]``: build it, say where and how
    long it took."""
    p = argparse.ArgumentParser(prog="python -m calfsm.tools.make_tokenizer",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", nargs="?", default=None,
                   help="where to save it (default: the cache, reused if there)")
    p.add_argument("--max-chars", type=int, default=None,
                   help="train on this many characters of the corpus only (faster, fewer "
                        "merges learned)")
    args = p.parse_args(argv)
    if args.out_dir is None:
        path = cached_tokenizer(max_chars=args.max_chars)
        info = json.loads((path / "calfsm-build.json").read_text(encoding="utf-8"))
    else:
        path = Path(args.out_dir)
        info = build_tokenizer(path, max_chars=args.max_chars)
    print(f"{path}: {info['vocab']} ids, {info['learned_bpe']} learned from "
          f"{info['corpus_files']} files ({info['corpus_chars']} characters) in "
          f"{info['train_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
