"""The NIXL transport's descriptor lists and address blob, and the refusal of a pair of engines
on different KV transports (pure, plus one in-process tag connector: about 2 s). NIXL itself is
never loaded here (see `nixl_importable`)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
import torch

from connectors.ucx.config import UcxConnectorConfig
from connectors.ucx.handshake import UcxHandshakeMetadata
from connectors.ucx.nixl_transport import (
    NixlAddress,
    NixlMemory,
    block_indices,
    descriptor_rows,
    head_span,
    strided_list,
    vram_problem,
)
from connectors.ucx.transport import HeadGeometry, Segment
from connectors.ucx.worker import UcxWorkerConnector
from services.common.config import EngineConfig


def test_a_head_range_of_n_blocks_is_one_descriptor_per_block_at_the_right_addresses() -> None:
    # 2 -> 1 with 4 KV heads: the writer (prefill rank 1 of 2) holds heads 2-3, blocks of 2 heads
    # x 100 bytes; the reader (tp 1) holds all 4 (blocks of 400 bytes) and receives the writer's
    # local heads 0-1 as its heads 2-3.
    writer, reader = HeadGeometry(2, 100), HeadGeometry(4, 100)
    seg = Segment(remote_block=7, local_block=3, num_blocks=5, remote_head=0, local_head=2, num_heads=2)
    remote = descriptor_rows((seg,), writer, 10_000, remote=True)
    local = descriptor_rows((seg,), reader, 50_000, remote=False)
    assert remote.dtype == local.dtype == np.uint64 and remote.shape == local.shape == (5, 3)
    assert remote.tolist() == [[10_000 + (7 + b) * 200, 200, 0] for b in range(5)]  # whole writer blocks
    assert local.tolist() == [[50_000 + (3 + b) * 400 + 200, 200, 0] for b in range(5)]  # heads 2-3 of each
    # A sub-range of the writer's heads (1 -> 2 split: reader rank 1 takes heads 2-3 of 4).
    split = Segment(remote_block=0, local_block=9, num_blocks=3, remote_head=2, local_head=0, num_heads=2)
    assert descriptor_rows((split,), reader, 0, remote=True).tolist() == [[b * 400 + 200, 200, 0] for b in range(3)]
    assert descriptor_rows((split,), writer, 0, remote=False).tolist() == [[(9 + b) * 200, 200, 0] for b in range(3)]


def test_whole_block_runs_are_one_descriptor_each_in_segment_order() -> None:
    geometry = HeadGeometry(2, 100)
    segs = (Segment(4, 0, 3), Segment(20, 3, 1))
    assert descriptor_rows(segs, geometry, 1000, remote=True).tolist() == [[1000 + 800, 600, 0], [1000 + 4000, 200, 0]]
    assert descriptor_rows(segs, geometry, 0, remote=False).tolist() == [[0, 600, 0], [600, 200, 0]]


def test_a_prepared_list_is_one_strided_row_of_a_head_range_per_block() -> None:
    geometry = HeadGeometry(4, 100)  # blocks of 400 bytes
    assert strided_list(10_000, geometry, 32, 2, 2).tolist() == [[10_200, 200, 0, 400, 32]]  # heads 2-3
    assert strided_list(0, geometry, 8, 0, 4).tolist() == [[0, 400, 0, 400, 8]]  # whole blocks
    assert strided_list(0, geometry, 8, 0, 4).dtype == np.uint64


def test_block_indices_follow_the_segments_in_wire_order_on_each_side() -> None:
    segs = (Segment(7, 3, 3, 0, 2, 2), Segment(1, 10, 2, 0, 2, 2), Segment(40, 0, 1, 0, 2, 2))
    remote, local = block_indices(segs, remote=True), block_indices(segs, remote=False)
    assert remote.dtype == local.dtype == np.int32
    assert remote.tolist() == [7, 8, 9, 1, 2, 40] and local.tolist() == [3, 4, 5, 10, 11, 0]
    # Row i of the one-off descriptor lists is index i of the prepared ones.
    writer, reader = HeadGeometry(2, 100), HeadGeometry(4, 100)
    assert descriptor_rows(segs, reader, 0, remote=False)[:, 0].tolist() == [int(i) * 400 + 200 for i in local]
    assert descriptor_rows(segs, writer, 0, remote=True)[:, 0].tolist() == [int(i) * 200 for i in remote]


def test_one_head_range_for_all_segments_or_none() -> None:
    assert head_span((Segment(0, 0, 2, 1, 0, 1), Segment(5, 9, 1, 1, 0, 1))) == (1, 0, 1)
    assert head_span((Segment(0, 0, 2), Segment(5, 9, 1))) == (0, 0, 0)  # whole blocks
    assert head_span((Segment(0, 0, 2, 1, 0, 1), Segment(5, 9, 1, 0, 0, 1))) is None
    assert head_span((Segment(0, 0, 2), Segment(5, 9, 1, 0, 0, 1))) is None


def test_the_address_blob_round_trips_and_a_tag_address_is_refused_with_the_reason() -> None:
    address = NixlAddress(b"ucx-address", b"nixl-metadata", 4096, 1 << 20, HeadGeometry(2, 640))
    assert NixlAddress.decode(address.encode()) == address
    with pytest.raises(ValueError, match="not a nixl transport address .* --kv-transport ucx-tag"):
        NixlAddress.decode(b"\x01" * 200)  # a UCX worker address, as a ucx-tag peer publishes
    with pytest.raises(ValueError, match="malformed nixl transport address"):
        NixlAddress.decode(msgpack.packb({"ucx": b"a", "nixl": b"m", "base": -1, "nbytes": 1, "heads": 1,
                                          "head_nbytes": 1}))


def test_the_kv_transport_is_a_config_choice_with_a_reason() -> None:
    with pytest.raises(ValueError, match="kv_transport: must be one of ucx-tag, nixl, got 'rdma'"):
        UcxConnectorConfig(kv_transport="rdma").validate()
    with pytest.raises(ValueError, match="kv_transport: must be ucx-tag or nixl, got 'rdma'"):
        EngineConfig(kv_transport="rdma").validate()
    with pytest.raises(ValueError, match="kv_transport: nixl is wired up for the native engine only"):
        EngineConfig(engine="vllm", kv_transport="nixl").validate()


def test_the_kv_transport_is_in_the_compatibility_hash() -> None:
    from engine.config import ModelConfig
    from engine.kv_cache import make_kv_cache_spec
    from services.engine.rank_agent import compatibility_hash

    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0}
    config = ModelConfig.from_dict(raw, dtype="float32")
    spec = make_kv_cache_spec(config, block_size=16, memory_bytes=1 << 20)
    tag = compatibility_hash(config, spec, "s")
    nixl = compatibility_hash(config, spec, "s", "nixl")
    assert compatibility_hash(config, spec, "s", "ucx-tag") == tag != nixl

    # The scheduler refuses the second engine at registration, and its reason names the setting.
    from services.scheduler.registry import EngineRegistry, RankHello, RegistrationError, Role

    registry = EngineRegistry(block_size=16, hash_seed="s", heartbeat_timeout_s=5.0)

    def rank_hello(engine_id: str, compat: str) -> RankHello:
        return RankHello(engine_id=engine_id, role=Role.PREFILL, epoch=1, tp_rank=0, tp_size=1,
                         compatibility_hash=compat, engine_address="127.0.0.1:9000", handshake_metadata=b"m")

    registry.register(rank_hello("tag", tag))
    with pytest.raises(RegistrationError, match=r"compatibility hash .*KV transport \(--kv-transport\)"):
        registry.register(rank_hello("nixl", nixl))
    assert registry.engine("nixl") is None


def test_a_pair_on_different_kv_transports_is_refused_with_the_reason() -> None:
    # Pure: the real pair (one rank process on each transport) is in tests/integration/ucx/
    # test_ucx_hetero_tp.py; NIXL is not loaded into the test process.
    kv = torch.zeros(8, 2, 2, 2, 4, 8)
    tag = UcxWorkerConnector(engine_id="decode-tag", epoch=1, tp_rank=0, tp_size=1, num_kv_heads=2,
                             compatibility_hash="h", kv_cache=kv)
    try:
        mine = tag.handshake_metadata
        assert mine.kv_transport == "ucx-tag"
        nixl_peer = dataclasses.replace(mine, engine_id="prefill-nixl", kv_transport="nixl")
        reason = ("moves KV with --kv-transport nixl, this engine with ucx-tag: both engines of a pair "
                  "must use the same KV transport")
        with pytest.raises(ValueError, match=reason):
            tag.add_peer(nixl_peer.encode())
        with pytest.raises(ValueError, match=reason):
            tag.add_peer(nixl_peer)  # decoded already: checked again
        with pytest.raises(ValueError, match="--kv-transport ucx-tag, this engine with nixl"):
            UcxHandshakeMetadata.decode(mine.encode(), expected_hash="h", expected_transport="nixl")
        assert UcxHandshakeMetadata.decode(nixl_peer.encode(), expected_transport="nixl") == nixl_peer
        # A metadata body claiming another transport than its envelope is malformed.
        outer = msgpack.unpackb(nixl_peer.encode(), raw=False)
        outer["transport"] = "ucx-tag"
        with pytest.raises(ValueError, match="envelope and body KV transports differ"):
            UcxHandshakeMetadata.decode(msgpack.packb(outer, use_bin_type=True), expected_transport="ucx-tag")
        assert tag.get_transfer_results().failed_recving == set()  # nothing changed
    finally:
        tag.shutdown()


def test_nixl_asked_for_and_missing_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from connectors.ucx.nixl_transport import NixlUnavailable, require_nixl

    monkeypatch.setitem(sys.modules, "nixl_cu12", None)  # None in sys.modules: import fails
    monkeypatch.setitem(sys.modules, "nixl", None)
    with pytest.raises(NixlUnavailable, match=r"--kv-transport nixl needs the nixl-cu12 package \(pip install "):
        require_nixl()
    with pytest.raises(NixlUnavailable, match="nixl-cu12"):
        _connector_on_nixl()


def _connector_on_nixl() -> UcxWorkerConnector:
    return UcxWorkerConnector(engine_id="decode-n", epoch=1, tp_rank=0, tp_size=1, num_kv_heads=2,
                              compatibility_hash="h", kv_cache=torch.zeros(8, 2, 2, 2, 4, 8),
                              config=UcxConnectorConfig(kv_transport="nixl"))


class _CudaStandIn:
    """A flat uint8 CUDA array as NIXL's transport sees one (no GPU here): its interface and device."""

    def __init__(self, address: int, nbytes: int, index: int) -> None:
        self.__cuda_array_interface__ = {"data": (address, False), "shape": (nbytes,), "typestr": "|u1",
                                         "strides": None, "version": 3}
        self.device = SimpleNamespace(type="cuda", index=index)


def test_a_gpu_region_is_vram_with_its_device_id_in_every_descriptor() -> None:
    host = np.zeros(4096, dtype=np.uint8)
    assert NixlMemory.of(host) == NixlMemory("DRAM", 0, int(host.ctypes.data), 4096)
    gpu = NixlMemory.of(_CudaStandIn(0x7F00_0000_0000, 8192, index=3))
    assert gpu == NixlMemory("VRAM", 3, 0x7F00_0000_0000, 8192)
    geometry = HeadGeometry(2, 100)
    rows = descriptor_rows((Segment(4, 1, 2),), geometry, gpu.base, remote=False, device=gpu.device)
    assert rows.tolist() == [[gpu.base + 200, 400, 3]]
    assert strided_list(gpu.base, geometry, 8, 0, 2, gpu.device).tolist() == [[gpu.base, 200, 3, 200, 8]]
    with pytest.raises(ValueError, match="CUDA device"):
        NixlMemory.of(_CudaStandIn(0x1000, 16, index=None))  # type: ignore[arg-type]


def test_the_address_says_where_the_region_lies_and_an_older_one_reads_as_host_memory() -> None:
    address = NixlAddress(b"u", b"m", 1 << 40, 1 << 20, HeadGeometry(2, 640), "VRAM", 1)
    assert NixlAddress.decode(address.encode()) == address
    old = msgpack.packb({"ucx": b"u", "nixl": b"m", "base": 1, "nbytes": 2, "heads": 1, "head_nbytes": 2})
    decoded = NixlAddress.decode(old)
    assert (decoded.mem_type, decoded.device) == ("DRAM", 0)
    with pytest.raises(ValueError, match="malformed"):
        NixlAddress.decode(msgpack.packb({"ucx": b"u", "nixl": b"m", "base": 1, "nbytes": 2, "heads": 1,
                                          "head_nbytes": 2, "mem": "FILE"}))


def test_a_nixl_build_that_cannot_move_gpu_memory_is_refused_with_the_reason() -> None:
    cuda_ucx = ["libuct_cma.so.0", "libuct_cuda.so.0"]
    assert vram_problem("nixl_cu12", "12.8", ["DRAM_SEG", "VRAM_SEG"], cuda_ucx) is None
    assert vram_problem("nixl", "13.0", ["DRAM_SEG", "VRAM_SEG"], []) is None  # system UCX: not known
    assert "registers no GPU memory" in (vram_problem("nixl_cu12", "12.8", ["DRAM_SEG"], cuda_ucx) or "")
    assert "UCX without CUDA" in (vram_problem("nixl_cu12", "12.8", ["VRAM_SEG"], ["libuct_cma.so.0"]) or "")
    mismatch = vram_problem("nixl_cu12", "13.0", ["DRAM_SEG", "VRAM_SEG"], cuda_ucx) or ""
    assert "built for CUDA 12" in mismatch and "install nixl-cu13" in mismatch
