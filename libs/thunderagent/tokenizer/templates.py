"""A model's own chat template (Hugging Face ``tokenizer_config.json``), rendered as transformers'
``apply_chat_template`` renders it, with jinja2 alone.

Why jinja2 and not transformers or minijinja: HF templates *are* jinja2 templates, written
against the environment transformers builds (sandboxed, ``trim_blocks`` + ``lstrip_blocks``,
the ``loopcontrols`` extension, a ``{% generation %}`` tag, ``raise_exception``,
``strftime_now`` and a ``tojson`` that keeps non-ASCII text). Rebuilding that environment takes
a few lines and gives the same text byte for byte, from a ~130 kB pure-Python dependency;
transformers would bring numpy, huggingface_hub and a large import for one function, and
minijinja (Rust) differs from Python's jinja2 on the Python string methods templates call
(``.strip()``, ``.split()``, ``.startswith()``).

Where the template is found, first match wins (transformers' order): ``chat_template.jinja``,
``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates whose
``default`` is used), ``chat_template.json``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from thunderagent.tokenizer.chat import Turn


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled template and the special tokens it may refer to (``bos_token``, ...)."""

    source: str
    special_tokens: dict[str, Any] = field(default_factory=dict)
    origin: str = ""
    """The file it came from (for error messages)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", _environment().from_string(self.source))

    def render(
        self,
        messages: Iterable[Turn | dict],
        *,
        add_generation_prompt: bool = True,
        now: datetime | None = None,
    ) -> str:
        """The prompt text for ``messages``; ``now`` feeds ``strftime_now`` (templates that date
        their system prompt), the current local time when not given."""
        turns = [m if isinstance(m, dict) else {"role": m.role, "content": m.content}
                 for m in messages]  # fmt: skip
        clock = now or datetime.now()
        return self._compiled.render(
            messages=turns,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            strftime_now=lambda fmt: clock.strftime(fmt),
            **self.special_tokens,
        )


def _environment():
    """The environment transformers renders chat templates in (see the module docstring)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks;
        rendering keeps the body unchanged."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_keep")
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _keep(self, caller):
            return caller()

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)  # fmt: skip

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def _token_text(value: Any) -> Any:
    """A special token as ``tokenizer_config.json`` writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    if isinstance(value, list):
        return [_token_text(v) for v in value]
    return value


def _special_tokens(folder: Path) -> dict[str, Any]:
    """``bos_token``, ``eos_token``, ... from the config, then ``special_tokens_map.json``
    for what the config leaves out."""
    found: dict[str, Any] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if not path.is_file():
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        for key, value in data.items():
            if (key.endswith("_token") or key == "additional_special_tokens") and key not in found:
                text = _token_text(value)
                if text is not None:
                    found[key] = text
    return found


def _template_source(folder: Path) -> tuple[str, Path] | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), jinja_file
    for name in ("tokenizer_config.json", "chat_template.json"):
        path = folder / name
        if not path.is_file():
            continue
        template = json.loads(path.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default")
        if template:
            return template, path
    return None


def load_chat_template(folder: str | Path) -> ChatTemplate | None:
    """The chat template of the tokenizer in ``folder``; None when it has none."""
    folder = Path(folder)
    found = _template_source(folder)
    if found is None:
        return None
    source, path = found
    return ChatTemplate(source, _special_tokens(folder), origin=str(path))
