"""Built-in tokenizer and chat rendering."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

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
