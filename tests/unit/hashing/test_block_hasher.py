"""Block hashing: the scheme is pinned by known answers, then checked for its properties."""

from __future__ import annotations

import struct
from array import array

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from thunderagent.hashing import (
    SCHEME_VERSION,
    BlockHasher,
    BlockHashes,
    kv_namespace,
    namespace_roots,
)

CHECK_SEED = 0x9E3779B97F4A7C15
DOMAIN = b"thunderagent.blocks.v1\x00"


# Known answers. Each value was computed once with the derivation written beside it, using
# xxhash directly on bytes built with struct (not through BlockHasher), and is hard-coded so any
# change to the scheme (byte order, token width, seeding, root payload, chaining) fails here.
# If the scheme changes on purpose, bump SCHEME_VERSION and recompute these with the derivation.

ROOT_NS0 = (16968944260369845315, 6511725924797967180)
"""xxh3_64(DOMAIN + b"i" + (0).to_bytes(8, "little"), seed=0),
xxh64(same payload, seed=CHECK_SEED)."""

ROOT_LORA_A = (10354196671070872404, 12895412265663853260)
"""Same with payload DOMAIN + b"s" + b"lora-a"."""

TOKENS_0_31_PAGE16 = BlockHashes(
    [11202330551699939721, 260652371062810314], [12390879205036097506, 8215316336571981818]
)
"""block_size 16, tokens 0..31, namespace 0: block i bytes = struct.pack("<16I", 16i..16i+15);
primary_i = xxh3_64(bytes, seed=primary_{i-1}); check_i = xxh64(bytes, seed=check_{i-1});
the chains start at ROOT_NS0."""

BLOCK_IDS_PAGE16 = BlockHashes(
    [9373444807621161700, 16589807951300491239], [12960061922380481958, 8464900322347725985]
)
"""Block ids [42, 2**64-1], namespace 0: each id is struct.pack("<Q", id), chained as above."""


def _derive_tokens(tokens: list[int], block: int, root: tuple[int, int]) -> BlockHashes:
    """The scheme written out independently of the implementation."""
    p, c = root
    out = BlockHashes([], [])
    for i in range(len(tokens) // block):
        data = struct.pack(f"<{block}I", *tokens[i * block : (i + 1) * block])
        p = xxhash.xxh3_64_intdigest(data, seed=p)
        c = xxhash.xxh64_intdigest(data, seed=c)
        out.primary.append(p)
        out.check.append(c)
    return out


def test_scheme_version_is_pinned() -> None:
    assert SCHEME_VERSION == 1


@pytest.mark.parametrize(
    ("namespace", "payload", "expected"),
    [
        (0, DOMAIN + b"i" + (0).to_bytes(8, "little"), ROOT_NS0),
        ("lora-a", DOMAIN + b"s" + b"lora-a", ROOT_LORA_A),
    ],
)
def test_roots_known_answers(namespace: int | str, payload: bytes, expected: tuple) -> None:
    derived = (xxhash.xxh3_64_intdigest(payload, 0), xxhash.xxh64_intdigest(payload, CHECK_SEED))
    assert derived == expected
    assert namespace_roots(namespace) == expected
    assert BlockHasher(16, namespace).root == expected


def test_tokens_known_answer() -> None:
    tokens = list(range(32))
    assert _derive_tokens(tokens, 16, ROOT_NS0) == TOKENS_0_31_PAGE16
    assert BlockHasher(16).hash_tokens(tokens) == TOKENS_0_31_PAGE16


def test_block_ids_known_answer() -> None:
    p, c = ROOT_NS0
    derived = BlockHashes([], [])
    for block_id in (42, 2**64 - 1):
        data = struct.pack("<Q", block_id)
        p = xxhash.xxh3_64_intdigest(data, seed=p)
        c = xxhash.xxh64_intdigest(data, seed=c)
        derived.primary.append(p)
        derived.check.append(c)
    assert derived == BLOCK_IDS_PAGE16
    assert BlockHasher(16).hash_block_ids([42, 2**64 - 1]) == BLOCK_IDS_PAGE16


@pytest.mark.parametrize(
    ("num_tokens", "block", "blocks"),
    [(0, 16, 0), (15, 16, 0), (16, 16, 1), (31, 16, 1), (32, 16, 2), (8192, 16, 512), (7, 1, 7)],
)
def test_partial_last_block_is_not_hashed(num_tokens: int, block: int, blocks: int) -> None:
    out = BlockHasher(block).hash_tokens(list(range(num_tokens)))
    assert len(out.primary) == len(out.check) == blocks
    assert BlockHasher(block).num_blocks(num_tokens) == blocks


def _token_inputs(tokens: list[int]) -> list[object]:
    inputs: list[object] = [tokens, tuple(tokens), array("I", tokens), iter(tokens)]
    np = pytest.importorskip("numpy")
    inputs += [
        np.array(tokens, dtype=np.uint32),
        np.array(tokens, dtype=np.int64),
        np.repeat(np.array(tokens, dtype=np.uint32), 2)[::2],  # non-contiguous view
        np.array(tokens, dtype=">u4"),  # big-endian storage, same values
    ]
    return inputs


def test_every_input_type_hashes_the_same_values() -> None:
    tokens = [(i * 2654435761) % 2**32 for i in range(64)]
    expected = _derive_tokens(tokens, 16, ROOT_NS0)
    for inp in _token_inputs(tokens):
        assert BlockHasher(16).hash_tokens(inp) == expected, type(inp)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tokens", "error"),
    [([-1], OverflowError), ([2**32], OverflowError), (b"\x00" * 64, TypeError), ("ab", TypeError)],
)
def test_bad_tokens_are_rejected(tokens: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        BlockHasher(1).hash_tokens(tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [{"block_size": 0}, {"block_size": -4}, {"block_size": 1.5}])
def test_bad_page_size(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(**kwargs)


@pytest.mark.parametrize("namespace", [-1, 2**64, 1.0, None])
def test_bad_namespace(namespace: object) -> None:
    with pytest.raises(ValueError, match="namespace"):
        namespace_roots(namespace)  # type: ignore[arg-type]


def test_namespace_changes_every_hash() -> None:
    tokens = list(range(64))
    base = BlockHasher(16).hash_tokens(tokens)
    for ns in (1, "0", "", "lora-a"):
        other = BlockHasher(16, ns).hash_tokens(tokens)
        assert not set(other.primary) & set(base.primary)
        assert not set(other.check) & set(base.check)


def test_last_is_the_parent_to_continue_from() -> None:
    out = BlockHasher(4).hash_tokens(range(8))
    assert out.last == (out.primary[1], out.check[1])
    assert BlockHasher(4).hash_tokens([]).last is None


token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=80)


@given(tokens=token_lists, block=st.integers(1, 9), cut=st.integers(0, 10))
def test_chain_continues_from_any_block_boundary(tokens: list[int], block: int, cut: int) -> None:
    """hash(a + b) == hash(a) + hash(b, parent=last of a): the adapter's re-hashing property."""
    hasher = BlockHasher(block)
    split = min(cut, len(tokens) // block) * block
    whole = hasher.hash_tokens(tokens)
    head = hasher.hash_tokens(tokens[:split])
    tail = hasher.hash_tokens(tokens[split:], head.last)
    assert head.primary + tail.primary == whole.primary
    assert head.check + tail.check == whole.check
    assert whole == _derive_tokens(tokens, block, ROOT_NS0)


@given(a=token_lists, b=token_lists)
def test_one_hash_names_the_whole_prefix(a: list[int], b: list[int]) -> None:
    """Equal block hashes at position i iff the first i+1 blocks are equal (no collisions in
    practice), and the two chains agree on that."""
    ha, hb = BlockHasher(2).hash_tokens(a), BlockHasher(2).hash_tokens(b)
    pairs = zip(ha.primary, hb.primary, ha.check, hb.check, strict=False)  # lengths may differ
    for i, (pa, pb, ca, cb) in enumerate(pairs):
        same = a[: 2 * (i + 1)] == b[: 2 * (i + 1)]
        assert (pa == pb) == same
        assert (ca == cb) == same


@given(ids=st.lists(st.integers(0, 2**64 - 1), max_size=20), cut=st.integers(0, 20))
def test_block_ids_chain(ids: list[int], cut: int) -> None:
    hasher = BlockHasher(512)
    whole = hasher.hash_block_ids(ids)
    head = hasher.hash_block_ids(ids[:cut])
    tail = hasher.hash_block_ids(ids[cut:], head.last)
    assert head.primary + tail.primary == whole.primary
    assert head.check + tail.check == whole.check


def test_a_requests_namespace_is_its_salt_and_its_lora_adapter() -> None:
    """Without an adapter, a salt roots its chain as before (hashes unchanged); an adapter opens
    a namespace of its own, per salt, that no salt string can open."""
    assert kv_namespace() == 0 and kv_namespace(None, "") == 0
    assert kv_namespace("tenant-a") == "tenant-a"
    roots = {
        namespace_roots(kv_namespace(salt, lora))
        for salt in (None, "tenant-a")
        for lora in (None, "sql-adapter", "chat-adapter")
    }
    assert len(roots) == 6
    # the parts of a lora namespace joined in any way are a salt like any other
    for salt in ("lorasql-adapter", "lora\x00sql-adapter\x00", "('lora', 'sql-adapter', '')"):
        assert namespace_roots(salt) != namespace_roots(kv_namespace(None, "sql-adapter"))


@given(
    a=st.tuples(st.text(max_size=8), st.text(max_size=8)),
    b=st.tuples(st.text(max_size=8), st.text(max_size=8)),
)
def test_tuple_namespaces_are_told_apart_part_by_part(a, b) -> None:
    """Length-prefixed parts: ("ab", "c") and ("a", "bc") are different namespaces."""
    assert (namespace_roots(a) == namespace_roots(b)) == (a == b)
