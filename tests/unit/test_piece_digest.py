"""The memory tier's piecewise checksum, and the stager taking it in the same pass as its copy:
every digest the stager hands over is the checksum of the bytes it staged, for every dtype and
size, large tensors cut across copy lanes included."""

from __future__ import annotations

import pytest
import torch
import xxhash

from dcp_plus.format.piece_digest import EMPTY, PIECE_BYTES, PieceHasher, combine, digest_of
from dcp_plus.format.values import byte_view
from dcp_plus.stagers import ArenaStager


def _bytes(n: int, seed: int = 0) -> memoryview:
    g = torch.Generator().manual_seed(seed)
    return byte_view(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))


@pytest.mark.parametrize("n", [0, 1, 4095, PIECE_BYTES, PIECE_BYTES + 1, 2 * PIECE_BYTES + 77])
def test_streamed_in_odd_chunks_the_digest_is_the_whole_buffers(n):
    data = _bytes(n)
    h = PieceHasher()
    for at in range(0, n, 3 << 20 | 5):
        h.update(data[at:at + (3 << 20 | 5)])
    assert h.hexdigest() == digest_of(data)


def test_one_piece_is_plain_xxh3_and_more_are_a_hash_of_the_pieces():
    assert digest_of(memoryview(b"")) == EMPTY == xxhash.xxh3_64_hexdigest(b"")
    small = _bytes(PIECE_BYTES)
    assert digest_of(small) == xxhash.xxh3_64_hexdigest(small)
    big = _bytes(PIECE_BYTES + 10, seed=1)
    pieces = [xxhash.xxh3_64_intdigest(big[:PIECE_BYTES]),
              xxhash.xxh3_64_intdigest(big[PIECE_BYTES:])]
    assert digest_of(big) == combine(pieces) != xxhash.xxh3_64_hexdigest(big)
    damaged = bytearray(big)
    damaged[PIECE_BYTES + 3] ^= 1
    assert digest_of(memoryview(damaged)) != digest_of(big)


def _live() -> dict:
    g = torch.Generator().manual_seed(3)
    big = torch.randn(PIECE_BYTES // 2 + 1000, generator=g)  # 2 pieces + a tail: 3
    return {
        "big": big,
        "tied": big,  # staged twice, into two buffers
        "bf16": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "fp8": torch.randn(4097, generator=g).to(torch.float8_e4m3fn),
        "bool": torch.rand(5, generator=g) > 0.5,
        "byte": torch.tensor([7], dtype=torch.uint8),
        "empty": torch.empty(0, 3),
        "strided": torch.randn(6, 4, generator=g).t(),
        "conj": torch.randn(5, dtype=torch.complex64, generator=g).conj(),
    }


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_stagers_digests_are_the_checksums_of_what_it_staged(threads):
    live = _live()
    stager = ArenaStager(num_threads=threads, buffers=2)
    try:
        staged = stager.stage(live, checksums=True).result(timeout=60)
        for k, v in live.items():
            assert torch.equal(staged[k], v.resolve_conj()), k
        digests = staged.digests
        for k in ("big", "tied", "bf16", "fp8", "bool", "byte"):
            t = staged[k]
            assert digests[(t.data_ptr(), t.nbytes)] == digest_of(byte_view(t)), k
        # a strided source or a lazy conjugate is not a byte copy: the tier hashes it itself
        assert len(digests) == 6
        assert stager.stage(live).result(timeout=60).digests == {}
        del staged, t  # frees the buffer
    finally:
        stager.close(timeout=10)
