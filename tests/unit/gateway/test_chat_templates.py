"""Chat templates of real models (HF ``tokenizer_config.json``) rendered as transformers renders
them. The expected strings below were produced by transformers 5.24.0's
``apply_chat_template`` on these same tokenizer folders (and its ``tokenize=True`` ids matched
``encode(render_chat(...))``); transformers is not a dependency, so the check is recorded here.
The two templates are ours, written in the style of Llama 3.x and ChatML (Qwen) templates to use
what real ones use: ``bos_token``, ``strftime_now``, ``trim``, namespaces, ``loop`` controls,
``raise_exception``, ``tojson`` with non-ASCII text, the ``generation`` tag, and block tags on
lines of their own (``trim_blocks`` / ``lstrip_blocks``)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import pytest

from thunderagent.schemas import ChatMessage
from thunderagent.tokenizer import ByteTokenizer, load_chat_template, load_tokenizer, render_chat

LLAMA_STYLE = (
    "{{- bos_token }}\n"
    "{%- if not date_string is defined %}\n"
    '    {%- set date_string = strftime_now("%d %b %Y") %}\n'
    "{%- endif %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] | trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    '    {%- set system_message = "" %}\n'
    "{%- endif %}\n"
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
    '{{- "Today Date: " + date_string + "\\n\\n" }}\n'
    "{{- system_message }}\n"
    '{{- "<|eot_id|>" }}\n'
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
CHATML_STYLE = (
    "{% set ns = namespace(system_seen=false) %}\n"
    "{% for message in messages %}\n"
    "    {% if message.role not in ['system', 'user', 'assistant'] %}\n"
    "        {{ raise_exception('unsupported role ' + message.role) }}\n"
    "    {% endif %}\n"
    "    {% if message.role == 'system' %}\n"
    "        {% set ns.system_seen = true %}\n"
    "    {% endif %}\n"
    "<|im_start|>{{ message.role }}\n"
    "{% if message.role == 'assistant' %}\n"
    "{% generation %}{{ message.content.strip() }}{% endgeneration %}<|im_end|>\n"
    "{% else %}\n"
    "{{ message.content }}<|im_end|>\n"
    "{% endif %}\n"
    "    {% if loop.index >= 3 %}{% break %}{% endif %}\n"
    "{% endfor %}\n"
    "{% if not ns.system_seen %}"
    "<!-- {{ {'note': 'no system', 'caf\u00e9': [1, 2]} | tojson }} -->\n"
    "{% endif %}\n"
    "{% if add_generation_prompt %}\n"
    "<|im_start|>assistant\n"
    "{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "  Be brief.  "},
    {"role": "user", "content": "Hello there, caf\u00e9?"},
    {"role": "assistant", "content": "  Hi!  "},
    {"role": "user", "content": "Again"},
]
DAY = datetime(2026, 12, 1)
LLAMA_EXPECTED = (
    "<s><|start_header_id|>system<|end_header_id|>\n\nToday Date: 01 Dec 2026\n\nBe brief."
    "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello there, caf\u00e9?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHi!<|eot_id|><|start_header_id|>user"
    "<|end_header_id|>\n\nAgain<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
)
CHATML_EXPECTED = (
    "<|im_start|>system\n  Be brief.  <|im_end|>\n<|im_start|>user\nHello there, caf\u00e9?"
    "<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>\n<|im_start|>assistant\n"
)
CHATML_NO_SYSTEM_NO_PROMPT = (
    "<|im_start|>user\nHello there, caf\u00e9?<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>\n"
    '<|im_start|>user\nAgain<|im_end|>\n<!-- {"note": "no system", "caf\u00e9": [1, 2]} -->\n'
)
SPECIALS = ["<s>", "</s>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"]


def tokenizer_folder(folder: Path, template: str | None, **config) -> Path:
    """A real HF tokenizer.json (built with `tokenizers`) and a tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "hello": 1, "there": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False},
           "eos_token": "</s>", **config}  # fmt: skip
    if template is not None:
        cfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def test_llama_style_template_as_transformers_renders_it(tmp_path):
    tok = load_tokenizer(str(tokenizer_folder(tmp_path / "llama", LLAMA_STYLE)))
    assert tok.render_chat(MESSAGES_AS_TURNS, now=DAY) == LLAMA_EXPECTED
    ids = tok.encode(tok.render_chat(MESSAGES_AS_TURNS, now=DAY))
    assert ids[0] == SPECIALS.index("<s>") + 3, "special tokens in the text become their ids"


def test_chatml_style_template_with_loop_controls_and_tojson(tmp_path):
    template = load_chat_template(tokenizer_folder(tmp_path / "chatml", CHATML_STYLE))
    assert template.render(MESSAGES) == CHATML_EXPECTED
    assert template.render(MESSAGES[1:], add_generation_prompt=False) == CHATML_NO_SYSTEM_NO_PROMPT
    with pytest.raises(jinja2.TemplateError, match="unsupported role tool"):
        template.render([{"role": "tool", "content": "x"}])


def test_template_sources_in_transformers_order(tmp_path):
    folder = tokenizer_folder(tmp_path / "named", [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}"},
    ])  # fmt: skip
    assert load_chat_template(folder).render([{"role": "user", "content": "x"}]) == "<s>x"
    (folder / "chat_template.jinja").write_text("FILE {{ eos_token }}")
    assert load_chat_template(folder).render([]) == "FILE </s>"


def test_no_template_falls_back_to_the_built_in_rendering(tmp_path):
    tok = load_tokenizer(str(tokenizer_folder(tmp_path / "plain", None)))
    assert tok.chat_template is None
    assert tok.render_chat(MESSAGES_AS_TURNS) == render_chat(MESSAGES_AS_TURNS)
    assert ByteTokenizer().render_chat(MESSAGES_AS_TURNS) == render_chat(MESSAGES_AS_TURNS)


MESSAGES_AS_TURNS = [ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES]
