"""How a replica is cut into messages for its way back to its owner."""

from __future__ import annotations

from dcp_plus.tiers.peer_restore import ALONE, MESSAGE_BYTES, messages_of
from dcp_plus.tiers.record import TensorEntry


def _entry(file: str, offset: int, nbytes: int) -> TensorEntry:
    return TensorEntry(f"t{offset}", "uint8", [nbytes], [1], file if nbytes else "", offset,
                       nbytes, "")


def test_large_tensors_go_alone_and_small_ones_share_runs_within_a_file():
    entries = [_entry("a", 0, 100), _entry("a", 4096, 200), _entry("a", 8192, ALONE),
               _entry("a", 8192 + ALONE, 0), _entry("a", 2 * ALONE, 10), _entry("b", 0, 10)]
    got = [(m.file, m.start, m.length, m.entries) for m in messages_of(entries)]
    assert got == [("a", 0, 4296, (0, 1)), ("a", 8192, ALONE, (2,)),
                   ("a", 2 * ALONE, 10, (4,)), ("b", 0, 10, (5,))]


def test_a_run_never_spans_more_than_the_alone_size():
    small = ALONE // 4
    entries = [_entry("a", i * small, small - 1) for i in range(10)]
    messages = messages_of(entries)
    assert all(m.length <= ALONE for m in messages)
    assert [i for m in messages for i in m.entries] == list(range(10))
    assert len(messages) == 3  # 4 + 4 + 2 entries


def test_entries_out_of_offset_order_are_covered_by_their_run():
    entries = [_entry("a", 5000, 10), _entry("a", 0, 10)]
    (m,) = messages_of(entries)
    assert (m.start, m.length, m.entries) == (0, 5010, (0, 1))


def test_a_large_tensor_travels_in_messages_of_at_most_the_message_size():
    n = 2 * MESSAGE_BYTES + 5
    entries = [_entry("a", 0, 10), _entry("a", 4096, n), _entry("a", 4096 + n, 10)]
    got = [(m.start, m.length, m.entries, m.at) for m in messages_of(entries)]
    assert got == [(0, 10, (0,), 0), (4096, MESSAGE_BYTES, (1,), 0),
                   (4096 + MESSAGE_BYTES, MESSAGE_BYTES, (1,), MESSAGE_BYTES),
                   (4096 + 2 * MESSAGE_BYTES, 5, (1,), 2 * MESSAGE_BYTES),
                   (4096 + n, 10, (2,), 0)]
