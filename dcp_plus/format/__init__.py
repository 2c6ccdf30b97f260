"""The dcp_plus on-disk format, version 1: commit record, extents, checksums, codecs."""

from dcp_plus.format.checksum import checksum_bytes, new_hasher
from dcp_plus.format.codecs import IDENTITY, get_codec
from dcp_plus.format.layout import ALIGNMENT, align_up, data_file_name
from dcp_plus.format.record import (
    FORMAT_NAME,
    FORMAT_VERSION,
    RECORD_NAME,
    Extent,
    decode_record,
    encode_record,
)

__all__ = [
    "ALIGNMENT",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "IDENTITY",
    "RECORD_NAME",
    "Extent",
    "align_up",
    "checksum_bytes",
    "data_file_name",
    "decode_record",
    "encode_record",
    "get_codec",
    "new_hasher",
]
