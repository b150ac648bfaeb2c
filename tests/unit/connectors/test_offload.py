"""CPU offload tier with plain torch tensors in the contracts.md layout, two ranks, the engine's
StepPlan, and the aggregator between the ranks and the published events."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from connectors.aggregator import KVOutputAggregator
from connectors.base import collect_output, create_scheduler_connector, create_worker_connector
from connectors.hashing import BlockHasher, to_external
from connectors.kv_events import MEDIUM_CPU_OFFLOAD, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from connectors.offload import (
    BlockLoad,
    OffloadMetadata,
    OffloadRankInit,
    OffloadScheduler,
    OffloadWorker,
    build_offload,
    num_cpu_blocks_for,
    offload_medium,
)
from engine.batch_scheduler import ScheduledChunk, StepPlan

BS = 4  # tokens per block
SHAPE = (16, 2, 2, 1, BS, 3)  # [num_blocks, layers, K/V, heads per rank, block_size, head_dim]


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)


class Rank:
    def __init__(self, rank: int, num_cpu_blocks: int) -> None:
        self.rank = rank
        self.kv = torch.zeros(SHAPE)
        self.worker = OffloadWorker(num_cpu_blocks, medium=MEDIUM_CPU_OFFLOAD)
        self.worker.register_kv_caches(self.kv, None)

    def forward(self, plan: StepPlan) -> None:
        """Stands in for the model: writes rank- and token-specific values into the blocks."""
        for chunk in plan.chunks:
            for pos, tok in enumerate(chunk.token_ids, start=chunk.start_pos):
                block = chunk.block_ids[pos // BS]
                self.kv[block, :, :, :, pos % BS, :] = float(tok * 10 + self.rank)

    def step(self, plan: StepPlan, computed: bool = True) -> None:
        self.worker.start_load_kv(plan.connector_meta)
        if computed:
            self.forward(plan)
        self.worker.wait_for_save()


def plan_for(sched: OffloadScheduler, req: Req, block_ids: list[int], start: int) -> StepPlan:
    plan = StepPlan(chunks=[ScheduledChunk(req.request_id, req.all_token_ids[start:], start, block_ids, True)])
    plan.connector_meta = sched.build_connector_meta(plan)
    return plan


def run_step(ranks: list[Rank], agg: KVOutputAggregator, plan: StepPlan) -> list[list[KVCacheEvent]]:
    """Every rank executes the plan; returns the events published after each rank's report."""
    published = []
    for r in ranks:
        r.step(plan)
        published.append(agg.add_report("e", 1, r.rank, collect_output(r.worker)).events)
    return published


def setup(num_cpu_blocks: int = 8) -> tuple[OffloadScheduler, list[Rank], KVOutputAggregator]:
    sched = OffloadScheduler(BS, num_cpu_blocks)
    ranks = [Rank(0, num_cpu_blocks), Rank(1, num_cpu_blocks)]
    agg = KVOutputAggregator()
    agg.register_engine("e", 1, [0, 1])
    return sched, ranks, agg


def test_saved_blocks_are_served_back_after_device_eviction() -> None:
    sched, ranks, agg = setup()
    prompt = list(range(1, 15))  # 3 full blocks + 2 tokens
    a = Req("a", prompt)
    sched.on_new_request(a)
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    published = run_step(ranks, agg, plan_for(sched, a, [5, 6, 7, 8], 0))
    hashes = tuple(to_external(h) for h in BlockHasher(BS).hash_blocks(prompt))
    # CPU-medium events appear only after both ranks stored their shard.
    assert published == [[], [BlockStored(hashes, None, (), 0, medium=MEDIUM_CPU_OFFLOAD)]]
    assert sched.request_finished(a, [5, 6, 7, 8]) == (False, None)
    snapshot = [r.kv[[5, 6, 7]].clone() for r in ranks]
    for r in ranks:
        r.kv.zero_()  # the device cache lost everything

    b = Req("b", prompt + [99, 98])
    sched.on_new_request(b)
    assert sched.get_num_new_matched_tokens(b, 0) == (3 * BS, False)
    assert sched.get_num_new_matched_tokens(b, 0) == (3 * BS, False)  # repeatable
    sched.update_state_after_alloc(b, [9, 10, 11, 12], 3 * BS)
    plan = plan_for(sched, b, [9, 10, 11, 12], 3 * BS)
    assert isinstance(plan.connector_meta, OffloadMetadata)
    assert [ld.block_id for ld in plan.connector_meta.loads] == [9, 10, 11]
    # Blocks 0-2 are in the tier already; only the newly full fourth block is saved.
    assert [sv.block_id for sv in plan.connector_meta.saves] == [12]
    for r, before in zip(ranks, snapshot, strict=True):
        r.worker.start_load_kv(plan.connector_meta)
        assert torch.equal(r.kv[[9, 10, 11]], before)  # each rank got its own shard back
        r.worker.wait_for_save()
    assert sched.num_hit_tokens == 3 * BS
    stats = ranks[0].worker.get_kv_connector_stats()
    assert stats is not None and stats.reduce()["load_bytes_sum"] == 3 * ranks[0].kv[0].numel() * 4


def test_match_leaves_one_token_and_starts_after_the_local_prefix() -> None:
    sched, ranks, agg = setup()
    prompt = list(range(1, 13))  # exactly 3 blocks
    a = Req("a", prompt)
    sched.on_new_request(a)
    run_step(ranks, agg, plan_for(sched, a, [0, 1, 2], 0))
    b = Req("b", prompt)
    assert sched.get_num_new_matched_tokens(b, 0) == (2 * BS, False)  # the last token is computed
    assert sched.get_num_new_matched_tokens(b, BS) == (BS, False)  # block 0 was a local hit
    assert sched.get_num_new_matched_tokens(Req("c", [7] + prompt[1:]), 0) == (0, False)
    with pytest.raises(ValueError, match="external tokens"):
        sched.update_state_after_alloc(b, [3, 4, 5], 3 * BS)


def test_lru_budget_evicts_and_reports_removed() -> None:
    sched, ranks, agg = setup(num_cpu_blocks=2)
    first = Req("a", list(range(1, 10)))  # blocks h0, h1 (+1 token)
    sched.on_new_request(first)
    run_step(ranks, agg, plan_for(sched, first, [0, 1, 2], 0))
    second = Req("b", list(range(50, 59)))
    sched.on_new_request(second)
    published = run_step(ranks, agg, plan_for(sched, second, [3, 4, 5], 0))
    old = tuple(to_external(h) for h in BlockHasher(BS).hash_blocks(first.all_token_ids))
    new = tuple(to_external(h) for h in BlockHasher(BS).hash_blocks(second.all_token_ids))
    # The first rank's removal is published at once; the store waits for both ranks.
    assert published == [[BlockRemoved(old, MEDIUM_CPU_OFFLOAD)],
                         [BlockStored(new, None, (), 0, medium=MEDIUM_CPU_OFFLOAD)]]
    assert sched.get_num_new_matched_tokens(Req("c", first.all_token_ids), 0) == (0, False)
    assert sched.num_cached_blocks == 2


def test_chunked_prefill_saves_each_block_once() -> None:
    sched, ranks, agg = setup()
    a = Req("a", list(range(1, 12)))
    sched.on_new_request(a)
    blocks = [0, 1, 2]
    plan = StepPlan(chunks=[ScheduledChunk("a", a.all_token_ids[:6], 0, blocks, False)])
    plan.connector_meta = sched.build_connector_meta(plan)
    assert [s.block_id for s in plan.connector_meta.saves] == [0]
    plan2 = StepPlan(chunks=[ScheduledChunk("a", a.all_token_ids[6:], 6, blocks, True)])
    plan2.connector_meta = sched.build_connector_meta(plan2)
    assert [s.block_id for s in plan2.connector_meta.saves] == [1]
    plan3 = StepPlan(chunks=[ScheduledChunk("a", a.all_token_ids[:11], 0, blocks, True)])  # after preemption
    meta3 = sched.build_connector_meta(plan3)
    assert isinstance(meta3, OffloadMetadata) and meta3.is_empty()


def test_reset_cache_clears_the_tier_on_every_rank() -> None:
    sched, ranks, agg = setup()
    a = Req("a", list(range(1, 10)))
    sched.on_new_request(a)
    run_step(ranks, agg, plan_for(sched, a, [0, 1, 2], 0))
    assert sched.reset_cache() is True
    plan = StepPlan()
    plan.connector_meta = sched.build_connector_meta(plan)
    published = []
    for r in ranks:
        r.step(plan, computed=False)
        published.append(agg.add_report("e", 1, r.rank, collect_output(r.worker)).events)
    assert published == [[AllBlocksCleared(MEDIUM_CPU_OFFLOAD)], []]
    assert sched.get_num_new_matched_tokens(Req("b", a.all_token_ids), 0) == (0, False)


def test_worker_input_errors() -> None:
    worker = OffloadWorker(4)
    with pytest.raises(TypeError, match='OffloadWorker expects OffloadMetadata, got StepPlan'):
        worker.start_load_kv(StepPlan())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="register_kv_caches"):
        worker.start_load_kv(OffloadMetadata(loads=(BlockLoad(0, 0),)))
    with pytest.raises(ValueError, match='num_cpu_blocks must be >= 1, got 0'):
        OffloadWorker(0)
    with pytest.raises(ValueError, match='num_cpu_blocks must be >= 1, got 0'):
        OffloadScheduler(BS, 0)
    assert num_cpu_blocks_for(1000, 96) == 10


def test_registered_by_name() -> None:
    sched = create_scheduler_connector("offload", block_size=BS, num_cpu_blocks=4)
    worker = create_worker_connector("offload", num_cpu_blocks=4)
    assert isinstance(sched, OffloadScheduler) and isinstance(worker, OffloadWorker)


def test_build_offload_for_an_engine() -> None:
    sched, rank_init = build_offload(memory_bytes=10 * 96, block_size=BS, block_nbytes=96, working_medium="CPU")
    assert sched.num_cpu_blocks == 10 and rank_init.num_cpu_blocks == 10
    assert rank_init.medium == MEDIUM_CPU_OFFLOAD and offload_medium("GPU") == "CPU"
    worker = rank_init(0, 1, torch.zeros(SHAPE), None)
    assert isinstance(worker, OffloadWorker) and worker.medium == MEDIUM_CPU_OFFLOAD
    with pytest.raises(ValueError, match="holds no block"):
        build_offload(memory_bytes=10, block_size=BS, block_nbytes=96, working_medium="CPU")
    with pytest.raises(ValueError, match="report callables"):
        OffloadRankInit(4, reports=(print,))(0, 2, torch.zeros(SHAPE), None)


def test_pool_is_pinned_where_the_cache_is_on_a_gpu() -> None:
    """The tier's host pool is page-locked by default when the KV cache lives on a GPU (the
    copies to and from it are then true async DMA); a CPU cache's pool is plain memory."""
    worker = OffloadRankInit(num_cpu_blocks=4)(0, 1, torch.zeros(8, 2, 3), None)
    assert worker.pin_memory
    worker.register_kv_caches(torch.zeros(8, 2, 3), None)
    assert not worker.pool.is_pinned()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA here: the pinned pool of a GPU cache is checked only on a GPU")
    gpu = OffloadRankInit(num_cpu_blocks=4)(0, 1, None, None)
    gpu.register_kv_caches(torch.zeros(8, 2, 3, device="cuda"), None)
    assert gpu.pool.is_pinned() and gpu.pool.device.type == "cpu"
