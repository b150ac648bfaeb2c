"""Protobuf wire primitives for messages built as bytes, without a message object per item.

Used where a hot path writes protobuf framing around bytes it already holds (the KV-event
stream's pre-encoded batches, the benchmarks' byte-built rank reports). The output is what
protobuf's own encoder writes for the same field.
"""

from __future__ import annotations


def varint(n: int) -> bytes:
    """`n` (>= 0) as a base-128 varint."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def length_delimited(number: int, data: bytes) -> bytes:
    """Field `number` (wire type 2) holding `data`."""
    return varint(number << 3 | 2) + varint(len(data)) + data
