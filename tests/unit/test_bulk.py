"""DCP's per-item objects built in bulk equal, and hash as, those their constructors build."""

from __future__ import annotations

import pickle

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from dcp_plus.format.bulk import extents, metadata_indexes
from dcp_plus.format.extent import Extent


def test_metadata_indexes_equal_and_hash_as_the_constructors():
    fqns = ["a", "b.c", "a"]
    offsets = [torch.Size([0, 0]), None, torch.Size([4, 0])]
    built = metadata_indexes(fqns, offsets)
    expected = [MetadataIndex("a", [0, 0]), MetadataIndex("b.c"), MetadataIndex("a", [4, 0])]
    assert built == expected and list(map(hash, built)) == list(map(hash, expected))
    assert {i: n for n, i in enumerate(built)}[MetadataIndex("a", (4, 0))] == 2
    assert [type(i) for i in built] == [MetadataIndex] * 3 and built[1].index is None
    assert pickle.loads(pickle.dumps(built)) == expected  # as DCP ships them between ranks


def test_extents_are_the_named_tuples_the_constructor_builds():
    cols = (["f0", "f1"], [0, 4096], [8, 0], [8, 0], ["identity"] * 2, ["xx", "yy"],
            [None, "bytesio"], [None, "p/"], [None, None], [None, None])
    built = extents(*cols)
    assert built == [Extent(*row) for row in zip(*cols, strict=True)]
    assert all(type(e) is Extent for e in built) and built[1].prefix == "p/"
