"""connectors.wire.protobuf_bytes writes what protobuf's own encoder writes."""

from __future__ import annotations

import pytest
from google.protobuf import wrappers_pb2

from connectors.wire.protobuf_bytes import length_delimited, varint


@pytest.mark.parametrize("n", [1, 127, 128, 300, 2**32 - 1, 2**63 - 1])
def test_varint_matches_protobuf(n: int) -> None:
    assert b"\x08" + varint(n) == wrappers_pb2.UInt64Value(value=n).SerializeToString()


def test_varint_of_zero_is_one_byte() -> None:
    assert varint(0) == b"\x00"


@pytest.mark.parametrize("data", [b"", b"x", bytes(range(256)) * 3])
def test_length_delimited_matches_protobuf(data: bytes) -> None:
    expected = wrappers_pb2.BytesValue(value=data).SerializeToString()
    if data:
        assert length_delimited(1, data) == expected
    else:  # proto3 leaves an empty field out; the framing is still tag + length 0
        assert length_delimited(1, data) == b"\x0a\x00" and expected == b""
