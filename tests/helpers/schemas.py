"""Generated constraints for the constrained-decoding tests and benchmark: JSON schemas
of varied features, regexes and choices, each from a seed (deterministic).

Every generated language is *bounded*: strings carry a ``maxLength`` or a bounded
pattern, arrays a ``maxItems``, numbers bounds, objects ``additionalProperties: false``,
so under adversarial logits (the simulated device's noise) every output can end within
the tests' ``max_tokens``: a run that ends ``length`` is a test that asked too little,
not a valid output the tests could check.
"""

from __future__ import annotations

import random
import string
from typing import Any

__all__ = ["FEATURES", "choices", "regexes", "schema", "schemas"]

#: the features the generator mixes, each at least once in every 20 schemas
FEATURES = ("object", "array", "enum", "pattern", "integer", "number", "anyOf", "$ref",
            "boolean", "const", "nullable")

_WORDS = ("alpha", "beta", "gamma", "delta", "red", "green", "blue", "north", "south",
          "yes", "no", "id", "name", "count", "tags", "items", "kind", "value", "score",
          "open", "closed", "x", "y", "z")


def _string(r: random.Random) -> dict[str, Any]:
    kind = r.randrange(4)
    if kind == 0:
        return {"type": "string", "maxLength": r.randint(1, 12)}
    if kind == 1:
        return {"type": "string", "minLength": 1, "maxLength": r.randint(2, 10)}
    if kind == 2:
        return {"type": "string", "pattern": r.choice(
            (r"^[a-z]{1,8}$", r"^[A-Z][a-z]{0,6}$", r"^\d{3}-\d{4}$", r"^(ab|cd){1,4}$",
             r"^[0-9a-f]{4,8}$", r"^v[0-9]\.[0-9]{1,2}$"))}
    return {"type": "string", "enum": r.sample(_WORDS, r.randint(1, 5))}


def _integer(r: random.Random) -> dict[str, Any]:
    lo = r.randint(-1000, 1000)
    return {"type": "integer", "minimum": lo, "maximum": lo + r.randint(0, 5000)}


def _number(r: random.Random) -> dict[str, Any]:
    lo = r.randint(-50, 50)
    return {"type": "number", "minimum": lo, "maximum": lo + r.randint(1, 100)}


def _leaf(r: random.Random) -> dict[str, Any]:
    k = r.randrange(7)
    if k == 0:
        return _string(r)
    if k == 1:
        return _integer(r)
    if k == 2:
        return _number(r)
    if k == 3:
        return {"type": "boolean"}
    if k == 4:
        return {"enum": r.sample([*_WORDS[:6], 1, 2, 3, True, None], r.randint(1, 4))}
    if k == 5:
        return {"const": r.choice(("fixed", 7, False))}
    return {"type": ["string", "null"], "maxLength": r.randint(1, 6)}


def _node(r: random.Random, depth: int, refs: list[str]) -> dict[str, Any]:
    k = r.randrange(10 if depth < 2 else 6)
    if k < 4:
        return _leaf(r)
    if k == 4 and refs:
        return {"$ref": f"#/$defs/{r.choice(refs)}"}
    if k == 5:
        return {"anyOf": [_leaf(r), _leaf(r)]}
    if k < 8:
        lo = r.randint(0, 2)
        return {"type": "array", "items": _node(r, depth + 1, refs),
                "minItems": lo, "maxItems": lo + r.randint(0, 3)}
    return _object(r, depth + 1, refs)


def _object(r: random.Random, depth: int, refs: list[str]) -> dict[str, Any]:
    names = r.sample(_WORDS, r.randint(1, 4))
    props = {n: _node(r, depth, refs) for n in names}
    required = [n for n in names if r.random() < 0.7]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


def schema(seed: int) -> dict[str, Any]:
    """One JSON schema: an object with $defs (referenced at random), nested objects,
    bounded arrays, enums, patterns, numeric bounds, anyOf."""
    r = random.Random(seed)
    defs = {f"d{i}": _object(r, 2, []) if r.random() < 0.5 else _leaf(r)
            for i in range(r.randint(0, 2))}
    top = _object(r, 0, list(defs))
    # every feature turns up: the seed's own one is forced in as a property
    forced = FEATURES[seed % len(FEATURES)]
    top["properties"]["f"] = _feature(r, forced, list(defs))
    top["required"].append("f")
    if defs:
        top["$defs"] = defs
    return top


def _feature(r: random.Random, name: str, refs: list[str]) -> dict[str, Any]:
    if name == "object":
        return _object(r, 1, refs)
    if name == "array":
        return {"type": "array", "items": _leaf(r), "minItems": 1, "maxItems": 3}
    if name == "enum":
        return {"enum": r.sample(_WORDS, 3)}
    if name == "pattern":
        return {"type": "string", "pattern": r"^[a-z]{2,6}[0-9]{1,3}$"}
    if name == "integer":
        return _integer(r)
    if name == "number":
        return _number(r)
    if name == "anyOf":
        return {"anyOf": [_integer(r), _string(r), {"type": "null"}]}
    if name == "$ref":
        return {"$ref": f"#/$defs/{refs[0]}"} if refs else {"type": "boolean"}
    if name == "boolean":
        return {"type": "boolean"}
    if name == "const":
        return {"const": "fixed"}
    return {"type": ["integer", "null"], "minimum": 0, "maximum": 9}


def schemas(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [schema(i) for i in range(start, start + n)]


def regexes(n: int = 50) -> list[str]:
    """``n`` regexes: fixed ones first, then generated classes, counts and alternations
    (bounded, each in the common subset of Python's ``re`` and Rust's ``regex``)."""
    fixed = [r"[a-z]{3,8}", r"\d{1,4}", r"(yes|no|maybe)", r"[A-Z][a-z]{1,5} [A-Z][a-z]{1,5}",
             r"\d{4}-\d{2}-\d{2}", r"[0-9a-f]{8}", r"(ab|cd){1,3}e?", r"v\d\.\d{1,2}\.\d",
             r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)",
             r"-?\d{1,3}\.\d{2}", r"(true|false)", r"#[0-9A-F]{6}", r"[ACGT]{5,10}",
             r"\((\d{3})\) \d{3}-\d{4}", r"(0|[1-9]\d{0,3})"]
    out = list(fixed)
    r = random.Random(50)
    classes = ("[a-z]", "[A-Z]", r"\d", "[0-9a-f]", "[xyz]", "[a-c0-2]", "[.,;]")
    while len(out) < n:
        parts = []
        for _ in range(r.randint(1, 4)):
            k = r.randrange(3)
            if k == 0:
                lo = r.randint(0, 3)
                parts.append(f"{r.choice(classes)}{{{lo},{lo + r.randint(1, 4)}}}")
            elif k == 1:
                parts.append("(" + "|".join(r.sample(_WORDS, r.randint(2, 4))) + ")")
            else:
                parts.append(r.choice(string.ascii_lowercase + "-_:"))
        out.append("".join(parts))
    return out[:n]


def choices(n: int = 20) -> list[tuple[str, ...]]:
    """``n`` choices of strings: words, phrases, prefixes of each other, punctuation,
    quotes, non-ASCII."""
    r = random.Random(20)
    fixed = [("yes", "no"), ("a", "ab", "abc"), ("positive", "negative", "neutral"),
             ('say "hi"', "back\\slash", "new\nline"), ("été", "日本語", "naïve"),
             ("1", "10", "100", "1000")]
    out = list(fixed)
    while len(out) < n:
        out.append(tuple(dict.fromkeys(
            " ".join(r.sample(_WORDS, r.randint(1, 3))) for _ in range(r.randint(2, 6)))))
    return out[:n]
