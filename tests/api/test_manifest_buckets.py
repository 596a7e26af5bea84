"""Shape buckets in the manifest (issue 36 item 3): several graphs of one kind, each keyed
``(kind, max_batch, max_seq)`` and looked up by its exact name (spec 10.2): a missing,
extra or duplicated key refuses Ready, on both drivers; the widest graph of a kind takes
every step, so a bucket manifest without evidence runs as one graph; a manifest without
buckets is what it was."""

from __future__ import annotations

import attrs
import pytest

from calfsm.drivers.base import Calbin
from calfsm.errors import ManifestError
from calfsm.manifest import Manifest, TaskKind, builtin_manifest

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@pytest.mark.parametrize("name", ["tiny-buckets", "qwen3-buckets"])
def test_builtin_bucket_manifests_hold_decode_graphs_at_every_batch(name: str) -> None:
    m = builtin_manifest(name)
    family = builtin_manifest("tiny" if name == "tiny-buckets" else "qwen3-b1")
    decodes = m.graphs(TaskKind.DECODE)
    assert [g.max_batch for g in decodes] == list(BUCKETS)
    assert m.bucketed and not family.bucketed
    assert m.submodel(TaskKind.DECODE) is decodes[-1]       # the widest takes every step
    assert {g.vocab for g in decodes} == {family.submodel(TaskKind.DECODE).vocab}
    assert {g.max_seq for g in decodes} == {family.submodel(TaskKind.DECODE).max_seq}
    assert m.graphs(TaskKind.PREFILL_IDS)[0].max_batch == 1
    assert len(set(m.kinds)) == len(m.kinds)
    gen = m.generation(1)
    assert set(gen.graphs) == {s.key for s in m.submodels}
    assert gen.submodels[TaskKind.DECODE].max_batch == 64


def test_a_manifest_without_buckets_keeps_one_graph_per_kind() -> None:
    for name in ("tiny", "tiny-b8", "qwen3-b1", "qwen3-b8"):
        m = builtin_manifest(name)
        assert not m.bucketed
        for kind in m.kinds:
            assert m.graphs(kind) == (m.submodel(kind),)


def _data(name: str = "tiny-buckets") -> dict:
    return builtin_manifest(name).to_dict()


def test_a_duplicated_key_is_refused_at_load() -> None:
    data = _data()
    dup = dict(data["submodels"][-1], exact_name="tiny_bk_decode_b64_again")
    data["submodels"].append(dup)
    with pytest.raises(ManifestError, match=r"2 sub-models keyed \(decode, max_batch 64, "
                                            r"max_seq 8192\)"):
        Manifest.from_dict(data)


def test_a_bucket_the_widest_graph_does_not_cover_is_refused() -> None:
    data = _data()
    b2 = next(s for s in data["submodels"] if s["exact_name"] == "tiny_bk_decode_b2")
    b2["max_seq"] = 16384
    with pytest.raises(ManifestError, match="decode b2 s16384 is not covered by the widest"):
        Manifest.from_dict(data)


def _resolve_error(manifest: Manifest, models: tuple) -> str:
    with pytest.raises(ManifestError) as info:
        manifest.resolve(models)
    return info.value.message


def test_every_bucket_is_resolved_by_its_exact_name() -> None:
    m = builtin_manifest("tiny-buckets")
    models = Calbin.from_manifest(m).models
    resolved = m.resolve(models)
    assert resolved[TaskKind.DECODE].name == "tiny_bk_decode_b64"
    # a bucket missing on the device, named (FI01: the near name beside it too)
    gone = tuple(x for x in models if x.name != "tiny_bk_decode_b8")
    assert "missing on device: 'tiny_bk_decode_b8'" in _resolve_error(m, gone)
    typo = tuple(attrs.evolve(x, name="tiny_bk_decode_b9") if x.name == "tiny_bk_decode_b8"
                 else x for x in models)
    message = _resolve_error(m, typo)
    assert "missing on device: 'tiny_bk_decode_b8'" in message
    assert "unexpected decode model 'tiny_bk_decode_b9'" in message
    # a graph of a kind it uses that the manifest does not name: extra, refused
    fewer = attrs.evolve(m, submodels=tuple(s for s in m.submodels
                                            if s.exact_name != "tiny_bk_decode_b8"))
    assert "unexpected decode model 'tiny_bk_decode_b8'" in _resolve_error(fewer, models)


@pytest.mark.parametrize("driver", ["sim", "calrt"])
def test_a_missing_bucket_refuses_ready_with_nothing_configured(driver: str) -> None:
    from calfsm.drivers import driver_class
    from calfsm.executor import DeviceExecutor, ExecutorConfig

    m = builtin_manifest("tiny-buckets")
    calbin = Calbin(tuple(x for x in Calbin.from_manifest(m).models
                          if x.name != "tiny_bk_decode_b16"))
    cls = driver_class(driver)
    drv = getattr(cls, "virtual", cls)(manifest_or_calbin=m)
    configured: list = []
    real_configure = drv.configure
    drv.configure = lambda c: configured.append(c) or real_configure(c)
    try:
        with pytest.raises(ManifestError, match="missing on device: 'tiny_bk_decode_b16'"):
            DeviceExecutor(drv, m, ExecutorConfig(threaded=False), calbin=calbin)
        assert configured == []
    finally:
        drv.close()
