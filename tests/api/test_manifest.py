"""Manifests: the built-in ones carry the spec's values, files round-trip through JSON
and TOML, every bad input is a ManifestError naming the field path and the value, and
``resolve`` matches device models by exact name only and reports every difference in
one error (FI01, defect S08)."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

from calfsm.drivers.base import Calbin
from calfsm.errors import ManifestError
from calfsm.manifest import (
    MAX_FILE_BYTES,
    DType,
    Manifest,
    ModelInfo,
    TaskKind,
    TensorInfo,
    builtin_manifest,
    builtin_manifest_names,
)

QWEN = builtin_manifest("qwen3-b1")
PREFILL, DECODE = "qwen3_b1_prefill_ids", "qwen3_b1_decode"


# ---- built-in manifests ---------------------------------------------------------------

def test_qwen3_builtin_has_the_spec_values() -> None:
    assert QWEN.kinds == (TaskKind.PREFILL_IDS, TaskKind.DECODE)
    prefill, decode = QWEN.submodel(TaskKind.PREFILL_IDS), QWEN.submodel(TaskKind.DECODE)
    assert (prefill.exact_name, decode.exact_name) == (PREFILL, DECODE)
    for sub in (prefill, decode):
        assert (sub.max_batch, sub.max_seq) == (1, 40960)
        assert sub.token_or_embed.dtype is DType.S32
        assert sub.position.dtype is DType.S32
        assert sub.logits.dtype is DType.BF16
        assert sub.vocab == 151936
        assert (sub.csr_cur_seq, sub.csr_total_seq) == ("cur_seq", "total_seq")
    assert prefill.logits_tile_d0 == 16 and prefill.rows == 16
    assert prefill.logits.shape == (1, 16, 151936)
    assert prefill.logits.byte_size == 16 * 151936 * 2
    assert prefill.token_or_embed.shape == (1, 40960) and prefill.max_tokens == 40960
    assert prefill.token_or_embed.sliceable
    assert decode.logits_tile_d0 is None and decode.rows == 1
    assert decode.logits.shape == (1, 1, 151936)
    assert decode.token_or_embed.shape == (1, 1)


def test_tiny_builtin() -> None:
    tiny = builtin_manifest("tiny")
    assert {s.vocab for s in tiny.submodels} == {1024}
    assert {s.max_seq for s in tiny.submodels} == {8192}
    assert tiny.submodel(TaskKind.PREFILL_IDS).logits_tile_d0 == 16


def test_unknown_builtin() -> None:
    with pytest.raises(ManifestError, match="'nope'"):
        builtin_manifest("nope")


# ---- file round trips -------------------------------------------------------------------

def test_json_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "m.manifest.json"
    path.write_text(json.dumps(QWEN.to_dict(), indent=2), "utf-8")
    assert Manifest.load(path) == QWEN
    assert Manifest.from_dict(json.loads(json.dumps(QWEN.to_dict()))) == QWEN


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(v)


def to_toml(data: dict[str, Any]) -> str:
    """Just enough TOML for a manifest: scalars, arrays, an array of tables
    (``[[submodels]]``) whose tables hold sub-tables, and top-level tables (``[timing]``).
    ``None`` is left out (no null)."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items()
             if not isinstance(v, list | dict) or (isinstance(v, list) and v
                                                   and not isinstance(v[0], dict))]
    for key, table in data.items():
        if isinstance(table, dict):
            lines += ["", f"[{key}]"]
            lines += [f"{k} = {_toml_value(v)}" for k, v in table.items() if v is not None]
    for key, items in data.items():
        if not (isinstance(items, list) and items and isinstance(items[0], dict)):
            continue
        for item in items:
            lines += ["", f"[[{key}]]"]
            lines += [f"{k} = {_toml_value(v)}" for k, v in item.items()
                      if v is not None and not isinstance(v, dict)]
            for sub, table in item.items():
                if isinstance(table, dict):
                    lines += ["", f"[{key}.{sub}]"]
                    lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()
                              if v is not None]
    return "\n".join(lines) + "\n"


def test_toml_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "m.manifest.toml"
    path.write_text(to_toml(QWEN.to_dict()), "utf-8")
    assert "[[submodels]]" in path.read_text("utf-8")
    assert Manifest.load(path) == QWEN


# ---- bad input --------------------------------------------------------------------------

def setter(*path: Any, value: Any) -> Callable[[dict], None]:
    def mutate(d: dict) -> None:
        for key in path[:-1]:
            d = d[key]
        d[path[-1]] = value
    return mutate


def deleter(*path: Any) -> Callable[[dict], None]:
    def mutate(d: dict) -> None:
        for key in path[:-1]:
            d = d[key]
        del d[path[-1]]
    return mutate


BAD: dict[str, tuple[Callable[[dict], None], tuple[str, ...]]] = {
    "bool for int": (setter("submodels", 0, "max_batch", value=True),
                     ("submodels[0].max_batch", "got True")),
    "string for int": (setter("submodels", 1, "max_seq", value="40960"),
                       ("submodels[1].max_seq", "got '40960'")),
    "float byte_size": (setter("submodels", 0, "logits", "byte_size", value=4861952.0),
                        ("submodels[0].logits.byte_size", "got 4861952.0")),
    "int for string": (setter("name", value=5), ("name: expected a string", "got 5")),
    "string for bool": (setter("submodels", 0, "logits", "sliceable", value="yes"),
                        ("submodels[0].logits.sliceable", "got 'yes'")),
    "string for shape": (setter("submodels", 0, "position", "shape", value="1,40960"),
                         ("submodels[0].position.shape", "got '1,40960'")),
    "int for a table": (setter("submodels", 0, "logits", value=5),
                        ("submodels[0].logits: expected a table", "got 5")),
    "int for a sub-model": (setter("submodels", 1, value=7),
                            ("submodels[1]: expected a table", "got 7")),
    "string for submodels": (setter("submodels", value="abc"),
                             ("submodels: expected a list", "got 'abc'")),
    "table for submodels": (setter("submodels", value={"decode": 1}),
                            ("submodels: expected a list", "got {'decode': 1}")),
    "negative byte_size": (setter("submodels", 1, "position", "byte_size", value=-4),
                           ("submodels[1].position.byte_size", "got -4")),
    "negative dimension": (setter("submodels", 1, "token_or_embed", "shape", value=[1, -1]),
                           ("submodels[1].token_or_embed.shape[1]", "got -1")),
    "zero max_batch": (setter("submodels", 0, "max_batch", value=0),
                       ("submodels[0].max_batch", "got 0")),
    "inconsistent byte_size": (setter("submodels", 1, "logits", "byte_size", value=303873),
                               ("submodels[1].logits.byte_size", "303873", "303872")),
    "unknown dtype": (setter("submodels", 1, "logits", "dtype", value="BF17"),
                      ("submodels[1].logits.dtype", "'BF17'")),
    "unknown task kind": (setter("submodels", 1, "kind", value="encode"),
                          ("submodels[1].kind", "'encode'")),
    "missing logits_tile_d0": (deleter("submodels", 0, "logits_tile_d0"),
                               ("submodels[0].logits_tile_d0", "prefill_ids")),
    "null logits_tile_d0": (setter("submodels", 0, "logits_tile_d0", value=None),
                            ("submodels[0].logits_tile_d0",)),
    "tile_d0 disagrees with logits rows": (
        setter("submodels", 0, "logits_tile_d0", value=8),
        ("submodels[0].logits.shape", "16 rows", "logits_tile_d0 is 8")),
    "duplicate exact names": (setter("submodels", 1, "exact_name", value=PREFILL),
                              ("submodels[1].exact_name", repr(PREFILL), "not unique")),
    "two sub-models of one key": (setter("submodels", 1, "kind", value="prefill_ids"),
                                  ("submodels: 2 sub-models keyed (prefill_ids, max_batch 1, "
                                   "max_seq 40960)",)),
    "empty submodels": (setter("submodels", value=[]), ("submodels: empty",)),
    "empty decode logits shape": (setter("submodels", 1, "logits", "shape", value=[]),
                                  ("submodels[1].logits.shape: empty",)),
    "extra key at the top": (setter("comment", value="hi"),
                             ("<root>: unknown field(s) ['comment']",)),
    "extra key in a tensor": (setter("submodels", 0, "logits", "layout", value="NHWC"),
                              ("submodels[0].logits: unknown field(s) ['layout']",)),
    "missing field": (deleter("submodels", 1, "csr_total_seq"),
                      ("submodels[1].csr_total_seq: required field missing",)),
}


def resized(*path: Any, field: str, value: Any, byte_size: int) -> Callable[[dict], None]:
    """Set a tensor's ``field`` and keep its byte size consistent, so only meaning is off."""
    def mutate(d: dict) -> None:
        t = d
        for key in path:
            t = t[key]
        t[field], t["byte_size"] = value, byte_size
    return mutate


# Manifests well-formed field by field but wrong by meaning: each fails at load.
WRONG_BY_MEANING: dict[str, tuple[Callable[[dict], None], tuple[str, ...]]] = {
    "prefill vocabulary differs from decode": (
        resized("submodels", 0, "logits", field="shape", value=[1, 16, 151935],
                byte_size=16 * 151935 * 2),
        ("submodels[0].logits.shape: vocabulary 151935 != 151936 of the decode "
         "sub-model (submodels[1])",)),
    "two tensors of a sub-model share a name": (
        setter("submodels", 1, "position", "name", value="input_ids"),
        ("submodels[1].position.name: 'input_ids' is also "
         "submodels[1].token_or_embed.name",)),
    "logits and an input share a name": (
        setter("submodels", 0, "logits", "name", value="position_ids"),
        ("submodels[0].logits.name: 'position_ids' is also submodels[0].position.name",)),
    "no decode sub-model": (
        lambda d: d["submodels"].pop(1), ("submodels: no decode sub-model",)),
    "no prefill_ids sub-model": (
        lambda d: d["submodels"].pop(0), ("submodels: no prefill_ids sub-model",)),
    "logits not BF16": (
        setter("submodels", 1, "logits", "dtype", value="F16"),
        ("submodels[1].logits.dtype: must be BF16", "got F16")),
    "one CSR for both lengths": (
        setter("submodels", 0, "csr_total_seq", value="cur_seq"),
        ("submodels[0].csr_total_seq: 'cur_seq' is also csr_cur_seq",)),
    "empty calrt_version": (setter("calrt_version", value=""), ("calrt_version: empty",)),
    "decode max_seq below the prefill's": (
        setter("submodels", 1, "max_seq", value=4096),
        ("submodels[1].max_seq: 4096 is below the max_seq 40960 of the prefill_ids "
         "sub-model (submodels[0])",)),
    "float token ids": (
        setter("submodels", 1, "token_or_embed", "dtype", value="F32"),
        ("submodels[1].token_or_embed.dtype: token ids need an integer type, got F32",)),
    "token ids wider than their dtype": (
        resized("submodels", 1, "token_or_embed", field="dtype", value="U16", byte_size=2),
        ("submodels[1].token_or_embed.dtype: U16 cannot hold token ids up to 151935",)),
    "positions wider than their dtype": (
        resized("submodels", 1, "position", field="dtype", value="S16", byte_size=2),
        ("submodels[1].position.dtype: S16 cannot hold positions up to 40959",)),
    "fewer positions than tokens": (
        resized("submodels", 0, "position", field="shape", value=[1, 20480],
                byte_size=20480 * 4),
        ("submodels[0].position.shape: [1, 20480] holds 20480 positions, token_or_embed "
         "holds 40960 tokens",)),
    "flat prefill logits": (
        resized("submodels", 0, "logits", field="shape", value=[16 * 151936],
                byte_size=16 * 151936 * 2),
        ("submodels[0].logits.shape: prefill logits must be [1, logits_tile_d0, vocab]",)),
    "flat embeddings": (
        lambda d: (setter("submodels", 0, "kind", value="prefill_embeds")(d),
                   setter("submodels", 0, "token_or_embed", "shape", value=[40960])(d)),
        ("submodels[0].token_or_embed.shape: embeddings must be [..., tokens, hidden], "
         "got [40960]",)),
}


assert not set(BAD) & set(WRONG_BY_MEANING)
EVERY_BAD = BAD | WRONG_BY_MEANING


@pytest.mark.parametrize("case", sorted(EVERY_BAD))
def test_bad_input_names_path_and_value(case: str) -> None:
    mutate, expected = EVERY_BAD[case]
    data = copy.deepcopy(QWEN.to_dict())
    mutate(data)
    with pytest.raises(ManifestError) as info:
        Manifest.from_dict(data)
    text = info.value.message  # not str(): its "http=500" suffix would match digits
    for part in expected:
        assert part in text, f"{part!r} not in {text!r}"
    assert info.value.stage == "manifest"
    assert "\n" not in str(info.value)


def test_a_manifest_for_another_runtime_is_incompatible() -> None:
    from calfsm.errors import ErrorCategory, Incompatible
    QWEN.check_runtime("0.7.6")
    with pytest.raises(Incompatible) as info:
        attrs.evolve(QWEN, calrt_version="0.7.5").check_runtime("0.7.6")
    assert info.value.category is ErrorCategory.COMPATIBILITY
    assert info.value.message == ("calrt_version: the manifest's calbin is built for CalRT "
                                  "0.7.5, the device runs CalRT 0.7.6")


@pytest.mark.parametrize("driver", ["sim", "calrt"])
def test_executor_start_up_refuses_a_manifest_for_another_runtime(driver: str) -> None:
    """It loaded, and ran, before issue 20. Refused before the device is configured,
    category compatibility: final at once, no recovery attempt."""
    from calfsm.drivers import driver_class
    from calfsm.errors import ErrorCategory, Incompatible
    from calfsm.executor import DeviceExecutor, ExecutorConfig

    tiny = attrs.evolve(builtin_manifest("tiny"), calrt_version="0.7.5")
    cls = driver_class(driver)
    drv = getattr(cls, "virtual", cls)(manifest_or_calbin=tiny)
    configured = []
    real_configure = drv.configure
    drv.configure = lambda calbin: configured.append(calbin) or real_configure(calbin)
    try:
        with pytest.raises(Incompatible, match=r"built for CalRT 0\.7\.5, the device runs "
                                               r"CalRT 0\.7\.6") as info:
            DeviceExecutor(drv, tiny, ExecutorConfig(threaded=False))
        assert info.value.category is ErrorCategory.COMPATIBILITY
        assert configured == []
    finally:
        drv.close()


@pytest.mark.parametrize("sha", [
    "", "ab", QWEN.calbin_sha256.upper(), QWEN.calbin_sha256[:-1],
    QWEN.calbin_sha256 + "0", QWEN.calbin_sha256[:-1] + "g", " " + QWEN.calbin_sha256[1:],
])
def test_malformed_calbin_sha256(sha: str) -> None:
    data = QWEN.to_dict() | {"calbin_sha256": sha}
    with pytest.raises(ManifestError, match="calbin_sha256: must be 64 lowercase hex"):
        Manifest.from_dict(data)


def test_embedding_prefill_rows_pass_the_position_check() -> None:
    """A prefill_embeds graph counts tokens on its second-to-last axis: ``[1, n, hidden]``
    embeddings beside ``[1, n]`` positions is right, and BF16 embeddings are not ids."""
    data = copy.deepcopy(QWEN.to_dict())
    emb = copy.deepcopy(data["submodels"][0])
    emb.update(kind="prefill_embeds", exact_name="qwen3_b1_prefill_embeds")
    emb["token_or_embed"] = {"name": "inputs_embeds", "shape": [1, 40960, 64],
                             "dtype": "BF16", "byte_size": 40960 * 64 * 2,
                             "sliceable": True}
    data["submodels"].append(emb)
    sub = Manifest.from_dict(data).submodel(TaskKind.PREFILL_EMBEDS)
    assert sub.max_tokens == 40960
    emb["position"] |= {"shape": [1, 4096], "byte_size": 4096 * 4}
    with pytest.raises(ManifestError, match=r"submodels\[2\]\.position\.shape"):
        Manifest.from_dict(data)


def test_builtin_manifest_names() -> None:
    assert builtin_manifest_names() == ("qwen3-b1", "tiny", "qwen3-b8", "tiny-b8",
                                        "qwen3-buckets", "tiny-buckets")
    for name in builtin_manifest_names():
        assert builtin_manifest(name).name == name


def test_every_validation_problem_is_reported_at_once() -> None:
    data = copy.deepcopy(QWEN.to_dict())
    data["submodels"][0]["max_seq"] = -1
    data["submodels"][1]["logits"]["byte_size"] = 1
    del data["submodels"][0]["logits_tile_d0"]
    with pytest.raises(ManifestError) as info:
        Manifest.from_dict(data)
    for part in ("submodels[0].max_seq", "submodels[1].logits.byte_size",
                 "submodels[0].logits_tile_d0"):
        assert part in info.value.message


@pytest.mark.parametrize("top", [[1, 2], "manifest", 3, None])
def test_non_mapping_top_level(top: Any, tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=f"must be a mapping, got {type(top).__name__}"):
        Manifest.from_dict(top)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(top), "utf-8")
    with pytest.raises(ManifestError, match="must be a mapping"):
        Manifest.load(path)


@pytest.mark.parametrize(("suffix", "text"), [
    (".json", '{"calbin_sha256": "ab", "submodels": [}'),
    (".json", "\xff\xfe not utf-8"),
    (".toml", 'calbin_sha256 = "ab"\nsubmodels = [\n'),
    (".toml", "name = \n"),
])
def test_malformed_file(suffix: str, text: str, tmp_path: Path) -> None:
    path = tmp_path / f"broken{suffix}"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ManifestError, match="does not parse") as info:
        Manifest.load(path)
    assert str(path) in info.value.message


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="cannot read manifest"):
        Manifest.load(tmp_path / "absent.json")


DEEP = 100_000


@pytest.mark.parametrize(("suffix", "text"), [
    (".json", "[" * DEEP + "]" * DEEP),
    (".json", '{"name": ' + '{"a": ' * DEEP + "1" + "}" * DEEP + "}"),
    (".toml", "name = " + "[" * DEEP + "]" * DEEP + "\n"),
    (".toml", "name = " + "{a = " * 5000 + "1" + "}" * 5000 + "\n"),
    (".toml", "name = " + "[" * 100 + "]" * 100 + "\n"),   # parses, then too deep
])
def test_deep_nesting_is_a_manifest_error_not_a_recursion_error(suffix: str, text: str,
                                                                tmp_path: Path) -> None:
    path = tmp_path / f"deep{suffix}"
    path.write_text(text)
    with pytest.raises(ManifestError, match="does not parse: nested") as info:
        Manifest.load(path)
    assert "more than the 64 allowed" in info.value.message \
        or "nested deeper than the 64 allowed" in info.value.message


@pytest.mark.parametrize("kind", ["fifo", "directory", "dev-zero"])
def test_a_manifest_that_is_no_regular_file_is_refused_at_once(kind: str,
                                                               tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    if kind == "fifo":
        os.mkfifo(path)                 # a read would wait for a writer forever
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")    # a read that never ends
    with pytest.raises(ManifestError, match=r"cannot read manifest .*not a regular file"):
        Manifest.load(path)


def test_an_oversized_manifest_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    path.write_text(json.dumps(QWEN.to_dict()) + " " * MAX_FILE_BYTES)
    with pytest.raises(ManifestError, match=f"more than the {MAX_FILE_BYTES} allowed"):
        Manifest.load(path)


# ---- resolve against a device -----------------------------------------------------------

def device(manifest: Manifest = QWEN) -> Calbin:
    return Calbin.from_manifest(manifest)


def renamed(calbin: Calbin, old: str, new: str) -> tuple[ModelInfo, ...]:
    return tuple(attrs.evolve(m, name=new) if m.name == old else m for m in calbin.models)


def with_name(manifest: Manifest, old: str, new: str) -> Manifest:
    return attrs.evolve(manifest, submodels=tuple(
        attrs.evolve(s, exact_name=new) if s.exact_name == old else s
        for s in manifest.submodels))


def resolve_error(manifest: Manifest, models: tuple[ModelInfo, ...]) -> str:
    with pytest.raises(ManifestError) as info:
        manifest.resolve(models)
    assert info.value.stage == "resolve"
    return info.value.message


def test_resolve_matches_by_exact_name() -> None:
    resolved = QWEN.resolve(device().models)
    assert {k: m.name for k, m in resolved.items()} == {
        TaskKind.PREFILL_IDS: PREFILL, TaskKind.DECODE: DECODE}
    # Order of the device list does not matter.
    assert QWEN.resolve(tuple(reversed(device().models))) == resolved


def _one_char_off(name: str, i: int) -> str:
    return name[:i] + ("x" if name[i] != "x" else "y") + name[i + 1:]


def test_fi01_one_character_wrong_in_the_manifest_fails_naming_both_names() -> None:
    models = device().models
    for right in (PREFILL, DECODE):
        for i in range(len(right)):
            wrong = _one_char_off(right, i)
            message = resolve_error(with_name(QWEN, right, wrong), models)
            assert f"missing on device: {wrong!r}" in message
            assert f"unexpected {'decode' if right == DECODE else 'prefill_ids'} model " \
                   f"{right!r}" in message


def test_fi01_one_character_wrong_on_the_device_side_too() -> None:
    message = resolve_error(QWEN, renamed(device(), DECODE, "qwen3_b1_dec0de"))
    assert f"missing on device: {DECODE!r}" in message
    assert "unexpected decode model 'qwen3_b1_dec0de'" in message


def test_fi01_names_an_untagged_device_model_beside_the_missing_name() -> None:
    models = tuple(attrs.evolve(m, kind=None) for m in
                   renamed(device(), DECODE, "qwen3_b1_dec0de"))
    message = resolve_error(QWEN, models)
    assert f"missing on device: {DECODE!r}" in message
    assert "unexpected untagged model 'qwen3_b1_dec0de'" in message
    # with nothing missing, extra untagged graphs (other workloads) are not an error
    extra = ModelInfo("vision_tower", None, (), (), ())
    assert QWEN.resolve((*device().models, extra))


def test_never_a_substring_match() -> None:
    message = resolve_error(QWEN, renamed(device(), DECODE, "qwen3_b1_decode_v2"))
    assert f"missing on device: {DECODE!r}" in message
    assert "'qwen3_b1_decode_v2'" in message
    # ...and a shorter device name does not satisfy a longer manifest name either.
    message = resolve_error(QWEN, renamed(device(), PREFILL, "qwen3_b1_prefill"))
    assert f"missing on device: {PREFILL!r}" in message


def test_a_near_name_beside_the_exact_one_is_reported_not_chosen() -> None:
    decode = next(m for m in device().models if m.name == DECODE)
    models = (*device().models, attrs.evolve(decode, name="qwen3_b1_decode_v2"))
    message = resolve_error(QWEN, models)
    assert "unexpected decode model 'qwen3_b1_decode_v2'" in message
    assert "missing" not in message


def test_duplicate_device_names() -> None:
    models = device().models
    message = resolve_error(QWEN, (*models, models[1]))
    assert f"{DECODE!r} listed 2 times by device" in message


def test_every_device_difference_in_one_error() -> None:
    calbin = device()
    prefill = next(m for m in calbin.models if m.name == PREFILL)
    decode = next(m for m in calbin.models if m.name == DECODE)
    ids, pos = prefill.inputs
    calbin = calbin.replace_model(
        PREFILL, tile_d0=8,
        inputs=(attrs.evolve(ids, shape=(1, 40961)),
                attrs.evolve(pos, byte_size=pos.byte_size + 1)))
    calbin = calbin.replace_model(
        DECODE, csr_names=("cur_seq",),
        outputs=(attrs.evolve(decode.outputs[0], dtype=DType.F16),))
    message = resolve_error(QWEN, calbin.models)
    for part in (
        "submodels[0].token_or_embed.shape: manifest [1, 40960] != device [1, 40961]",
        "submodels[0].position.byte_size: manifest 163840 != device 163841",
        "submodels[0].logits_tile_d0: manifest 16 != device metadata 8",
        "submodels[1].logits.dtype: manifest BF16 != device F16",
        "submodels[1].csr_total_seq: CSR 'total_seq' not offered",
    ):
        assert part in message, part


def test_missing_tensor_on_the_device() -> None:
    calbin = device().replace_model(DECODE, outputs=(
        TensorInfo("logits_out", (1, 1, 151936), DType.BF16, 303872),))
    message = resolve_error(QWEN, calbin.models)
    assert "submodels[1].logits: tensor 'logits' missing in device model" in message


def test_device_model_of_another_kind_under_the_exact_name() -> None:
    calbin = device().replace_model(DECODE, kind=TaskKind.PREFILL_IDS)
    message = resolve_error(QWEN, calbin.models)
    assert "submodels[1].kind: manifest decode != device prefill_ids" in message


def test_untagged_device_model_and_unused_kinds_are_accepted() -> None:
    calbin = device().replace_model(DECODE, kind=None)
    vision = ModelInfo("qwen3_vision", TaskKind.VISION, (), (), ())
    resolved = QWEN.resolve((*calbin.models, vision))
    assert resolved[TaskKind.DECODE].name == DECODE


def test_empty_device() -> None:
    message = resolve_error(QWEN, ())
    assert f"missing on device: {PREFILL!r}" in message
    assert f"missing on device: {DECODE!r}" in message


def test_calbin_replace_model_can_rename() -> None:
    calbin = device().replace_model(DECODE, name="qwen3_b1_dec0de")
    assert "qwen3_b1_dec0de" in {m.name for m in calbin.models}


def test_a_deep_calbin_description_is_a_manifest_error(tmp_path: Path) -> None:
    text = "[" * DEEP + "]" * DEEP
    with pytest.raises(ManifestError, match="nested 100000 deep"):
        Calbin.from_json(text)
    fifo = tmp_path / "x.calbin.json"
    os.mkfifo(fifo)
    with pytest.raises(ManifestError, match=r"cannot read calbin .* a FIFO"):
        Calbin.load(fifo)


# ---- batch graphs (max_batch > 1) ---------------------------------------------------------

def test_batch_manifests_are_the_batch_one_graphs_with_eight_rows() -> None:
    for one, eight in (("tiny", "tiny-b8"), ("qwen3-b1", "qwen3-b8")):
        m1, m8 = builtin_manifest(one), builtin_manifest(eight)
        assert m1.kinds == m8.kinds
        for s1, s8 in zip(m1.submodels, m8.submodels, strict=True):
            assert (s1.max_batch, s8.max_batch) == (1, 8)
            assert (s1.batched, s8.batched) == (False, True)
            assert (s8.max_tokens, s8.rows, s8.vocab, s8.max_seq) == \
                (s1.max_tokens, s1.rows, s1.vocab, s1.max_seq)
            for f in ("token_or_embed", "position", "logits"):
                t1, t8 = getattr(s1, f), getattr(s8, f)
                assert t8.shape == (8, *t1.shape[1:])
                assert t8.byte_size == 8 * t1.byte_size
            assert not s8.token_or_embed.sliceable and not s8.position.sliceable


def _b8() -> dict:
    return builtin_manifest("tiny-b8").to_dict()


def _rebatched(index: int, field: str, batch: int) -> Callable[[dict], None]:
    def mutate(d: dict) -> None:
        t = d["submodels"][index][field]
        per_row = t["byte_size"] // t["shape"][0]
        t["shape"][0], t["byte_size"] = batch, per_row * batch
    return mutate


BATCH_WRONG: dict[str, tuple[Callable[[dict], None], tuple[str, ...]]] = {
    "token rows differ from max_batch": (
        _rebatched(1, "token_or_embed", 4),
        ("submodels[1].token_or_embed.shape: [4, 1] has batch dimension 4, max_batch is 8",)),
    "logits rows differ from max_batch": (
        _rebatched(0, "logits", 1),
        ("submodels[0].logits.shape", "batch dimension 1, max_batch is 8")),
    "position rows differ from max_batch": (
        _rebatched(2, "position", 2),
        ("submodels[2].position.shape", "batch dimension 2")),
    "max_batch says 8, tensors hold 1": (
        lambda d: d["submodels"][1].update(max_batch=1),
        ("submodels[1].token_or_embed.shape: [8, 1] has batch dimension 8, max_batch is 1",)),
    "a sliceable batch input": (
        setter("submodels", 0, "token_or_embed", "sliceable", value=True),
        ("submodels[0].token_or_embed.sliceable", "cannot be sliced")),
    "rank-1 batch tensor": (
        lambda d: d["submodels"][1]["position"].update(shape=[8], byte_size=32),
        ("submodels[1].position.shape: a batch graph's tensors are [batch, ...], got [8]",)),
}


@pytest.mark.parametrize("case", BATCH_WRONG, ids=list(BATCH_WRONG))
def test_batch_dimensions_are_checked(case: str) -> None:
    mutate, fragments = BATCH_WRONG[case]
    data = _b8()
    mutate(data)
    with pytest.raises(ManifestError) as info:
        Manifest.from_dict(data)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_a_batch_one_manifest_is_refused_a_batch_tensor() -> None:
    data = builtin_manifest("tiny").to_dict()
    _rebatched(1, "logits", 2)(data)
    with pytest.raises(ManifestError, match=r"submodels\[1\]\.logits\.shape: \[2, 1, 1024\] "
                                            r"has batch dimension 2, max_batch is 1"):
        Manifest.from_dict(data)
