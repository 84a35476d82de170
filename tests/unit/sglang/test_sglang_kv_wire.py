"""Round-trips of the SGLang KV-event wire format and golden block hashes (no I/O)."""

from __future__ import annotations

import msgspec
import pytest

from thunderagent.sglang import kv_wire as w

STORED = w.BlockStored(
    block_hashes=[1, -2],
    parent_block_hash=None,
    token_ids=[5, 6, 7, 8],
    block_size=2,
    lora_id=None,
    medium=w.MEDIUM_GPU,
)


@pytest.mark.parametrize(
    "batch",
    [
        w.KvEventBatch(ts=1.5, events=[]),
        w.KvEventBatch(ts=1.5, events=[STORED], attn_dp_rank=0),
        w.KvEventBatch(
            ts=2.0,
            events=[
                STORED,
                w.BlockRemoved(block_hashes=[2**63 - 1, -(2**63)], medium=w.MEDIUM_CPU),
                w.AllBlocksCleared(),
                msgspec.structs.replace(STORED, cache_salt="s", session_id="x", lora_name="a"),
            ],
            attn_dp_rank=3,
        ),
    ],
)
def test_batch_round_trip(batch: w.KvEventBatch) -> None:
    assert w.decode_batch(w.encode_batch(batch)) == batch


def test_wire_shape() -> None:
    """A batch is an array; events are maps tagged "type"; unset optionals are omitted."""
    batch = w.KvEventBatch(ts=1.0, events=[STORED, w.AllBlocksCleared()], attn_dp_rank=0)
    raw = msgspec.msgpack.decode(w.encode_batch(batch))
    assert raw == [
        1.0,
        [
            {
                "type": "BlockStored",
                "block_hashes": [1, -2],
                "parent_block_hash": None,
                "token_ids": [5, 6, 7, 8],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
            },
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]


def test_decode_accepts_two_element_batch_and_unknown_fields() -> None:
    payload = msgspec.msgpack.encode(
        [0.5, [{"type": "BlockRemoved", "block_hashes": [9], "future_field": 1}]]
    )
    assert w.decode_batch(payload) == w.KvEventBatch(
        ts=0.5, events=[w.BlockRemoved(block_hashes=[9])], attn_dp_rank=None
    )


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", msgspec.msgpack.encode([0.5, [{"type": "Nope"}], 0]), msgspec.msgpack.encode({})],
)
def test_decode_rejects_bad_payloads(payload: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        w.decode_batch(payload)


# Golden values computed with SGLang 0.5.23's own native hash (`get_hash_str` over
# `mem_cache/cpp_utils/hash_binding.cpp`); the contract test re-derives them live.
@pytest.mark.parametrize(
    ("tokens", "block_size", "parent", "expected"),
    [
        (
            [1, 2, 3, 4, 5, 6, 7, 8, 9],
            4,
            None,
            [-3488128144981237669, 5674439469042975057, 883607134226730776],
        ),
        ([0], 1, None, [-2360060374177730597]),
        ([151643, 2**32 - 1, 2**32, 7], 2, None, [7332171776899371565, -8916248518858775945]),
        (
            [10, 20, 30, 40],
            2,
            w.sglang_salt_parent("tenant"),
            [-3751208802102312235, -756571102432514774],
        ),
    ],
)
def test_block_hashes_golden(
    tokens: list[int], block_size: int, parent: bytes | None, expected: list[int]
) -> None:
    assert w.sglang_block_hashes(tokens, block_size, parent) == expected


def test_block_hash_chain_splits_anywhere() -> None:
    """Hashing a prefix then continuing from its last digest equals hashing it all at once."""
    tokens = list(range(1000, 1037))
    whole = w.sglang_block_digests(tokens, 4)
    head = w.sglang_block_digests(tokens[:16], 4)
    tail = w.sglang_block_digests(tokens[16:], 4, parent=head[-1])
    assert head + tail == whole
    assert [w.digest_to_int64(d) for d in whole] == w.sglang_block_hashes(tokens, 4)


@pytest.mark.parametrize(
    ("tokens", "block_size", "parent"),
    [([-1], 1, None), ([2**63], 1, None), ([1], 0, None), ([1], 1, b"short")],
)
def test_block_hash_bad_input(tokens: list[int], block_size: int, parent: bytes | None) -> None:
    with pytest.raises(ValueError):
        w.sglang_block_hashes(tokens, block_size, parent)


def test_seq_frames() -> None:
    assert w.seq_to_bytes(1) == b"\x00" * 7 + b"\x01"
    assert w.seq_from_bytes(w.seq_to_bytes(2**40)) == 2**40
    assert w.REPLAY_END_SEQ == (-1).to_bytes(8, "big", signed=True)
    with pytest.raises(ValueError):
        w.seq_from_bytes(b"\x00")
