"""Tokenizers the router uses to turn text into the token ids the engine will see.

``thunderagent/bytes`` is the built-in, deterministic tokenizer of simulated models (UTF-8 bytes,
one id each, plus a few special ids): no files, identical in every process. A real model names a
local HF ``tokenizer.json`` and is loaded with the ``tokenizers`` library (an optional dependency),
and its chat template (``tokenizer_config.json``) is rendered with jinja2 as transformers would.
Chat messages become text in one place: ``load_tokenizer(spec).render_chat(messages)``.
"""

from thunderagent.tokenizer.base import BYTES_SPEC, ByteTokenizer, Tokenizer, load_tokenizer
from thunderagent.tokenizer.chat import render_chat
from thunderagent.tokenizer.templates import ChatTemplate, load_chat_template

__all__ = [
    "BYTES_SPEC",
    "ByteTokenizer",
    "ChatTemplate",
    "Tokenizer",
    "load_chat_template",
    "load_tokenizer",
    "render_chat",
]
