"""The model manifest: what calfsm expects the calbin on the device to contain.

A manifest is the contract between an artifact (a calbin compiled for the NPU) and the
executor (spec section 4.1). It names every sub-model *exactly* (never by substring,
defect S08), gives each tensor's shape, dtype and byte size, the CSR names that carry
the sequence lengths, and layout metadata such as the prefill output tile height
``logits_tile_d0`` (which must come from the graph's metadata: there is no code default,
defect S09).

Loading goes through one project-owned cattrs converter that forbids unknown keys; every
failure, structural or semantic, is a :class:`~calfsm.errors.ManifestError` whose message
names the field path (``submodels[1].logits.byte_size``) and the offending value.
Beyond form, :meth:`Manifest.validate` checks meaning, so a manifest that could never
serve fails at load, not at warm-up: the required kinds (:data:`REQUIRED_KINDS`), one
vocabulary across the logit-producing sub-models, BF16 logits of the promised tile,
distinct tensor and CSR names within a sub-model, integer ids and positions wide enough
for the vocabulary and ``max_seq``, one position per token, a 64-hex ``calbin_sha256``.

:meth:`Manifest.resolve` checks the manifest against the models a device lists and
reports every difference in one error, so an operator fixes them all in one round.
"""

from __future__ import annotations

import enum
import functools
import json
import math
import re
import reprlib
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from calfsm.errors import Incompatible, InvalidArgument, ManifestError
from calfsm.util.boundedio import MAX_DEPTH, check_depth, load_json, read_or_raise

if TYPE_CHECKING:
    import cattrs

__all__ = [
    "MAX_FILE_BYTES",
    "REQUIRED_KINDS",
    "DType",
    "GraphKey",
    "Manifest",
    "ModelGeneration",
    "ModelInfo",
    "StepTiming",
    "SubmodelContract",
    "TaskKind",
    "TensorContract",
    "TensorInfo",
    "builtin_manifest",
    "builtin_manifest_names",
]


class TaskKind(enum.StrEnum):
    """The kinds of sub-model a calbin may hold (spec ``CalTaskKind``)."""

    PREFILL_IDS = "prefill_ids"
    PREFILL_EMBEDS = "prefill_embeds"
    DECODE = "decode"
    VISION = "vision"

    @property
    def is_prefill(self) -> bool:
        return self in (TaskKind.PREFILL_IDS, TaskKind.PREFILL_EMBEDS)


#: the kinds every manifest must hold: the warm-up golden runs a prefill_ids and a decode
REQUIRED_KINDS = (TaskKind.PREFILL_IDS, TaskKind.DECODE)
#: the kinds that take tokens (or embeddings) and yield BF16 logits over one vocabulary
_LOGITS_KINDS = frozenset({TaskKind.PREFILL_IDS, TaskKind.PREFILL_EMBEDS, TaskKind.DECODE})
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: the largest manifest file read (the built-in ones are ~4 KiB)
MAX_FILE_BYTES = 4 << 20
#: a graph's key within a manifest: ``(kind, max_batch, max_seq)`` (shape buckets: several
#: graphs of one kind, each looked up by its exact key, spec 10.2)
GraphKey = tuple[TaskKind, int, int]


class DType(enum.StrEnum):
    """CalRT primitive types the manifests use, with their byte sizes."""

    S32 = "S32"
    U32 = "U32"
    S16 = "S16"
    U16 = "U16"
    S8 = "S8"
    U8 = "U8"
    F32 = "F32"
    F16 = "F16"
    BF16 = "BF16"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def host_dtype(self) -> str:
        """The numpy dtype of a host backing array (BF16 is kept as raw uint16 bits)."""
        return _HOST_DTYPE[self]


_ITEMSIZE = {DType.S32: 4, DType.U32: 4, DType.S16: 2, DType.U16: 2, DType.S8: 1,
             DType.U8: 1, DType.F32: 4, DType.F16: 2, DType.BF16: 2}
_HOST_DTYPE = {DType.S32: "<i4", DType.U32: "<u4", DType.S16: "<i2", DType.U16: "<u2",
               DType.S8: "i1", DType.U8: "u1", DType.F32: "<f4", DType.F16: "<f2",
               DType.BF16: "<u2"}
_INT_MAX = {DType.S32: 2**31 - 1, DType.U32: 2**32 - 1, DType.S16: 2**15 - 1,
            DType.U16: 2**16 - 1, DType.S8: 2**7 - 1, DType.U8: 2**8 - 1}


@attrs.frozen
class TensorContract:
    """One tensor of a sub-model as the manifest promises it."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    byte_size: int
    sliceable: bool = False

    @property
    def element_count(self) -> int:
        return math.prod(self.shape)


@attrs.frozen
class SubmodelContract:
    """One compiled graph of the calbin (spec ``SubmodelContract``).

    For prefill kinds the ``logits`` tensor is the physical output tile
    ``[B, logits_tile_d0, vocab]``; for decode it is ``[B, 1, vocab]``, where ``B`` is
    ``max_batch`` (1 for today's calbin). Every tensor's first dimension is ``B``: row
    ``r`` of a batch job is ``[r, ...]`` of each (``docs/driver-protocol.md``, Batches).
    """

    kind: TaskKind
    exact_name: str
    token_or_embed: TensorContract
    position: TensorContract
    logits: TensorContract
    csr_cur_seq: str
    csr_total_seq: str
    max_batch: int
    max_seq: int
    logits_tile_d0: int | None = None
    # derived once (the contract is frozen): read on every step's way, so attributes,
    # not properties (issue 35, item 4)
    #: the logits' last dimension
    vocab: int = attrs.field(init=False, eq=False, repr=False)
    #: whether one job of this graph can carry more than one sequence (row)
    batched: bool = attrs.field(init=False, eq=False, repr=False)
    #: most tokens one job of this graph can carry (elements of the token tensor)
    max_tokens: int = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        # a malformed shape (empty, too short) is the loader's to name, with its path
        # (ManifestError): derive 0 from it here rather than fail first with an IndexError
        shape, logits = self.token_or_embed.shape, self.logits.shape
        axis = 2 if self.kind is TaskKind.PREFILL_EMBEDS else 1
        object.__setattr__(self, "vocab", logits[-1] if logits else 0)
        object.__setattr__(self, "batched", self.max_batch > 1)
        object.__setattr__(self, "max_tokens", shape[-axis] if len(shape) >= axis else 0)

    @property
    def rows(self) -> int:
        """Rows of the physical logits tensor (``tile_d0`` for prefill, 1 for decode)."""
        return self.logits_tile_d0 if self.kind.is_prefill else 1

    @property
    def key(self) -> GraphKey:
        """``(kind, max_batch, max_seq)``: what names this graph among a kind's buckets."""
        return (self.kind, self.max_batch, self.max_seq)

    @property
    def label(self) -> str:
        """``decode b8 s8192``: the key in words, for notes, metrics and evidence."""
        return f"{self.kind.value} b{self.max_batch} s{self.max_seq}"

    def covers(self, other: SubmodelContract) -> bool:
        """Whether this graph takes every step ``other`` takes (as many rows, as long)."""
        return self.max_batch >= other.max_batch and self.max_seq >= other.max_seq


@attrs.frozen
class TensorInfo:
    """A tensor as a device reports it (``GetAllModels`` metadata)."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    byte_size: int


@attrs.frozen
class ModelInfo:
    """A sub-model as a device reports it, with its layout metadata.

    ``kind`` is the task type tag of the compiled graph (``None`` if the graph has none);
    ``tile_d0`` the output tile height from the graph's layout metadata.
    """

    name: str
    kind: TaskKind | None
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    csr_names: tuple[str, ...]
    tile_d0: int | None = None

    def tensor(self, name: str) -> TensorInfo | None:
        for t in self.inputs + self.outputs:
            if t.name == name:
                return t
        return None


@attrs.frozen
class ModelGeneration:
    """A configured model: the manifest bound to a generation number.

    The generation counter fences everything created for it (buffers, KV reservations,
    completions): when a reset bumps it, old objects can no longer touch new state.
    """

    generation_id: int
    calbin_sha256: str
    calrt_version: str
    submodels: Mapping[TaskKind, SubmodelContract]
    device_models: Mapping[TaskKind, ModelInfo] = attrs.field(factory=dict)
    #: every graph by its key (shape buckets); ``submodels`` holds each kind's widest
    graphs: Mapping[GraphKey, SubmodelContract] = attrs.field(factory=dict)

    def submodel(self, kind: TaskKind) -> SubmodelContract:
        try:
            return self.submodels[kind]
        except KeyError:
            from calfsm.errors import Unsupported
            raise Unsupported(f"the model of generation {self.generation_id} has no "
                              f"{kind.value} sub-model", generation=self.generation_id,
                              stage="lookup") from None


@attrs.frozen
class StepTiming:
    """What the vendor expects a step to take on the device: one decode step, and each
    prefilled token on top of that. The executor sizes its hang detection (the execution
    timeout) and its first admission estimates from it (:mod:`calfsm.engine.stepcost`)."""

    decode_ms: float
    prefill_token_us: float


@attrs.frozen
class Manifest:
    """The contents of a manifest file."""

    calbin_sha256: str
    calrt_version: str
    submodels: tuple[SubmodelContract, ...]
    name: str = ""
    #: the vendor's expected step times (optional; without them the executor assumes
    #: slow ones, :data:`calfsm.engine.stepcost.DEFAULT_TIMING`)
    timing: StepTiming | None = None

    # ---- loading -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Any) -> Manifest:
        """Build and validate a manifest from plain data (parsed JSON or TOML)."""
        if not isinstance(data, Mapping):
            raise ManifestError(f"manifest must be a mapping, got {type(data).__name__}",
                                stage="manifest")
        submodels = data.get("submodels")
        if submodels is not None and not isinstance(submodels, list | tuple):
            # cattrs would iterate a string's characters or a table's keys instead
            raise ManifestError(f"submodels: expected a list of sub-models, got "
                                f"{reprlib.repr(submodels)}", stage="manifest")
        conv = _converter()
        from cattrs.errors import (
            ClassValidationError,
            ForbiddenExtraKeysError,
            IterableValidationError,
        )
        try:
            manifest = conv.structure(data, cls)
        except (ClassValidationError, IterableValidationError, ForbiddenExtraKeysError) as e:
            raise ManifestError("; ".join(_paths(e)), stage="manifest") from None
        except (ValueError, TypeError, KeyError) as e:
            raise ManifestError(f"invalid manifest: {e!r}", stage="manifest") from None
        manifest.validate()
        return manifest

    @classmethod
    def load(cls, path: str | Path) -> Manifest:
        """Read a ``.json`` or ``.toml`` manifest file: a regular file of at most
        :data:`MAX_FILE_BYTES`, nested at most :data:`~calfsm.util.boundedio.MAX_DEPTH` deep
        (anything else, a FIFO included, is a :class:`ManifestError` at once)."""
        path = Path(path)
        raw = read_or_raise(path, max_bytes=MAX_FILE_BYTES, error=lambda why: ManifestError(
            f"cannot read manifest {str(path)!r}: {why}", stage="manifest"))
        try:
            if path.suffix == ".toml":
                import tomllib
                data = check_depth(tomllib.loads(raw.decode("utf-8")))
            else:
                data = load_json(raw)
        except RecursionError:      # tomllib recurses once per level of nesting
            raise ManifestError(f"{str(path)!r} does not parse: nested deeper than the "
                                f"{MAX_DEPTH} allowed", stage="manifest") from None
        except ValueError as e:     # UnicodeDecodeError and UnreadableFile included
            raise ManifestError(f"{str(path)!r} does not parse: {e}", stage="manifest") from None
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return _converter().unstructure(self)

    # ---- validation ----------------------------------------------------------------
    def validate(self) -> None:
        """Check the manifest against itself, by form and by meaning; raise one
        :class:`ManifestError` listing every problem, each under its field path."""
        problems: list[str] = []
        if not _SHA256.fullmatch(self.calbin_sha256):
            problems.append(f"calbin_sha256: must be 64 lowercase hex digits, got "
                            f"{reprlib.repr(self.calbin_sha256)}")
        if not self.calrt_version:
            problems.append("calrt_version: empty")
        if not self.submodels:
            problems.append("submodels: empty")
        names = Counter(s.exact_name for s in self.submodels)
        for i, sub in enumerate(self.submodels):
            at = f"submodels[{i}]"
            if names[sub.exact_name] > 1:
                problems.append(f"{at}.exact_name: {sub.exact_name!r} is not unique")
            problems.extend(_submodel_problems(at, sub))
        kinds = Counter(s.kind for s in self.submodels)
        keys = Counter(s.key for s in self.submodels)
        for (kind, batch, seq), n in keys.items():
            if n > 1:
                problems.append(f"submodels: {n} sub-models keyed ({kind.value}, max_batch "
                                f"{batch}, max_seq {seq}); a key names one graph")
        problems.extend(self._bucket_problems())
        for kind in REQUIRED_KINDS:
            if self.submodels and kind not in kinds:
                problems.append(f"submodels: no {kind.value} sub-model (required: "
                                f"{', '.join(k.value for k in REQUIRED_KINDS)}; the "
                                "warm-up golden runs both)")
        problems.extend(self._vocabulary_problems())
        problems.extend(self._context_problems())
        if self.timing is not None:
            for field in ("decode_ms", "prefill_token_us"):
                value = getattr(self.timing, field)
                if not (math.isfinite(value) and value > 0):
                    problems.append(f"timing.{field}: must be a finite number > 0, got "
                                    f"{value!r}")
        if problems:
            raise ManifestError("invalid manifest: " + "; ".join(problems), stage="manifest")

    def _bucket_problems(self) -> list[str]:
        """Several graphs of one kind (shape buckets): the widest must cover every other
        (as many rows, as long a context), so any step has a graph to run on."""
        problems = []
        for kind in self.kinds:
            graphs = [(i, s) for i, s in enumerate(self.submodels) if s.kind is kind]
            if len(graphs) < 2:
                continue
            i, widest = max(graphs, key=lambda g: (g[1].max_batch, g[1].max_seq))
            for j, other in graphs:
                if not widest.covers(other):
                    problems.append(f"submodels[{j}]: {other.label} is not covered by the "
                                    f"widest {kind.value} graph (submodels[{i}], "
                                    f"{widest.label}): one graph of a kind must take every "
                                    "step the others take")
        return problems

    def _vocabulary_problems(self) -> list[str]:
        """Every sub-model that yields logits must share the decode sub-model's vocabulary
        (a prefill's greedy token is fed to decode)."""
        lm = [(i, s) for i, s in enumerate(self.submodels)
              if s.kind in _LOGITS_KINDS and s.logits.shape]
        ref = next(((i, s) for i, s in lm if s.kind is TaskKind.DECODE), lm[0] if lm else None)
        if ref is None:
            return []
        j, want = ref
        return [f"submodels[{i}].logits.shape: vocabulary {s.vocab} != "
                f"{want.vocab} of the {want.kind.value} sub-model (submodels[{j}])"
                for i, s in lm if s.vocab != want.vocab]

    def _context_problems(self) -> list[str]:
        """The decode sub-model must reach as far as every prefill: a sequence prefilled
        to a prefill's ``max_seq`` is decoded next, by the decode graph."""
        decodes = [(i, s) for i, s in enumerate(self.submodels) if s.kind is TaskKind.DECODE]
        if not decodes:
            return []               # reported above
        j, decode = max(decodes, key=lambda d: (d[1].max_seq, d[1].max_batch))
        if decode.max_seq <= 0:
            return []               # reported above
        return [f"submodels[{j}].max_seq: {decode.max_seq} is below the max_seq "
                f"{s.max_seq} of the {s.kind.value} sub-model (submodels[{i}]): a sequence "
                "it prefills could not be decoded"
                for i, s in enumerate(self.submodels)
                if s.kind.is_prefill and s.max_seq > decode.max_seq]

    def check_runtime(self, runtime_version: str) -> None:
        """Refuse to run this manifest's calbin on a device running CalRT
        ``runtime_version`` unless it is the ``calrt_version`` the calbin is built for:
        :class:`~calfsm.errors.Incompatible` (category compatibility: an operator must
        bring the calbin and the runtime together; no retry or reset helps)."""
        if self.calrt_version != runtime_version:
            raise Incompatible(f"calrt_version: the manifest's calbin is built for CalRT "
                               f"{self.calrt_version}, the device runs CalRT "
                               f"{runtime_version}", stage="manifest")

    def submodel(self, kind: TaskKind) -> SubmodelContract:
        """The graph of ``kind`` that takes every step: the only one, or the widest of its
        shape buckets (:meth:`graphs`)."""
        graphs = self.graphs(kind)
        if graphs:
            return graphs[-1]
        from calfsm.errors import Unsupported
        raise Unsupported(f"manifest {self.name or self.calbin_sha256[:12]!r} has no "
                          f"{kind.value} sub-model", stage="lookup")

    def graphs(self, kind: TaskKind) -> tuple[SubmodelContract, ...]:
        """Every graph of ``kind``, narrowest first (by ``max_batch``, then ``max_seq``):
        one on a manifest without shape buckets."""
        return tuple(sorted((s for s in self.submodels if s.kind is kind),
                            key=lambda s: (s.max_batch, s.max_seq)))

    @property
    def bucketed(self) -> bool:
        """Whether some kind has several graphs (shape buckets)."""
        return len({s.key for s in self.submodels}) > len(set(self.kinds))

    @property
    def kinds(self) -> tuple[TaskKind, ...]:
        """The kinds this manifest holds, each once, in the order they first appear."""
        return tuple(dict.fromkeys(s.kind for s in self.submodels))

    # ---- against a device ----------------------------------------------------------
    def resolve(self, device_models: Iterable[ModelInfo]) -> dict[TaskKind, ModelInfo]:
        """Match each sub-model to exactly one device model by exact name.

        Reports, in one :class:`ManifestError`: names missing on the device, names listed
        more than once, device models of a kind this manifest uses but with another name
        (the "unexpected" side of a typo), and every tensor, dtype, shape, byte size, CSR
        or tile difference. Never a substring match.
        """
        listed = list(device_models)
        by_name: dict[str, list[ModelInfo]] = {}
        for m in listed:
            by_name.setdefault(m.name, []).append(m)
        problems: list[str] = []
        resolved: dict[TaskKind, ModelInfo] = {}
        wanted = {s.exact_name for s in self.submodels}
        for i, sub in enumerate(self.submodels):
            at = f"submodels[{i}]"
            found = by_name.get(sub.exact_name, [])
            if not found:
                problems.append(f"{at}: missing on device: {sub.exact_name!r}")
                continue
            if len(found) > 1:
                problems.append(f"{at}: {sub.exact_name!r} listed {len(found)} times by device")
                continue
            dev = found[0]
            problems.extend(_model_problems(at, sub, dev))
            if sub is self.submodel(sub.kind):
                resolved[sub.kind] = dev
        kinds = set(self.kinds)
        missing = any(not by_name.get(s.exact_name) for s in self.submodels)
        for m in listed:
            if m.name in wanted:
                continue
            if m.kind in kinds:
                problems.append(f"device: unexpected {m.kind.value} model {m.name!r}")
            elif m.kind is None and missing:
                # an untagged graph cannot be classified, but beside a missing name it is
                # the likely other half of a typo: show it
                problems.append(f"device: unexpected untagged model {m.name!r}")
        if problems:
            raise ManifestError("manifest does not match device: " + "; ".join(problems),
                                stage="resolve")
        return resolved

    def generation(self, generation_id: int,
                   device_models: Mapping[TaskKind, ModelInfo] | None = None
                   ) -> ModelGeneration:
        return ModelGeneration(generation_id, self.calbin_sha256, self.calrt_version,
                               {k: self.submodel(k) for k in self.kinds},
                               dict(device_models or {}),
                               {s.key: s for s in self.submodels})


def _submodel_problems(at: str, sub: SubmodelContract) -> list[str]:
    problems = []
    if not sub.exact_name:
        problems.append(f"{at}.exact_name: empty")
    for field in ("max_batch", "max_seq"):
        if getattr(sub, field) <= 0:
            problems.append(f"{at}.{field}: must be positive, got {getattr(sub, field)}")
    tensors = {f: getattr(sub, f) for f in ("token_or_embed", "position", "logits")}
    for field, t in tensors.items():
        problems.extend(_tensor_problems(f"{at}.{field}", t))
    first: dict[str, str] = {}
    for field, t in tensors.items():
        if t.name and first.setdefault(t.name, field) != field:
            problems.append(f"{at}.{field}.name: {t.name!r} is also "
                            f"{at}.{first[t.name]}.name")
    for field in ("csr_cur_seq", "csr_total_seq"):
        if not getattr(sub, field):
            problems.append(f"{at}.{field}: empty")
    if sub.csr_cur_seq and sub.csr_cur_seq == sub.csr_total_seq:
        problems.append(f"{at}.csr_total_seq: {sub.csr_total_seq!r} is also csr_cur_seq")
    if sub.kind in _LOGITS_KINDS:
        problems.extend(_language_problems(at, sub))
    problems.extend(_batch_problems(at, sub, tensors))
    return problems


def _batch_problems(at: str, sub: SubmodelContract,
                    tensors: Mapping[str, TensorContract]) -> list[str]:
    """Every tensor's first dimension is the batch (``max_batch`` rows); a batch graph's
    inputs are read row by row, so they cannot be sliced."""
    if sub.max_batch <= 0:
        return []               # reported above
    problems = []
    for field, t in tensors.items():
        if t.shape and t.shape[0] != sub.max_batch:
            problems.append(f"{at}.{field}.shape: {list(t.shape)} has batch dimension "
                            f"{t.shape[0]}, max_batch is {sub.max_batch}")
        elif sub.batched and len(t.shape) < 2:
            problems.append(f"{at}.{field}.shape: a batch graph's tensors are [batch, "
                            f"...], got {list(t.shape)}")
        if sub.batched and field != "logits" and t.sliceable:
            problems.append(f"{at}.{field}.sliceable: a batch graph's inputs are read "
                            "row by row and cannot be sliced")
    return problems


def _language_problems(at: str, sub: SubmodelContract) -> list[str]:
    """What a sub-model that takes tokens (or embeddings) and yields logits must hold."""
    problems = []
    tok, pos, logits = sub.token_or_embed, sub.position, sub.logits
    batch = max(sub.max_batch, 1)
    if logits.dtype is not DType.BF16:
        problems.append(f"{at}.logits.dtype: must be BF16 (the logits path converts "
                        f"BF16 rows), got {logits.dtype.value}")
    if sub.kind.is_prefill:
        d0 = sub.logits_tile_d0
        if d0 is None:
            problems.append(f"{at}.logits_tile_d0: required for {sub.kind.value} "
                            "(it comes from the graph metadata, never a default)")
        elif d0 <= 0:
            problems.append(f"{at}.logits_tile_d0: must be positive, got {d0}")
        elif len(logits.shape) >= 2 and logits.shape[-2] != d0:
            problems.append(f"{at}.logits.shape: {list(logits.shape)} has "
                            f"{logits.shape[-2]} rows, logits_tile_d0 is {d0}")
        elif logits.element_count != batch * d0 * sub.vocab:
            problems.append(f"{at}.logits.shape: prefill logits must be [{batch}, "
                            f"logits_tile_d0, vocab], got {list(logits.shape)}")
    elif logits.shape and logits.element_count != batch * sub.vocab:
        problems.append(f"{at}.logits.shape: decode logits must hold one row per batch "
                        f"row ({batch}), got {list(logits.shape)}")
    if not (tok.shape and pos.shape and logits.shape):
        return problems     # reported by _tensor_problems; nothing below can be judged
    embeds = sub.kind is TaskKind.PREFILL_EMBEDS
    if embeds and len(tok.shape) < 2:
        return [*problems, f"{at}.token_or_embed.shape: embeddings must be [..., tokens, "
                           f"hidden], got {list(tok.shape)}"]
    if not embeds:
        problems.extend(_integer_problems(f"{at}.token_or_embed.dtype", tok.dtype,
                                          sub.vocab - 1, "token ids"))
    problems.extend(_integer_problems(f"{at}.position.dtype", pos.dtype, sub.max_seq - 1,
                                      "positions"))
    if pos.element_count != batch * sub.max_tokens:
        problems.append(f"{at}.position.shape: {list(pos.shape)} holds "
                        f"{pos.element_count} positions, token_or_embed holds "
                        f"{batch * sub.max_tokens} tokens")
    return problems


def _integer_problems(at: str, dtype: DType, largest: int, what: str) -> list[str]:
    top = _INT_MAX.get(dtype)
    if top is None:
        return [f"{at}: {what} need an integer type, got {dtype.value}"]
    if largest > top:
        return [f"{at}: {dtype.value} cannot hold {what} up to {largest}"]
    return []


def _tensor_problems(at: str, t: TensorContract) -> list[str]:
    problems = []
    if not t.name:
        problems.append(f"{at}.name: empty")
    if not t.shape:
        problems.append(f"{at}.shape: empty")
    for j, d in enumerate(t.shape):
        if d <= 0:
            problems.append(f"{at}.shape[{j}]: must be positive, got {d}")
    if t.byte_size <= 0:
        problems.append(f"{at}.byte_size: must be positive, got {t.byte_size}")
    elif t.shape and all(d > 0 for d in t.shape):
        expected = t.element_count * t.dtype.itemsize
        if t.byte_size != expected:
            problems.append(f"{at}.byte_size: {t.byte_size} != shape {list(t.shape)} x "
                            f"{t.dtype.value} ({t.dtype.itemsize} B) = {expected}")
    return problems


def _model_problems(at: str, sub: SubmodelContract, dev: ModelInfo) -> list[str]:
    problems = []
    if dev.kind is not None and dev.kind is not sub.kind:
        problems.append(f"{at}.kind: manifest {sub.kind.value} != device {dev.kind.value} "
                        f"for {dev.name!r}")
    for field in ("token_or_embed", "position", "logits"):
        want: TensorContract = getattr(sub, field)
        got = dev.tensor(want.name)
        if got is None:
            problems.append(f"{at}.{field}: tensor {want.name!r} missing in device model "
                            f"{dev.name!r}")
            continue
        for attr in ("dtype", "shape", "byte_size"):
            w, g = getattr(want, attr), getattr(got, attr)
            if w != g:
                problems.append(f"{at}.{field}.{attr}: manifest {_show(w)} != device {_show(g)}")
    for field in ("csr_cur_seq", "csr_total_seq"):
        name = getattr(sub, field)
        if name not in dev.csr_names:
            problems.append(f"{at}.{field}: CSR {name!r} not offered by device model "
                            f"{dev.name!r}")
    if sub.kind.is_prefill and dev.tile_d0 != sub.logits_tile_d0:
        problems.append(f"{at}.logits_tile_d0: manifest {sub.logits_tile_d0} != device "
                        f"metadata {dev.tile_d0}")
    return problems


def _show(v: Any) -> str:
    if isinstance(v, enum.Enum):
        return str(v.value)
    if isinstance(v, tuple):
        return str(list(v))
    return repr(v)


@functools.cache
def _converter() -> cattrs.Converter:
    """The one converter, made at the first load: cattrs is imported then, not with
    calfsm (it is ~10 ms of ``import calfsm``)."""
    import cattrs
    from cattrs.gen import make_dict_structure_fn

    conv = cattrs.Converter(forbid_extra_keys=True)

    def strict_int(value: Any, _type: type) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"expected an integer, got {value!r}")
        return value

    def strict_str(value: Any, _type: type) -> str:
        if not isinstance(value, str):
            raise TypeError(f"expected a string, got {value!r}")
        return value

    def strict_float(value: Any, _type: type) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"expected a number, got {value!r}")
        return float(value)

    def strict_bool(value: Any, _type: type) -> bool:
        if not isinstance(value, bool):
            raise TypeError(f"expected true or false, got {value!r}")
        return value

    def shape(value: Any, _type: type) -> tuple[int, ...]:
        if not isinstance(value, list | tuple):
            raise TypeError(f"expected a list of integers, got {value!r}")
        return tuple(strict_int(v, int) for v in value)

    def enum_of(kind: type[enum.Enum]):
        def structure(value: Any, _type: type) -> Any:
            try:
                return kind(value)
            except ValueError:
                allowed = ", ".join(str(m.value) for m in kind)
                raise ValueError(f"unknown {kind.__name__} {value!r} (one of {allowed})") \
                    from None
        return structure

    def mapping_only(cls: type) -> Any:
        # Without this a non-table (``"logits": 5``) fails deep inside cattrs with a
        # message that names neither the expected table nor the value.
        fields = make_dict_structure_fn(cls, conv, _cattrs_forbid_extra_keys=True)

        def structure(value: Any, _type: type) -> Any:
            if not isinstance(value, Mapping):
                raise TypeError(f"expected a table of {cls.__name__} fields, got "
                                f"{reprlib.repr(value)}")
            return fields(value, _type)
        return structure

    conv.register_structure_hook_factory(attrs.has, mapping_only)
    conv.register_structure_hook(int, strict_int)
    conv.register_structure_hook(str, strict_str)
    conv.register_structure_hook(bool, strict_bool)
    conv.register_structure_hook(float, strict_float)
    conv.register_structure_hook_func(lambda t: t == tuple[int, ...], shape)
    conv.register_structure_hook(DType, enum_of(DType))
    conv.register_structure_hook(TaskKind, enum_of(TaskKind))
    conv.register_unstructure_hook_func(lambda t: t == tuple[int, ...], list)
    return conv


def _paths(exc: BaseException) -> list[str]:
    """cattrs' nested errors as ``submodels[1].logits.byte_size: <problem> (got <value>)``."""
    import cattrs
    out = []
    for line in cattrs.transform_error(exc, path="$", format_exception=_describe):
        msg, _, path = line.rpartition(" @ ")
        path = path.removeprefix("$").removeprefix(".")
        out.append(f"{path or '<root>'}: {msg}")
    return out


def _describe(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, KeyError):
        return "required field missing"
    from cattrs.errors import ForbiddenExtraKeysError
    if isinstance(exc, ForbiddenExtraKeysError):
        return f"unknown field(s) {sorted(exc.extra_fields)}"
    return str(exc)


_BUILTINS = {"qwen3-b1": "qwen3-b1.manifest.json", "tiny": "tiny.manifest.json",
             "qwen3-b8": "qwen3-b8.manifest.json", "tiny-b8": "tiny-b8.manifest.json",
             "qwen3-buckets": "qwen3-buckets.manifest.json",
             "tiny-buckets": "tiny-buckets.manifest.json"}


def builtin_manifest_names() -> tuple[str, ...]:
    """The names :func:`builtin_manifest` accepts."""
    return tuple(_BUILTINS)


def builtin_manifest(name: str = "qwen3-b1") -> Manifest:
    """A manifest shipped with calfsm: ``qwen3-b1`` (the current Qwen3 batch=1 calbin),
    ``tiny`` (same graph shapes, vocabulary 1024 and max_seq 8192, for fast tests), and
    their batch-8 forms ``qwen3-b8`` and ``tiny-b8`` (every graph ``max_batch=8``: the
    calbin a batch build would ship, for continuous batching), and ``qwen3-buckets`` and
    ``tiny-buckets`` (shape buckets: decode graphs at batch 1, 2, 4, 8, 16, 32 and 64 beside
    batch-1 prefills, docs/driver-protocol.md, Shape buckets)."""
    if name not in _BUILTINS:
        raise ManifestError(f"no built-in manifest {name!r} (have {sorted(_BUILTINS)})",
                            stage="manifest")
    # importlib.resources is imported here, not with calfsm (~8 ms of the import)
    from importlib import resources
    text = resources.files("calfsm.data").joinpath(_BUILTINS[name]).read_text("utf-8")
    return Manifest.from_dict(json.loads(text))


def manifest_from_option(spec: str, *, option: str | None = "--manifest",
                         stage: str = "cli") -> Manifest:
    """What a command line's ``--manifest NAME|PATH`` names: a built-in name always
    means the built-in manifest (even beside a file of that name); anything else is a
    manifest file. The one parser of that option for every command; ``option`` prefixes
    the error (None: the caller does)."""
    if spec in _BUILTINS:
        return builtin_manifest(spec)
    if not Path(spec).is_file():
        prefix = f"{option} {spec}: " if option else ""
        raise InvalidArgument(f"{prefix}not a built-in manifest ({', '.join(_BUILTINS)}) "
                              "and not a file", stage=stage)
    return Manifest.load(spec)

