"""Hypothesis strategies built from protobuf message descriptors: random well-formed messages of
any type (every field optional, scalars across their whole range with a bias to small values,
open enums with unknown numbers, bounded nesting and repetition), and byte-level mutations of
their encodings (flips, insertions, deletions, truncation, garbage)."""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

MAX_DEPTH = 3
MAX_REPEATED = 6
_T = FieldDescriptor


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(max(lo, -3), min(hi, 64)), st.integers(lo, hi), st.sampled_from([lo, hi]))


_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    _T.TYPE_INT32: _ints(-(2**31), 2**31 - 1), _T.TYPE_SINT32: _ints(-(2**31), 2**31 - 1),
    _T.TYPE_SFIXED32: _ints(-(2**31), 2**31 - 1), _T.TYPE_INT64: _ints(-(2**63), 2**63 - 1),
    _T.TYPE_SINT64: _ints(-(2**63), 2**63 - 1), _T.TYPE_SFIXED64: _ints(-(2**63), 2**63 - 1),
    _T.TYPE_UINT32: _ints(0, 2**32 - 1), _T.TYPE_FIXED32: _ints(0, 2**32 - 1),
    _T.TYPE_UINT64: _ints(0, 2**64 - 1), _T.TYPE_FIXED64: _ints(0, 2**64 - 1),
    _T.TYPE_BOOL: st.booleans(),
    _T.TYPE_FLOAT: st.floats(width=32), _T.TYPE_DOUBLE: st.floats(),
    _T.TYPE_STRING: st.one_of(st.text(max_size=24), st.text(max_size=300)),
    _T.TYPE_BYTES: st.binary(max_size=256),
}


def _field(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type == _T.TYPE_MESSAGE:
        assert field.message_type is not None
        return messages(field.message_type, depth + 1)
    if field.type == _T.TYPE_ENUM:
        assert field.enum_type is not None
        return st.one_of(st.sampled_from([v.number for v in field.enum_type.values]), _ints(-(2**31), 2**31 - 1))
    return _SCALARS[field.type]


def _repeated(field: FieldDescriptor) -> bool:
    return bool(field.is_repeated)


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Random messages of `descriptor`'s type (map fields and nesting beyond MAX_DEPTH stay empty)."""
    cls = GetMessageClass(descriptor)
    if depth > MAX_DEPTH:
        return st.builds(cls)
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            continue
        value = _field(field, depth)
        optional[field.name] = st.lists(value, max_size=MAX_REPEATED) if _repeated(field) else value

    def build(values: dict[str, Any]) -> Message:
        msg = cls()
        for name, value in values.items():
            field = descriptor.fields_by_name[name]
            target: Any = getattr(msg, name)
            if _repeated(field):
                if field.type == _T.TYPE_MESSAGE:
                    for item in value:
                        target.add().CopyFrom(item)
                else:
                    target.extend(value)
            elif field.type == _T.TYPE_MESSAGE:
                target.CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg

    return st.fixed_dictionaries({}, optional=optional).map(build)


def seeded(descriptor: Descriptor, seed: Message | None) -> st.SearchStrategy[Message]:
    """Random messages, plus (with a valid `seed`) the seed itself and the seed with random
    fields merged over it, so the accepting paths of a servicer are fuzzed too."""
    if seed is None:
        return messages(descriptor)

    def merged(extra: Message) -> Message:
        msg = type(seed)()
        msg.CopyFrom(seed)
        msg.MergeFrom(extra)
        return msg

    return st.one_of(messages(descriptor), st.just(seed), messages(descriptor).map(merged))


@st.composite
def mutated(draw: st.DrawFn, descriptor: Descriptor, seed: Message | None = None) -> bytes:
    """The encoding of a random (or seed-based) message with a few random byte-level edits, or
    pure garbage."""
    data = bytearray(draw(seeded(descriptor, seed)).SerializeToString())
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=512))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "varint"]))
        pos = draw(st.integers(0, len(data)))
        if op == "flip" and data:
            i = min(pos, len(data) - 1)
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[pos:pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[pos:]
        elif op == "varint":  # an over-long varint, a classic decoder edge
            data[pos:pos] = b"\x08" + b"\xff" * 10
    return bytes(data)
