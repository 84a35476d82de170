"""A JetStream message's stream sequence, read from its reply subject, is the one nats-py's own
metadata parser reads, in both forms of the subject the server sends."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.msg import Msg
from nats.errors import NotJSMessageError

from thunderagent.bus.jetstream import stream_seq

u64 = st.integers(min_value=0, max_value=2**63 - 1)


@given(delivered=u64, sseq=u64, cseq=u64, ns=u64, pending=u64)
def test_the_short_form_reads_as_nats_py_reads_it(delivered, sseq, cseq, ns, pending) -> None:
    reply = f"$JS.ACK.THUNDERAGENT_KV.index.{delivered}.{sseq}.{cseq}.{ns}.{pending}"
    msg = Msg(_client=None, subject="thunderagent.kv.events.w0", reply=reply)  # type: ignore[arg-type]
    assert stream_seq(msg) == Msg.Metadata._from_reply(reply).sequence.stream == sseq


def test_the_form_with_a_domain_goes_to_nats_py() -> None:
    reply = "$JS.ACK.hub.ACCHASH.THUNDERAGENT_KV.index.1.42.7.1733467200000000000.0.rnd"
    msg = Msg(_client=None, subject="thunderagent.kv.events.w0", reply=reply)  # type: ignore[arg-type]
    assert stream_seq(msg) == 42


def test_a_message_without_a_jetstream_reply_is_refused() -> None:
    msg = Msg(_client=None, subject="thunderagent.kv.events.w0", reply="_INBOX.abc")  # type: ignore[arg-type]
    with pytest.raises(NotJSMessageError):
        stream_seq(msg)
