"""Chat templates rendered with jinja exactly as transformers renders them.

transformers (`utils/chat_template_utils.py`) compiles a template in an
`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the `loopcontrols`
extension, a `tojson` filter that does not HTML-escape (`json.dumps(ensure_ascii=False)`), and the
globals `raise_exception`, `strftime_now`, `dict` and `namespace`. It renders with `messages`,
`tools`, `documents`, `add_generation_prompt` and the named special tokens (`bos_token`,
`eos_token`, ...). Message keys whose value is None are dropped first, and a message's reasoning is
mirrored under `reasoning_content` and `thinking`. We do the same, so the text is identical.
`{% generation %}` blocks (assistant-mask tracking) render their body unchanged.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rljax.errors import ConfigError, DataError

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationBlock(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` and renders the body as is."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja's `namespace`, refusing underscore names (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set {name!r} on a namespace"
            )


class _Dict:
    """The `dict` global: builds dicts, exposes nothing else."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def compile_template(template: str) -> jinja2.Template:
    """The compiled, sandboxed template (cached by its source text)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(
            f"chat template does not parse (line {e.lineno}: {e.message}); fix the template"
        ) from e


def _plain_message(message: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise DataError(f"chat messages must be dicts with 'role' and 'content', got {message!r}")
    msg = {k: v for k, v in message.items() if v is not None}
    reasoning = next((msg[k] for k in _REASONING_FIELDS if k in msg), None)
    if reasoning is not None:
        msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
    return msg


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str],
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """Render one conversation; template errors (`raise_exception`) become a one-line DataError."""
    if len(messages) == 0:
        raise DataError(
            "cannot apply a chat template to an empty conversation; pass at least one message"
        )
    chat = [_plain_message(m) for m in messages]
    variables = {**special_tokens, **kwargs}
    try:
        return compile_template(template).render(
            messages=chat,
            tools=None if tools is None else list(tools),
            documents=None if documents is None else list(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.exceptions.TemplateError as e:
        raise DataError(f"chat template refused the messages: {e}") from e
