"""Which codec stores which tensor: a writer-wide default plus per-name patterns."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from torch.distributed.checkpoint.planner import WriteItemType

from dcp_plus.format.codecs import IDENTITY, Codec, resolve_codec
from dcp_plus.writers.items import ResolvedItem


class CodecChoice:
    """``codec`` for every tensor, unless a ``codecs`` pattern (fnmatch, first wins) matches.

    Args:
        codec: a registered name (``"identity"``, ``"zstd"``, ``"zstd+shuffle"``) or a codec
            instance such as ``ZstdCodec(level=9, threads=8)``.
        codecs: ``{pattern: codec}`` overrides by tensor name, e.g. ``{"*.weight": "zstd"}``.
    """

    def __init__(self, codec: str | Codec = "identity",
                 codecs: Mapping[str, str | Codec] | None = None) -> None:
        self.default = resolve_codec(codec)
        self.patterns = {pattern: resolve_codec(c) for pattern, c in (codecs or {}).items()}

    def codec_for(self, fqn: str) -> Codec:
        for pattern, codec in self.patterns.items():
            if fnmatch.fnmatchcase(fqn, pattern):
                return codec
        return self.default

    def encode(self, r: ResolvedItem) -> str:
        """Replace ``r.data`` by its stored form (tensors only); returns the codec name."""
        if r.item.type == WriteItemType.BYTE_IO:
            return IDENTITY.name
        codec = self.codec_for(r.fqn)
        if codec.name == IDENTITY.name:
            return codec.name
        itemsize = r.item.tensor_data.properties.dtype.itemsize if r.item.tensor_data else 1
        r.data = memoryview(codec.encode(r.data, itemsize))
        r.slab = None  # the stored bytes now live here, not in the stager's slab
        return codec.name
