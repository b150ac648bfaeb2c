"""The vLLM connector's worker half without vLLM: two halves (prefill, decode) over vLLM-shaped CPU
KV tensors, real UCX between them in one process, no scheduler (rank 0 never connects; the test
drains what the control stream would). A finished prompt's blocks are gathered and pinned, pulled
as runs, scattered into the decode side's tensors, and reported to vLLM exactly once. About 5 s.

The halves get per-layer tensors of their own (not one allocation with per-layer views, as vLLM
allocates), so they run on the explicit `kv_staging="host"` fallback (the bounded pool, copies on
its stager thread); the in-place path is tested
with vLLM-shaped allocations in tests/integration/ucx/test_ucx_vllm_layouts.py."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from connectors.ucx.handshake import KVTransferDescriptor
from connectors.vllm.params import (
    CancelSpec,
    PdserveConnectorConfig,
    PdserveConnectorMetadata,
    PullSpec,
    SendSpec,
)
from connectors.vllm.worker import ModelShape, VllmFinished, VllmWorkerHalf

N, H, B, D, L = 12, 2, 32, 8, 3
MODEL = ModelShape("LlamaForCausalLM", 100, 64, L, H, D, "float32")


def caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(N, H, B, 2 * D, generator=g) for i in range(L)}


def half(role: str, kv: dict[str, torch.Tensor], pool: int = 0) -> VllmWorkerHalf:
    config = PdserveConnectorConfig(engine_id=f"{role}-0", role=role, epoch=11 if role == "prefill" else 13,
                                    scheduler="127.0.0.1:1", transfer_timeout_s=3.0, kv_staging="host",
                                    kv_staging_blocks=pool)
    w = VllmWorkerHalf(config, rank=0, tp_size=1, model=MODEL, block_size=B)
    w.register_kv_caches(kv)
    return w


def drain_until(workers: list[VllmWorkerHalf], done: object, timeout: float = 10.0) -> list[VllmFinished]:
    deadline = time.monotonic() + timeout
    seen = [VllmFinished() for _ in workers]
    while time.monotonic() < deadline:
        for w, acc in zip(workers, seen, strict=True):
            assert w.agent is not None
            w.agent._drain_once()  # what the drain thread does once connected
            got = w.take_finished()
            acc.finished_sending |= got.finished_sending
            acc.finished_recving |= got.finished_recving
            acc.failed_recving |= got.failed_recving
            acc.invalid_block_ids |= got.invalid_block_ids
        if done(seen):  # type: ignore[operator]
            return seen
        time.sleep(0.01)
    raise TimeoutError(f"not done: {seen}")


@pytest.fixture
def pair() -> Iterator[tuple[VllmWorkerHalf, VllmWorkerHalf, dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    p_kv, d_kv = caches(1), caches(2)
    p, d = half("prefill", p_kv), half("decode", d_kv)
    assert d.agent is not None and p.agent is not None
    d.agent.ucx.add_peer(p.agent.ucx.get_handshake_metadata())
    yield p, d, p_kv, d_kv
    p.shutdown()
    d.shutdown()


def test_pull_lands_in_vllm_tensors_and_each_side_reports_once(pair) -> None:  # type: ignore[no-untyped-def]
    p, d, p_kv, d_kv = pair
    p.start_load_kv(PdserveConnectorMetadata(sends=[SendSpec("r1-x", "r1", (3, 4, 9))]))
    p.wait_for_save()  # gathers and pins (after the forward in vLLM)
    descriptor = KVTransferDescriptor("prefill-0", 11, "r1", (3, 4, 9), 3 * B - 5, 1, B, H)
    d.start_load_kv(PdserveConnectorMetadata(pulls=[PullSpec("r1-y", "r1", descriptor, (7, 8), True)]))
    seen = drain_until([p, d], lambda s: s[0].finished_sending and s[1].finished_recving)
    assert seen[0].finished_sending == {"r1-x"} and seen[1].finished_recving == {"r1-y"}
    assert not seen[1].failed_recving and not seen[1].invalid_block_ids
    for name in p_kv:  # the last two remote blocks (after a one-block local hit) arrived
        assert torch.equal(d_kv[name][[7, 8]], p_kv[name][[4, 9]])
    again = drain_until([p, d], lambda s: True)
    assert again[0].finished_sending == set() and again[1].finished_recving == set()
    assert p.leaks() == [] and d.leaks() == []


def test_a_pull_of_three_pools_lands_in_vllm_tensors_in_chunk_pulls() -> None:
    p_kv, d_kv = caches(1), caches(2)
    p, d = half("prefill", p_kv, pool=2), half("decode", d_kv, pool=2)  # 2-slot pools, a 6-block pull
    try:
        assert d.agent is not None and p.agent is not None
        d.agent.ucx.add_peer(p.agent.ucx.get_handshake_metadata())
        remote, local = (0, 1, 2, 3, 4, 5), (6, 7, 8, 9, 10, 11)
        p.start_load_kv(PdserveConnectorMetadata(sends=[SendSpec("c-x", "c", remote)]))
        p.wait_for_save()
        descriptor = KVTransferDescriptor("prefill-0", 11, "c", remote, 6 * B, 1, B, H)
        d.start_load_kv(PdserveConnectorMetadata(pulls=[PullSpec("c-y", "c", descriptor, local, True)]))
        seen = drain_until([p, d], lambda s: s[0].finished_sending and s[1].finished_recving)
        assert seen[0].finished_sending == {"c-x"} and seen[1].finished_recving == {"c-y"}
        assert not seen[1].failed_recving and not seen[1].invalid_block_ids
        for name in p_kv:
            assert torch.equal(d_kv[name][list(local)], p_kv[name][list(remote)])
        assert p.leaks() == [] and d.leaks() == []
        assert p.agent.ucx.staging_slots()[0] == 0 == d.agent.ucx.staging_slots()[0]
    finally:
        p.shutdown()
        d.shutdown()


def test_released_or_cancelled_prefill_reports_sent_once_and_unpins(pair) -> None:  # type: ignore[no-untyped-def]
    p, d, _, _ = pair
    p.start_load_kv(PdserveConnectorMetadata(sends=[SendSpec("a-x", "a", (1,)), SendSpec("b-x", "b", (2,))]))
    p.wait_for_save()
    assert p.num_pinned() == 2
    assert p.release("a") and not p.release("nope")
    p.start_load_kv(PdserveConnectorMetadata(cancels=[CancelSpec("b-x", "b")]))
    seen = drain_until([p], lambda s: len(s[0].finished_sending) == 2)
    assert seen[0].finished_sending == {"a-x", "b-x"}
    assert p.leaks() == []


def test_rank0_keeps_the_role_changes_its_agent_took_for_the_engine_service(pair) -> None:  # type: ignore[no-untyped-def]
    """Decision 0047: a SetRole reaches the rank's agent (next role generation only) and rank 0
    keeps it, in order, for the engine service that admits calls by role."""
    from services.engine.control_client import SetRole

    p, _, _, _ = pair
    assert p.agent is not None
    for msg in (SetRole("decode", 1, "to decode"), SetRole("mixed", 3, "skips one"), SetRole("mixed", 2, "")):
        p.agent._on_message(msg)
    assert p.agent.identity.role == "mixed" and p.agent.role_epoch == 2
    assert p.role_changes(0) == [("decode", 1, "to decode"), ("mixed", 2, "")]
    assert p.role_changes(1) == [("mixed", 2, "")] and p.role_changes(2) == []


def test_failed_pull_is_reported_received_with_its_invalid_blocks(pair) -> None:  # type: ignore[no-untyped-def]
    p, d, _, _ = pair
    # Nothing pinned on the prefill side: the pull is refused, vLLM hears it failed and recomputes.
    descriptor = KVTransferDescriptor("prefill-0", 11, "r2", (5, 6), 2 * B, 1, B, H)
    d.start_load_kv(PdserveConnectorMetadata(pulls=[PullSpec("r2-y", "r2", descriptor, (0, 1), True)]))
    seen = drain_until([d], lambda s: s[0].finished_recving)
    assert seen[0].finished_recving == {"r2-y"} and seen[0].failed_recving == {"r2-y"}
    assert seen[0].invalid_block_ids == {0, 1}
    assert d.leaks() == []


def test_rank0_serves_the_engine_load_it_is_handed_on_metrics() -> None:
    import socket
    import urllib.request

    from services.engine.control_client import EngineLoad

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = PdserveConnectorConfig(engine_id="decode-9", role="decode", epoch=5, scheduler="127.0.0.1:1",
                                    metrics_port=port, kv_staging="host", kv_staging_blocks=4)
    w = VllmWorkerHalf(config, rank=0, tp_size=1, model=MODEL, block_size=B)
    w.register_kv_caches(caches(3))
    try:
        w.report_load(EngineLoad(3, 2, 0.25, 1, 9), draining=False)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        w.shutdown()
    assert 'pdserve_engine_running_requests{engine="decode-9",role="decode"} 3.0' in text
    assert 'pdserve_engine_kv_cache_usage_ratio{engine="decode-9",role="decode"} 0.25' in text
    # Host staging registers its bounded pool (4 blocks of the 12-block cache), reported as the mirror.
    pool = 4 * H * L * 2 * B * D * 4
    mirror = [line for line in text.splitlines() if line.startswith("pdserve_engine_kv_mirror_bytes{")]
    assert mirror and all(float(line.rsplit(" ", 1)[1]) == pool for line in mirror), mirror
