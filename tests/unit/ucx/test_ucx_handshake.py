"""Handshake metadata, segment coalescing, tags and in-process connector validation."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import msgpack
import pytest
import torch

from connectors.base import create_worker_connector, registered_connectors
from connectors.ucx.config import DEFAULT_UCX_TLS, UcxConnectorConfig
from connectors.ucx.handshake import (
    HANDSHAKE_VERSION,
    KVRegionLayout,
    KVTransferDescriptor,
    PeerKey,
    UcxHandshakeMetadata,
)
from connectors.ucx.tag_transport import MAX_SEGMENTS, data_tag, split_data_tag
from connectors.ucx.transport import Segment, coalesce
from connectors.ucx.worker import UcxWorkerConnector


def region(**over: object) -> KVRegionLayout:
    base = {"num_blocks": 64, "block_nbytes": 2 * 2 * 2 * 4 * 8 * 4, "num_layers": 2, "block_size": 4,
            "head_dim": 8, "num_kv_heads": 4, "head_start": 2, "head_end": 4, "dtype": "float32"}
    return KVRegionLayout(**{**base, **over})  # type: ignore[arg-type]


def metadata(**over: object) -> UcxHandshakeMetadata:
    base = {"engine_id": "prefill-a", "epoch": 2**63 + 5, "tp_rank": 1, "tp_size": 2, "compatibility_hash": "h1",
            "worker_address": b"\x01" * 200, "region": region()}
    return UcxHandshakeMetadata(**{**base, **over})  # type: ignore[arg-type]


def test_metadata_round_trips() -> None:
    meta = metadata()
    assert UcxHandshakeMetadata.decode(meta.encode(), expected_hash="h1") == meta
    gpu = metadata(region=region(memory_type="cuda"))
    assert UcxHandshakeMetadata.decode(gpu.encode(), expected_hash="h1").region.memory_type == "cuda"


def test_metadata_of_a_peer_that_states_no_memory_type_is_host_memory() -> None:
    body = dataclasses.asdict(metadata())
    del body["region"]["memory_type"]
    blob = msgpack.packb({"v": HANDSHAKE_VERSION, "hash": "h1", "meta": msgpack.packb(body)})
    assert UcxHandshakeMetadata.decode(blob, expected_hash="h1").region.memory_type == "cpu"


@pytest.mark.parametrize(("blob", "message"), [
    (b"\xc1", "not msgpack"),
    (msgpack.packb({"v": HANDSHAKE_VERSION + 1, "hash": "h1", "meta": b""}), "unsupported metadata version"),
    (msgpack.packb([1, 2]), "unsupported metadata version"),
    (msgpack.packb({"v": HANDSHAKE_VERSION, "hash": "h1", "meta": msgpack.packb({"engine_id": "x"})}), "malformed"),
    (b"\x00" * 70_000, "exceeds"),
])
def test_malformed_metadata_is_refused_with_a_reason(blob: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        UcxHandshakeMetadata.decode(blob, expected_hash="h1")


def test_compatibility_hash_is_checked_before_the_body() -> None:
    blob = msgpack.packb({"v": HANDSHAKE_VERSION, "hash": "other", "meta": b"garbage"})
    with pytest.raises(ValueError, match="compatibility hash"):
        UcxHandshakeMetadata.decode(blob, expected_hash="h1")


@pytest.mark.parametrize(("over", "message"), [
    ({"tp_rank": 2}, "tp_rank"),
    ({"engine_id": ""}, "engine_id"),
    ({"worker_address": b""}, "worker_address"),
    ({"region": region(head_start=0, head_end=2)}, "must hold heads"),
    ({"region": region(block_nbytes=1000)}, "block_nbytes"),
    ({"region": region(layout="NHD")}, "layout"),
    ({"region": region(head_end=5)}, "heads"),
    ({"region": region(memory_type="tpu")}, "unknown KV memory type 'tpu'"),
])
def test_inconsistent_metadata_is_refused(over: dict[str, object], message: str) -> None:
    blob = metadata(**over).encode()
    with pytest.raises(ValueError, match=message):
        UcxHandshakeMetadata.decode(blob, expected_hash="h1")


def test_wrong_field_types_are_refused() -> None:
    body = dataclasses.asdict(metadata())
    body["epoch"] = "five"
    blob = msgpack.packb({"v": HANDSHAKE_VERSION, "hash": "h1", "meta": msgpack.packb(body)})
    with pytest.raises(ValueError, match="epoch"):
        UcxHandshakeMetadata.decode(blob, expected_hash="h1")


def test_coalesce_makes_runs_consecutive_on_both_sides() -> None:
    assert coalesce([4, 5, 6, 9, 10, 2], [0, 1, 2, 3, 7, 8]) == [
        Segment(4, 0, 3), Segment(9, 3, 1), Segment(10, 7, 1), Segment(2, 8, 1)]
    assert coalesce([], []) == []
    with pytest.raises(ValueError, match='1 remote blocks for 0 local blocks'):
        coalesce([1], [])


def test_data_tags_round_trip() -> None:
    for xfer, index in [(1, 0), (2**40 - 1, MAX_SEGMENTS - 1), (12345, 678)]:
        assert split_data_tag(data_tag(xfer, index)) == (xfer, index)
    assert data_tag(1, 0) >> 60 == 2


def test_config_validation_and_ucx_options(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad, message in (({"transfer_timeout_s": 0}, "transfer_timeout_s: must be > 0"),
                         ({"lease_s": -1}, "lease_s: must be > 0"),
                         ({"max_inflight_transfers": 0}, "max_inflight_transfers: must be >= 1")):
        with pytest.raises(ValueError, match=message):
            UcxConnectorConfig(**bad).validate()  # type: ignore[arg-type]
    monkeypatch.delenv("UCX_TLS", raising=False)
    assert UcxConnectorConfig().ucx_options() == {"TLS": DEFAULT_UCX_TLS}
    assert UcxConnectorConfig(ucx_tls="rc,sm", ucx_net_devices="mlx5_0:1").ucx_options() == {
        "TLS": "rc,sm", "NET_DEVICES": "mlx5_0:1"}
    monkeypatch.setenv("UCX_TLS", "tcp")
    assert UcxConnectorConfig().ucx_options() == {}


@pytest.fixture
def connector() -> Iterator[UcxWorkerConnector]:
    kv = torch.zeros(64, 2, 2, 2, 4, 8)
    c = UcxWorkerConnector(engine_id="decode-u", epoch=9, tp_rank=1, tp_size=2, num_kv_heads=4,
                           compatibility_hash="h1", kv_cache=kv)
    yield c
    c.shutdown()


def test_connector_publishes_its_layout(connector: UcxWorkerConnector) -> None:
    meta = UcxHandshakeMetadata.decode(connector.get_handshake_metadata(), expected_hash="h1")
    assert meta.region == region(num_blocks=64)
    assert (meta.engine_id, meta.epoch, meta.tp_rank, meta.tp_size) == ("decode-u", 9, 1, 2)
    assert meta.worker_address


def test_incompatible_peers_are_refused_and_change_nothing(connector: UcxWorkerConnector) -> None:
    with pytest.raises(ValueError, match="compatibility hash"):
        connector.add_peer(metadata(compatibility_hash="h2").encode())
    with pytest.raises(ValueError, match="layout differs"):
        connector.add_peer(metadata(region=region(block_size=8, block_nbytes=2 * 2 * 2 * 8 * 8 * 4)))
    desc = KVTransferDescriptor("prefill-a", 2**63 + 5, "r", (1, 2), 8, 2, 4, 4)
    connector.start_pull("r", desc, [3, 4])
    assert connector.get_transfer_results().failed_recving == {"r"}
    assert connector.take_failure_reasons() == {"r": "peer_unknown"}
    assert connector.get_block_ids_with_load_errors() == {3, 4}


def test_caller_errors_raise_without_state_change(connector: UcxWorkerConnector) -> None:
    desc = KVTransferDescriptor("prefill-a", 1, "r", (1, 2), 8, 2, 4, 4)
    for local, message in (([64, 1], r"local block ids must be distinct and in \[0, 64\)"), ([1, 1], "local block ids must be distinct"),
                           ([1, 2, 3], "3 local blocks for 2 remote blocks")):
        with pytest.raises(ValueError, match=message):
            connector.start_pull("r", desc, local)
    with pytest.raises(ValueError, match=r'request s: block ids must be in \[0, 64\)'):
        connector.expect_send("s", [64])
    with pytest.raises(ValueError, match='lease_s must be > 0 and num_readers >= 0'):
        connector.expect_send("s", [1], lease_s=0)
    assert connector.num_pending() == 0
    assert not connector.get_transfer_results().failed_recving
    connector.start_pull("empty", desc, [])  # full local hit: nothing to pull
    assert connector.get_transfer_results().finished_recving == {"empty"}


def test_registered_under_ucx() -> None:
    assert "ucx" in registered_connectors()
    c = create_worker_connector("ucx", engine_id="e", epoch=1, tp_rank=0, tp_size=1, num_kv_heads=2,
                                compatibility_hash="h")
    assert isinstance(c, UcxWorkerConnector)
    with pytest.raises(RuntimeError, match="register_kv_caches"):
        c.get_handshake_metadata()


def test_leases_expire_unless_a_live_reader_renews(connector: UcxWorkerConnector) -> None:
    connector.expect_send("kept", [1, 2], lease_s=0.2)
    connector.expect_send("dropped", [3], lease_s=0.2)
    reader = PeerKey("decode-x", 1, 0)
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:
        connector.on_renew(["kept", "unknown"], reader)  # what the transport calls on `renew`
        time.sleep(0.05)
    assert connector.get_transfer_results().finished_sending == {"dropped"}
    stats = connector.get_kv_connector_stats()
    assert stats is not None and stats.lease_expiries == 1
    assert connector.cancel("kept") and connector.num_pending() == 0


def test_shutdown_ends_every_pull_once_and_later_calls_are_harmless() -> None:
    prefill = UcxWorkerConnector(engine_id="prefill-s", epoch=3, tp_rank=0, tp_size=1, num_kv_heads=2,
                                 compatibility_hash="h1", kv_cache=torch.ones(64, 2, 2, 2, 4, 8))
    decode = UcxWorkerConnector(engine_id="decode-s", epoch=4, tp_rank=0, tp_size=1, num_kv_heads=2,
                                compatibility_hash="h1", kv_cache=torch.zeros(64, 2, 2, 2, 4, 8),
                                config=UcxConnectorConfig(max_inflight_transfers=1))
    try:
        decode.add_peer(prefill.get_handshake_metadata())
        ids = [f"s{i}" for i in range(4)]
        for i, rid in enumerate(ids):
            prefill.expect_send(rid, [i])
            decode.start_pull(rid, KVTransferDescriptor("prefill-s", 3, rid, (i,), 4, 1, 4, 2), [10 + i])
        decode.shutdown()
        results = decode.get_transfer_results()
        assert sorted(results.finished_recving | results.failed_recving) == ids
        assert not results.finished_recving & results.failed_recving
        assert set(decode.take_failure_reasons().values()) <= {"shutdown"}
        decode.remove_peer("prefill-s")
        assert not decode.cancel("s0")
        assert decode.num_pending() == 0
    finally:
        decode.shutdown()
        prefill.shutdown()


def test_engines_of_different_kv_layouts_never_pair(connector: UcxWorkerConnector) -> None:
    # The layout is in the compatibility hash (engines of another layout are refused before their
    # metadata is read) and in the metadata itself (refused even under an equal hash).
    from engine.config import KV_LAYOUT, ModelConfig
    from engine.kv_cache import make_kv_cache_spec
    from services.engine.rank_agent import compatibility_hash

    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0}
    config = ModelConfig.from_dict(raw, dtype="float32")
    spec = make_kv_cache_spec(config, block_size=16, memory_bytes=1 << 20)
    assert spec.layout == KV_LAYOUT == connector.handshake_metadata.region.layout == "NHL2BD"
    old = dataclasses.replace(spec, layout="NL2HBD")
    assert compatibility_hash(config, spec, "s") != compatibility_hash(config, old, "s")
    with pytest.raises(ValueError, match="unsupported KV layout 'NL2HBD' \\(expected one of \\('NHL2BD'"):
        connector.add_peer(metadata(region=region(layout="NL2HBD")))
    with pytest.raises(ValueError, match="unsupported KV layout 'NL2HBD'"):
        connector.add_peer(metadata(region=region(layout="NL2HBD")).encode())
    desc = KVTransferDescriptor("prefill-a", 2**63 + 5, "r", (1, 2), 8, 2, 4, 4)
    connector.start_pull("r", desc, [3, 4])  # no peer was added
    assert connector.get_transfer_results().failed_recving == {"r"}
    assert connector.take_failure_reasons() == {"r": "peer_unknown"}


def test_chunked_pull_fields_round_trip_and_an_older_peer_reads_as_unchunked() -> None:
    meta = metadata(chunked_pulls=True, max_pull_blocks=48)
    assert UcxHandshakeMetadata.decode(meta.encode(), expected_hash="h1") == meta
    body = {k: v for k, v in dataclasses.asdict(metadata()).items() if k not in ("chunked_pulls", "max_pull_blocks")}
    old = msgpack.packb({"v": HANDSHAKE_VERSION, "hash": "h1", "meta": msgpack.packb(body, use_bin_type=True)},
                        use_bin_type=True)
    decoded = UcxHandshakeMetadata.decode(old, expected_hash="h1")
    assert (decoded.chunked_pulls, decoded.max_pull_blocks) == (False, 0)
    with pytest.raises(ValueError, match="max_pull_blocks"):
        UcxHandshakeMetadata.decode(metadata(max_pull_blocks=-1).encode(), expected_hash="h1")


def test_split_segments_cuts_runs_into_chunks_in_order_keeping_head_ranges() -> None:
    from connectors.ucx.transport import split_segments

    segments = (Segment(10, 0, 5, 1, 0, 2), Segment(40, 20, 1, 1, 0, 2), Segment(50, 30, 6, 1, 0, 2))
    chunks = split_segments(segments, 4)
    assert [sum(s.num_blocks for s in c) for c in chunks] == [4, 4, 4]
    flat = [(s.remote_block + i, s.local_block + i) for c in chunks for s in c for i in range(s.num_blocks)]
    assert flat == [(s.remote_block + i, s.local_block + i) for s in segments for i in range(s.num_blocks)]
    assert all((s.remote_head, s.local_head, s.num_heads) == (1, 0, 2) for c in chunks for s in c)
    assert chunks[1] == (Segment(14, 4, 1, 1, 0, 2), Segment(40, 20, 1, 1, 0, 2), Segment(50, 30, 2, 1, 0, 2))
    assert split_segments(segments, 100) == [segments]
    with pytest.raises(ValueError, match="max_blocks must be >= 1, got 0"):
        split_segments(segments, 0)


def test_a_pull_larger_than_the_pool_from_a_writer_of_an_older_build_fails_at_once_with_the_reason() -> None:
    """An older writer counts one `done` per reader, so no chunk pulls go to it: the pull fails
    as before (nothing queued, nothing staged)."""
    staged = UcxConnectorConfig(kv_staging="host", kv_staging_blocks=4)
    prefill = UcxWorkerConnector(engine_id="prefill-o", epoch=3, tp_rank=0, tp_size=1, num_kv_heads=2,
                                 compatibility_hash="h1", kv_cache=torch.ones(64, 2, 2, 2, 4, 8))
    decode = UcxWorkerConnector(engine_id="decode-o", epoch=4, tp_rank=0, tp_size=1, num_kv_heads=2,
                                compatibility_hash="h1", kv_cache=torch.zeros(64, 2, 2, 2, 4, 8), config=staged)
    try:
        meta = UcxHandshakeMetadata.decode(prefill.get_handshake_metadata(), expected_hash="h1")
        assert (meta.chunked_pulls, meta.max_pull_blocks) == (True, 0)
        assert decode.handshake_metadata.max_pull_blocks == 4
        decode.add_peer(dataclasses.replace(meta, chunked_pulls=False))
        decode.start_pull("old", KVTransferDescriptor("prefill-o", 3, "old", tuple(range(10)), 40, 1, 4, 2),
                          list(range(10)))
        assert decode.get_transfer_results().failed_recving == {"old"}
        assert decode.take_failure_reasons() == {"old": "staging_pool_too_small"}
        assert decode.get_block_ids_with_load_errors() == set(range(10))
        assert decode.num_pending() == 0 and decode.staging_slots() == (0, 4, 0)
    finally:
        decode.shutdown()
        prefill.shutdown()
