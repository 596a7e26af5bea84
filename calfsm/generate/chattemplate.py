"""The model's own chat template: a tokenizer's ``chat_template``, rendered as Hugging Face
``transformers`` renders it.

A chat template is a Jinja2 template shipped with the tokenizer (``chat_template`` in
``tokenizer_config.json``, or a ``chat_template.jinja`` beside it, which takes priority).
It is code from whoever published the model, so it runs in Jinja2's
``ImmutableSandboxedEnvironment``, set up as ``transformers`` sets it up
(``transformers.utils.chat_template_utils._compile_jinja_template``), so that a template
renders here exactly as ``tokenizer.apply_chat_template(..., tokenize=False)`` renders it:

- ``trim_blocks`` and ``lstrip_blocks``; the ``loopcontrols`` extension (``break``,
  ``continue``); ``{% generation %}...{% endgeneration %}`` accepted (the body is rendered
  as is: the assistant mask it marks is for training);
- ``raise_exception(message)``, ``strftime_now(format)`` (the local time now), a
  ``tojson`` filter that does not escape HTML (``ensure_ascii``, ``indent``,
  ``separators``, ``sort_keys``), ``dict(...)`` and a ``namespace`` that refuses
  underscore names;
- the variables ``messages`` (each message a dict; keys whose value is None dropped),
  ``tools`` (a list of JSON schemas, or None), ``documents``, ``add_generation_prompt``,
  the tokenizer's named special tokens (``bos_token``, ``eos_token``, ``unk_token``,
  ``sep_token``, ``pad_token``, ``cls_token``, ``mask_token``: those the configuration
  names), then any extra variables the caller gives (they override the special tokens).

A tokenizer configuration may hold several named templates (a list of ``{"name",
"template"}``): the one named ``tool_use`` is used when tools are given and it exists,
else ``default``, as ``transformers`` chooses.

Errors: a template that does not compile is an
:class:`~calfsm.errors.InvalidArgument` at load (stage ``config``); one that refuses the
messages (``raise_exception``, a missing key, a sandbox violation, any error while
rendering) is an InvalidArgument of the request (stage ``request``): the server answers
400, never 500. Jinja2 is an optional dependency (the ``hf`` extra): without it, loading a
template is :class:`~calfsm.errors.Unsupported`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from calfsm.errors import InvalidArgument, Unsupported

__all__ = ["CHAT_TEMPLATE_FILE", "SPECIAL_TOKEN_NAMES", "TOKENIZER_CONFIG_FILE",
           "ChatTemplate", "load_chat_template", "special_tokens_of", "tokenizer_config"]

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
#: the template saved on its own, beside the configuration (it wins over the config's)
CHAT_TEMPLATE_FILE = "chat_template.jinja"
#: the named special tokens ``transformers`` gives a template (``special_tokens_map``)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
#: a rendered prompt longer than this is refused: a template is not to fill the memory
MAX_RENDERED_CHARS = 16 << 20


def _jinja() -> Any:
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError as e:
        raise Unsupported(f"a chat template needs the jinja2 package (pip install "
                          f"\"calfsm[hf]\"): {e}", stage="config") from None
    return jinja2


def _environment() -> Any:
    """The sandbox, as ``transformers`` builds it (one per template: it is immutable)."""
    jinja2 = _jinja()

    class Generation(jinja2.ext.Extension):         # type: ignore[misc,name-defined]
        """``{% generation %}...{% endgeneration %}``: the body, as is."""

        tags = frozenset({"generation"})

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body) \
                .set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: Any) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class TemplateDict:
        """``dict(...)`` without the class behind it."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class Namespace(jinja2.utils.Namespace):        # type: ignore[misc,name-defined]
        """``namespace(...)`` that refuses underscore names (no way to CPython's inside)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            for name in dict(*args, **kwargs):
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, *args, **kwargs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template may not store {name!r} on a namespace")

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = Namespace
    return env


def _plain(value: Any) -> Any:
    """What a template may see: JSON's types only (no object whose methods the sandbox
    does not know), as ``transformers`` rebuilds its inputs."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _token_text(value: Any) -> str | None:
    """A special token as the configuration gives it: a string, or an AddedToken's dict
    (``{"content": ...}``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def special_tokens_of(config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens a tokenizer configuration gives (those it names)."""
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        text = _token_text(config.get(name))
        if text is not None:
            out[name] = text
    return out


class ChatTemplate:
    """A compiled chat template (see the module docstring): ``render(messages, ...)``
    gives the prompt's text. ``source`` is the template's text, or a mapping of named
    templates (``default``, ``tool_use``, ...); ``special_tokens`` the tokenizer's named
    special tokens (:func:`special_tokens_of`). Compiling is checked here: a template
    that does not compile is an InvalidArgument naming ``origin``."""

    def __init__(self, source: str | Mapping[str, str], *,
                 special_tokens: Mapping[str, str] | None = None,
                 origin: str = "the chat template") -> None:
        named = {"default": source} if isinstance(source, str) else dict(source)
        if not named or not all(isinstance(k, str) and isinstance(v, str)
                                for k, v in named.items()):
            raise InvalidArgument(f"{origin}: a chat template is a string, or named "
                                  f"templates as strings", stage="config")
        jinja2 = _jinja()
        self.origin = origin
        self.sources: dict[str, str] = named
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self._compiled: dict[str, Any] = {}
        for name, text in named.items():
            try:
                self._compiled[name] = _environment().from_string(text)
            except jinja2.exceptions.TemplateError as e:
                where = f" (template {name!r})" if len(named) > 1 else ""
                line = getattr(e, "lineno", None)
                raise InvalidArgument(f"{origin}{where} does not compile"
                                      f"{f' (line {line})' if line else ''}: {e}",
                                      stage="config") from None

    @classmethod
    def from_file(cls, path: str | Path, *, special_tokens: Mapping[str, str] | None = None
                  ) -> ChatTemplate:
        """The template in the file at ``path`` (``--chat-template FILE``): its text."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidArgument(f"cannot read a chat template from {str(path)!r}: {e}",
                                  stage="config") from None
        return cls(text, special_tokens=special_tokens, origin=f"the chat template {path}")

    def select(self, tools: Any) -> str:
        """The name of the template used for a chat with ``tools`` (None: without)."""
        if len(self.sources) == 1:
            return next(iter(self.sources))
        if tools is not None and "tool_use" in self.sources:
            return "tool_use"
        if "default" in self.sources:
            return "default"
        raise InvalidArgument(f"{self.origin} has several templates "
                              f"({', '.join(sorted(self.sources))}) and none is 'default'",
                              stage="request")

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, **variables: Any) -> str:
        """The prompt's text for ``messages`` (each a dict with a ``role``), as
        ``apply_chat_template(messages, tools=..., documents=...,
        add_generation_prompt=..., tokenize=False, **variables)`` renders it. A template
        that refuses them is an InvalidArgument of the request."""
        jinja2 = _jinja()
        chat = []
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise InvalidArgument(f"messages[{i}] must be an object", stage="request")
            chat.append({k: v for k, v in _plain(m).items() if v is not None})
        name = self.select(tools)
        context = {**self.special_tokens, **variables}
        try:
            text = self._compiled[name].render(
                messages=chat, tools=_plain(None if tools is None else list(tools)),
                documents=_plain(None if documents is None else list(documents)),
                add_generation_prompt=bool(add_generation_prompt), **_plain(context))
        except jinja2.exceptions.TemplateError as e:
            raise InvalidArgument(f"{self.origin} refused the messages: "
                                  f"{type(e).__name__}: {e}", stage="request") from None
        except (RecursionError, MemoryError):
            raise InvalidArgument(f"{self.origin} refused the messages: it ran out of "
                                  f"room rendering them", stage="request") from None
        except Exception as e:          # the template's own error on these inputs
            raise InvalidArgument(f"{self.origin} failed on the messages: "
                                  f"{type(e).__name__}: {e}", stage="request") from None
        if len(text) > MAX_RENDERED_CHARS:
            raise InvalidArgument(f"{self.origin} rendered {len(text)} characters, more "
                                  f"than {MAX_RENDERED_CHARS}", stage="request")
        return text

    def __repr__(self) -> str:
        return f"<ChatTemplate {self.origin} {sorted(self.sources)}>"


def _named_templates(value: Any, origin: str) -> str | dict[str, str] | None:
    """A configuration's ``chat_template``: a string, or a list of ``{name, template}``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, Mapping) and isinstance(
            t.get("name"), str) and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise InvalidArgument(f"{origin}: chat_template must be a string or a list of "
                          f"{{'name', 'template'}}", stage="config")


def tokenizer_config(directory: str | Path) -> dict[str, Any]:
    """A saved tokenizer's configuration: ``tokenizer_config.json`` over
    ``special_tokens_map.json`` (either may be missing: {})."""
    root = Path(directory)
    config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", TOKENIZER_CONFIG_FILE):
        path = root / name
        if path.is_file():
            try:
                loaded = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise InvalidArgument(f"cannot read {path}: {e}", stage="config") from None
            if not isinstance(loaded, dict):
                raise InvalidArgument(f"{path} is not a JSON object", stage="config")
            config.update(loaded)
    return config


def load_chat_template(directory: str | Path, *, config: Mapping[str, Any] | None = None
                       ) -> ChatTemplate | None:
    """The chat template of the tokenizer saved in ``directory`` (None: it has none):
    ``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` if there, else
    ``tokenizer_config.json``'s ``chat_template``; its special tokens from
    ``tokenizer_config.json`` (and ``special_tokens_map.json``, which it overrides), as
    ``transformers``' ``from_pretrained`` reads them. Read locally, never fetched.
    ``config``: that configuration when the caller has read it already
    (:func:`tokenizer_config`), so it is not read twice."""
    root = Path(directory)
    if config is None:
        config = tokenizer_config(root)
    source: str | dict[str, str] | None
    files: dict[str, str] = {}
    try:
        if (root / CHAT_TEMPLATE_FILE).is_file():
            files["default"] = (root / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        extra = root / "additional_chat_templates"
        if extra.is_dir():
            for f in sorted(extra.glob("*.jinja")):
                files[f.stem] = f.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"cannot read the chat template in {root}: {e}",
                              stage="config") from None
    origin = f"the chat template of {root}"
    if files:
        source = files["default"] if list(files) == ["default"] else files
    else:
        source = _named_templates(config.get("chat_template"), f"{root / TOKENIZER_CONFIG_FILE}")
    if source is None:
        return None
    return ChatTemplate(source, special_tokens=special_tokens_of(config), origin=origin)
