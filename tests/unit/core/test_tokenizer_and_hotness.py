"""Built-in tokenizer, chat rendering and the hot-prefix counter."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from thunderagent.hotness import HotPrefixCounter
from thunderagent.schemas import ChatMessage
from thunderagent.tokenizer import ByteTokenizer, load_tokenizer, render_chat


@given(st.text())
def test_byte_tokenizer_round_trips(text):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_chat_rendering_of_a_longer_conversation_extends_the_shorter_one():
    turns = [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="hi")]
    more = [
        *turns,
        ChatMessage(role="assistant", content="hello"),
        ChatMessage(role="user", content="?"),
    ]
    short = render_chat(turns).removesuffix("<|assistant|>\n")
    assert render_chat(more).startswith(short)


def test_missing_tokenizer_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_tokenizer(str(tmp_path / "nowhere"))


def test_hot_prefixes_slide_out_of_the_window():
    c = HotPrefixCounter(window_s=60, slices=6)
    for _ in range(3):
        c.hit(prefix=1, depth_blocks=4, now=0.0)
    c.hit(prefix=2, depth_blocks=9, now=30.0)
    c.hit(prefix=2, depth_blocks=9, now=31.0)
    assert [(e["prefix"], e["hits"]) for e in c.top(5, now=31.0)] == [(1, 3), (2, 2)]
    assert [(e["prefix"], e["hits"], e["depth_blocks"]) for e in c.top(5, now=65.0)] == [(2, 2, 9)]
    assert c.top(5, now=200.0) == []
