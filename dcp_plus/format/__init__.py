"""The dcp_plus on-disk format, version 1: commit record, extents, checksums, codecs.

Submodules are imported on first use so that writer worker processes (which import only
``storage.fileio`` and ``format.checksum``) start without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dcp_plus._lazy import lazy_exports

_EXPORTS = {
    "ALIGNMENT": "layout",
    "align_up": "layout",
    "data_file_name": "layout",
    "checksum_bytes": "checksum",
    "new_hasher": "checksum",
    "IDENTITY": "codecs",
    "ZstdCodec": "codecs",
    "BinaryPrefixes": "key_prefix",
    "HexPrefixes": "key_prefix",
    "RoundRobinPrefixes": "key_prefix",
    "get_codec": "codecs",
    "FORMAT_NAME": "record",
    "FORMAT_VERSION": "record",
    "RECORD_NAME": "record",
    "Extent": "record",
    "decode_record": "record",
    "encode_record": "record",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from dcp_plus.format.checksum import checksum_bytes, new_hasher
    from dcp_plus.format.codecs import IDENTITY, ZstdCodec, get_codec
    from dcp_plus.format.key_prefix import BinaryPrefixes, HexPrefixes, RoundRobinPrefixes
    from dcp_plus.format.layout import ALIGNMENT, align_up, data_file_name
    from dcp_plus.format.record import (
        FORMAT_NAME,
        FORMAT_VERSION,
        RECORD_NAME,
        Extent,
        decode_record,
        encode_record,
    )


__getattr__, __dir__ = lazy_exports(__name__, {k: f".{v}" for k, v in _EXPORTS.items()})
