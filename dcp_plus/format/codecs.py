"""Codec slot. Version 1 ships ``identity``; compressed codecs register here."""

from __future__ import annotations

from typing import Protocol


class Codec(Protocol):
    name: str

    def encode(self, raw: memoryview) -> bytes | memoryview: ...

    def decode(self, stored: memoryview, raw_length: int) -> bytes | memoryview: ...


class IdentityCodec:
    """Stores bytes as they are."""

    name = "identity"

    def encode(self, raw: memoryview) -> memoryview:
        return raw

    def decode(self, stored: memoryview, raw_length: int) -> memoryview:
        return stored


IDENTITY = IdentityCodec()
_CODECS: dict[str, Codec] = {IDENTITY.name: IDENTITY}


def register_codec(codec: Codec) -> None:
    _CODECS[codec.name] = codec


def get_codec(name: str) -> Codec:
    try:
        return _CODECS[name]
    except KeyError:
        raise KeyError(f"unknown codec {name!r}; known: {sorted(_CODECS)}") from None
