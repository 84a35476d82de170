"""The router packs a prompt's ids once: the limits and the hashes read the packed array, and
answer exactly as they do for the list."""

import random

import pytest

from thunderagent.fleet import WorkerState, check_limits
from thunderagent.hashing import BlockHasher, pack_tokens
from thunderagent.schemas import ErrorCode, WorkerRegistration


def worker(vocab: int, context: int) -> WorkerState:
    reg = WorkerRegistration(
        worker_id="w0", model="m", engine_url="", block_size=4, kv_capacity_blocks=1000,
        lease_s=10.0, registered_at=0.0, vocab_size=vocab, context_length=context,
    )  # fmt: skip
    return WorkerState(reg, 0.0)


def test_packed_ids_hash_as_the_list_does() -> None:
    ids = [random.Random(1).randrange(2**32) for _ in range(203)]
    hasher = BlockHasher(16)
    assert hasher.hash_tokens(pack_tokens(ids)) == hasher.hash_tokens(ids)


@pytest.mark.parametrize("copies", [1, 100])  # 3 ids read by a loop, 300 by numpy
@pytest.mark.parametrize("top", [0, 127, 128, 2**32 - 1])
def test_the_vocabulary_check_reads_the_packed_array_as_the_list(top: int, copies: int) -> None:
    ids = [3, top, 5] * copies
    workers = [worker(vocab=128, context=10_000)]
    assert check_limits(pack_tokens(ids), 1, workers) == check_limits(ids, 1, workers)
    refused = check_limits(pack_tokens(ids), 1, workers)
    if top < 128:
        assert refused is None
    else:
        message = f"token id {top} is outside the model's vocabulary (ids below 128)"
        assert refused == (ErrorCode.BAD_REQUEST, message)


def test_the_context_check_counts_the_packed_ids() -> None:
    refused = check_limits(pack_tokens([1] * 60), 50, [worker(vocab=128, context=100)])
    assert refused is not None and refused[0] == ErrorCode.CONTEXT_LENGTH
    assert "prompt (60 tokens) + max_tokens (50)" in refused[1]


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_an_id_past_32_bits_cannot_be_packed(bad: int) -> None:
    with pytest.raises(OverflowError):
        pack_tokens([1, bad])
