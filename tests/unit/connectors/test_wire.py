"""vLLM KV-event wire codec: golden bytes, round trips, the tolerant decoder, and a byte-for-byte
cross-check against msgspec structs declared like vLLM's (reference spec §1)."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from connectors.wire import WireFormatError, decode_batch, encode_batch

TS = "cb3ff8000000000000"  # 1.5 as float64


def s(text: str) -> str:
    """msgpack fixstr hex of a short ASCII string."""
    assert len(text) < 32
    return f"{0xa0 + len(text):02x}" + text.encode().hex()


STORED = BlockStored(block_hashes=(1, 2**63), parent_block_hash=None, token_ids=(5, 300),
                     block_size=1, lora_id=None, medium="GPU", lora_name=None,
                     extra_keys=(None, ("lora-a",)), group_idx=0)


# -- golden bytes ---------------------------------------------------------------------------

def test_all_blocks_cleared_golden_bytes_from_the_issue() -> None:
    batch = KVEventBatch(1.5, [AllBlocksCleared()], 0)
    want = "93" + TS + "91" + "81" + s("type") + "b0" + b"AllBlocksCleared".hex() + "00"
    assert encode_batch(batch).hex() == want
    legacy = "93" + TS + "91" + "91" + "b0" + b"AllBlocksCleared".hex() + "00"
    assert encode_batch(batch, legacy=True).hex() == legacy


def test_block_stored_golden_bytes_map_mode() -> None:
    want = ("93" + TS + "91" + "8a"  # batch, one event, map of 10 keys
            + s("type") + "ab" + b"BlockStored".hex()
            + s("block_hashes") + "92" + "01" + "cf8000000000000000"
            + s("parent_block_hash") + "c0"
            + s("token_ids") + "92" + "05" + "cd012c"
            + s("block_size") + "01"
            + s("lora_id") + "c0"
            + s("medium") + s("GPU")
            + s("lora_name") + "c0"
            + s("extra_keys") + "92" + "c0" + "91" + s("lora-a")
            + s("group_idx") + "00"
            + "c0")  # data_parallel_rank nil
    assert encode_batch(KVEventBatch(1.5, [STORED])).hex() == want


def test_block_stored_golden_bytes_legacy_mode() -> None:
    want = ("93" + TS + "91" + "9c"  # array of 12
            + "ab" + b"BlockStored".hex()
            + "92" + "01" + "cf8000000000000000" + "c0" + "92" + "05" + "cd012c" + "01"
            + "c0" + s("GPU") + "c0" + "92" + "c0" + "91" + s("lora-a") + "00" + "c0" + "c0"
            + "c0")
    assert encode_batch(KVEventBatch(1.5, [STORED]), legacy=True).hex() == want


def test_block_removed_golden_bytes_both_modes() -> None:
    removed = BlockRemoved((7,), None)
    batch = KVEventBatch(1.5, [removed], 3)
    head = "93" + TS + "91"
    assert encode_batch(batch).hex() == (head + "83" + s("type") + s("BlockRemoved")
                                         + s("block_hashes") + "9107" + s("medium") + "c0" + "03")
    assert encode_batch(batch, legacy=True).hex() == head + "94" + s("BlockRemoved") + "9107c0c0" + "03"


def test_bytes_hashes_are_bin_and_pdserve_medium_is_map_only() -> None:
    digest = bytes(range(32))
    data = encode_batch(KVEventBatch(2.0, [BlockRemoved((digest,), "CPU"), AllBlocksCleared("CPU")]))
    assert "c420" + digest.hex() in data.hex()
    assert decode_batch(data).events == [BlockRemoved((digest,), "CPU"), AllBlocksCleared("CPU")]
    legacy = decode_batch(encode_batch(KVEventBatch(2.0, [AllBlocksCleared("CPU")]), legacy=True))
    assert legacy.events == [AllBlocksCleared()]


def test_encoder_rejects_out_of_range_hashes() -> None:
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match="block hash"):
            encode_batch(KVEventBatch(0.0, [BlockRemoved((bad,), "GPU")]))


# -- the tolerant decoder --------------------------------------------------------------------

def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("length", [6, 7, 8, 9, 10, 12, 14])
def test_legacy_block_stored_of_every_length(length: int) -> None:
    fields: list[Any] = ["BlockStored", [11, 12], 10, [1, 2, 3, 4], 2, None, "GPU", "lora", [None, None],
                         0, "full_attention", None, "trailing", "more"]
    batch = decode_batch(pack([1, [fields[:length]], 0]))
    (event,) = batch.events
    assert isinstance(event, BlockStored)
    assert event.block_hashes == (11, 12) and event.parent_block_hash == 10 and event.block_size == 2
    assert event.medium == ("GPU" if length >= 7 else None)
    assert event.lora_name == ("lora" if length >= 8 else None)
    assert event.extra_keys == ((None, None) if length >= 9 else None)
    assert event.group_idx == (0 if length >= 10 else None)
    assert event.kv_cache_spec_kind == ("full_attention" if length >= 12 else None)


@pytest.mark.parametrize("length", [2, 3, 4, 6])
def test_legacy_block_removed_of_every_length(length: int) -> None:
    fields: list[Any] = ["BlockRemoved", [9], "CPU", 1, "x", "y"]
    (event,) = decode_batch(pack([1.0, [fields[:length]]])).events
    assert event == BlockRemoved((9,), "CPU" if length >= 3 else None, 1 if length >= 4 else None)


def test_outer_forms_unknown_keys_and_tags() -> None:
    event_map = {"type": "BlockRemoved", "block_hashes": [2**64 - 1], "medium": "GPU", "ownership": "x",
                 "future_key": [1, 2]}
    two = decode_batch(pack([3, [event_map]]))
    assert two.ts == 3.0 and two.data_parallel_rank is None
    assert two.events == [BlockRemoved((2**64 - 1,), "GPU")]
    outer_map = decode_batch(pack({"ts": 1.0, "events": [event_map, ["Unknown", 1]], "data_parallel_rank": 2,
                                   "extra": True}))
    assert outer_map.events == two.events and outer_map.data_parallel_rank == 2
    skipped = decode_batch(pack([1.0, [{"type": "Compacted"}, ["AllBlocksCleared"]], 0, "trailing"]))
    assert skipped.events == [AllBlocksCleared()]
    bin16 = decode_batch(pack([1.0, [["BlockRemoved", [b"\x01" * 16], None]]]))
    assert bin16.events == [BlockRemoved((b"\x01" * 16,), None)]


def test_map_event_missing_optional_keys_are_nil() -> None:
    (event,) = decode_batch(pack([0.5, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [],
                                         "block_size": 16}], 0])).events
    assert event == BlockStored((1,), None, (), 16)


@pytest.mark.parametrize(("data", "message"), [
    (b"", "not a msgpack document"), (b"\xc1", "not a msgpack document"),
    (pack(5), "batch must be an array or a map, got int"),
    (pack([1.0]), r"batch array needs at least \[ts, events\], got 1 elements"),
    (pack(["x", []]), "ts must be a number, got str"), (pack([1.0, {}]), "events must be an array, got dict"),
    (pack([1.0, [7]]), "event must be an array or a map, got int"), (pack([1.0, [[]]]), "empty event array"),
    (pack([1.0, [["BlockRemoved", [-1], None]]]), "block hash must be uint64 or bin, got int"),
    (pack([1.0, [["BlockRemoved", ["h"], None]]]), "block hash must be uint64 or bin, got str"),
    (pack([1.0, [], "dp"]), "data_parallel_rank must be an int or nil, got str"),
    (pack([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": "abc"}]]), "token_ids must be an array of ints"),
    (pack([1.0, []]) + b"\x00", "not a msgpack document: .*extra data"),
])
def test_malformed_batches_raise_wire_format_error(data: bytes, message: str) -> None:
    with pytest.raises(WireFormatError, match=message):
        decode_batch(data)


# -- round trips and the msgspec cross-check -------------------------------------------------

HASH = st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=16, max_size=16), st.binary(min_size=32, max_size=32))
OPT_STR = st.one_of(st.none(), st.sampled_from(["GPU", "CPU", "CPU_OFFLOAD", "lora-x"]))
OPT_INT = st.one_of(st.none(), st.integers(0, 2**31))
EXTRA = st.one_of(st.none(), st.tuples(st.text(max_size=5), st.integers(0, 1000)), st.tuples(st.binary(max_size=4)))


@st.composite
def stored_events(draw: st.DrawFn) -> BlockStored:
    hashes = draw(st.lists(HASH, max_size=4))
    return BlockStored(
        block_hashes=tuple(hashes), parent_block_hash=draw(st.one_of(st.none(), HASH)),
        token_ids=tuple(draw(st.lists(st.integers(0, 2**32 - 1), max_size=20))),
        block_size=draw(st.integers(0, 64)), lora_id=draw(OPT_INT), medium=draw(OPT_STR),
        lora_name=draw(OPT_STR),
        extra_keys=draw(st.one_of(st.none(), st.lists(EXTRA, min_size=len(hashes), max_size=len(hashes)).map(tuple))),
        group_idx=draw(OPT_INT), kv_cache_spec_kind=draw(st.one_of(st.none(), st.just("full_attention"))),
        kv_cache_spec_sliding_window=draw(OPT_INT), locality=draw(st.one_of(st.none(), st.just("LOCAL"))))


EVENTS = st.one_of(stored_events(),
                   st.builds(BlockRemoved, st.lists(HASH, max_size=3).map(tuple), OPT_STR, OPT_INT,
                             st.one_of(st.none(), st.just("REMOTE"))),
                   st.just(AllBlocksCleared()))
BATCHES = st.builds(KVEventBatch, st.floats(allow_nan=False), st.lists(EVENTS, max_size=4),
                    st.one_of(st.none(), st.integers(0, 64)))


@settings(max_examples=120, deadline=None)
@given(BATCHES)
def test_map_mode_round_trips(batch: KVEventBatch) -> None:
    assert decode_batch(encode_batch(batch)) == batch
    data = encode_batch(batch)
    assert encode_batch(decode_batch(data)) == data


def _legacy_view(batch: KVEventBatch) -> KVEventBatch:
    """What array mode can carry: no locality, no pdserve medium on AllBlocksCleared."""
    events: list[Any] = []
    for e in batch.events:
        if isinstance(e, BlockStored | BlockRemoved):
            events.append(dataclasses.replace(e, locality=None))
        else:
            events.append(AllBlocksCleared())
    return KVEventBatch(batch.ts, events, batch.data_parallel_rank)


@settings(max_examples=80, deadline=None)
@given(BATCHES)
def test_legacy_mode_round_trips(batch: KVEventBatch) -> None:
    assert decode_batch(encode_batch(batch, legacy=True)) == _legacy_view(batch)


_STORED_FIELDS = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                  "locality"]


def _msgspec_reference(legacy: bool) -> tuple[Any, Any]:
    """msgspec structs declared the way vLLM declares its events (reference spec §1.1-1.2);
    array mode predates `locality`."""
    msgspec = pytest.importorskip("msgspec")
    Hash = int | bytes
    opts: dict[str, Any] = {"omit_defaults": True, "gc": False, "tag": True, "array_like": legacy}
    stored_types: list[Any] = [list[Hash], Hash | None, list[int], int, int | None, str | None, str | None,
                               list[tuple[Any, ...] | None] | None, int | None, str | None, int | None,
                               str | None]
    stored_fields = _STORED_FIELDS[:-1] if legacy else _STORED_FIELDS
    stored = msgspec.defstruct("BlockStored", [
        (name, typ) if i < 7 else (name, typ, None)
        for i, (name, typ) in enumerate(zip(stored_fields, stored_types, strict=False))], **opts)
    removed_fields: list[Any] = [("block_hashes", list[Hash]), ("medium", str | None), ("group_idx", int | None, None)]
    if not legacy:
        removed_fields.append(("locality", str | None, None))
    removed = msgspec.defstruct("BlockRemoved", removed_fields, **opts)
    cleared = msgspec.defstruct("AllBlocksCleared", [], **opts)
    batch_type = msgspec.defstruct("KVEventBatch", [("ts", float), ("events", list[Any]),
                                                    ("data_parallel_rank", int | None, None)],
                                   array_like=True, omit_defaults=True, gc=False)

    def plain(v: Any) -> Any:
        return list(v) if isinstance(v, tuple) else v

    def convert(batch: KVEventBatch) -> Any:
        events: list[Any] = []
        for e in batch.events:
            if isinstance(e, BlockStored):
                events.append(stored(*[plain(getattr(e, n)) for n in stored_fields]))
            elif isinstance(e, BlockRemoved):
                events.append(removed(*[plain(getattr(e, f[0])) for f in removed_fields]))
            else:
                events.append(cleared())
        return batch_type(batch.ts, events, batch.data_parallel_rank)

    return msgspec.msgpack.Encoder(), convert


@pytest.mark.parametrize("legacy", [False, True])
@settings(max_examples=60, deadline=None)
@given(batch=BATCHES)
def test_byte_identical_to_msgspec(legacy: bool, batch: KVEventBatch) -> None:
    encoder, convert = _msgspec_reference(legacy)
    batch = _legacy_view(batch) if legacy else batch
    assert encode_batch(batch, legacy=legacy) == encoder.encode(convert(batch))
