"""BatchScheduler with hand-built model outputs (torch-free)."""

from __future__ import annotations

import zlib

import pytest

from connectors.base import EmptyConnectorMetadata, KVConnectorMetadata, SchedulerConnector
from connectors.hashing import BlockHasher
from engine.batch_scheduler import BatchScheduler, BatchSchedulerConfig, StepPlan
from engine.block_pool import BlockPool, NoFreeBlocksError
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestMode, RequestStatus, SamplingParams


def _sched(num_blocks=16, bs=4, budget=32, max_seqs=8) -> BatchScheduler:
    pool = BlockPool(num_blocks, bs)
    return BatchScheduler(BatchSchedulerConfig(max_seqs, budget), KVCacheManager(pool, BlockHasher(bs)))


def _req(rid, n, mode=RequestMode.NORMAL, outputs=(), max_tokens=8) -> Request:
    # A stable seed per id (str hash() changes per process: two ids' prompts met in some).
    prompt = [(zlib.crc32(rid.encode()) + i) % 1000 for i in range(n)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), mode=mode,
                   all_token_ids=prompt + list(outputs))


def _step(s: BatchScheduler, token: int = 7) -> StepPlan:
    plan = s.schedule()
    s.update_from_output(plan, {c.request_id: token for c in plan.chunks if c.sample})
    return plan


def test_chunked_prefill_under_token_budget_then_decode() -> None:
    s = _sched(budget=10)
    s.add_request(_req("a", 23))
    sizes = [len(_step(s).chunks[0].token_ids) for _ in range(4)]
    assert sizes == [10, 10, 3, 1]
    a = s.requests["a"]
    assert a.num_computed_tokens == 24 and a.output_token_ids == [7, 7]


def test_running_first_then_waiting_and_max_num_seqs() -> None:
    s = _sched(budget=64, max_seqs=2)
    for rid in "abc":
        s.add_request(_req(rid, 5))
    plan = _step(s)
    assert [c.request_id for c in plan.chunks] == ["a", "b"]
    s.finish_request("a", "stop")
    plan = _step(s)
    assert [(c.request_id, len(c.token_ids)) for c in plan.chunks] == [("b", 1), ("c", 5)]
    for rid in "bc":
        s.finish_request(rid, "stop")
    assert s.check_leaks() == []


def test_prefix_hit_skips_cached_tokens() -> None:
    s = _sched()
    a = _req("a", 12)
    s.add_request(a)
    _step(s)
    s.finish_request("a", "stop")
    b = Request("b", a.prompt_token_ids[:8] + [1, 2], SamplingParams(), all_token_ids=a.prompt_token_ids[:8] + [1, 2])
    s.add_request(b)
    plan = _step(s)
    assert plan.chunks[0].start_pos == 8 and plan.chunks[0].token_ids == [1, 2]
    assert b.num_cached_tokens == 8
    s.finish_request("b", "stop")


def test_preemption_frees_the_newest_and_requeues_it_first() -> None:
    s = _sched(num_blocks=4, bs=4, budget=64)
    s.add_request(_req("a", 8))
    s.add_request(_req("b", 8))
    _step(s)  # a and b: 8 prompt tokens in 2 blocks each; pool full
    plan = _step(s)  # a needs a 3rd block for its 9th token: b is preempted
    assert plan.preempted_ids == ["b"]
    assert s.requests["b"].status is RequestStatus.PREEMPTED and s.waiting[0].request_id == "b"
    assert s.requests["b"].num_computed_tokens == 0
    s.finish_request("a", "stop")
    plan = _step(s)
    # b's tail block was freed first and went to a; its first block is still cached.
    chunk = plan.chunks[0]
    assert chunk.request_id == "b" and chunk.start_pos == 4
    assert chunk.token_ids == s.requests["b"].all_token_ids[4:-1]
    s.finish_request("b", "stop")
    assert s.check_leaks() == []


def test_remote_kv_and_pinned_states() -> None:
    s = _sched()
    s.add_request(_req("p", 9, mode=RequestMode.PREFILL_ONLY))
    _step(s)
    s.finish_request("p", "length")
    assert s.requests["p"].status is RequestStatus.PINNED and len(s.kv.get_block_ids("p")) == 3
    assert not s.has_unfinished_requests()
    assert s.release("p") and not s.release("p")

    s.add_request(_req("d", 9, mode=RequestMode.REMOTE_KV, outputs=[5]))
    assert s.requests["d"].status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert len(s.kv.get_block_ids("d")) == 3
    assert s.schedule().chunks == []
    s.finish_remote_kv("d", ok=True, invalid_block_ids=set())
    plan = _step(s)
    assert [(c.start_pos, c.token_ids) for c in plan.chunks] == [(9, [5])]
    s.abort("d")
    assert s.check_leaks() == []


def test_remote_kv_without_room_changes_nothing() -> None:
    s = _sched(num_blocks=2)
    with pytest.raises(NoFreeBlocksError, match='not enough free KV blocks for 20 prompt tokens'):
        s.add_request(_req("d", 20, mode=RequestMode.REMOTE_KV, outputs=[1]))
    assert s.check_leaks() == []


class _AsyncLoader(SchedulerConnector):
    """A scheduler-side connector that offers 8 external tokens, loaded asynchronously."""

    def __init__(self) -> None:
        self.allocs: list[tuple[str, list[int], int]] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return (8, True) if request.request_id == "ext" else (0, False)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocs.append((request.request_id, list(block_ids), num_external_tokens))

    def build_connector_meta(self, step) -> KVConnectorMetadata:
        return EmptyConnectorMetadata()


def test_async_connector_load_parks_the_request_until_finished() -> None:
    pool = BlockPool(16, 4)
    loader = _AsyncLoader()
    s = BatchScheduler(BatchSchedulerConfig(8, 32), KVCacheManager(pool, BlockHasher(4)), connector=loader)
    s.add_request(_req("ext", 10))
    s.add_request(_req("local", 3))
    plan = _step(s)
    assert [c.request_id for c in plan.chunks] == ["local"]
    assert s.requests["ext"].status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert loader.allocs[0][0] == "ext" and len(loader.allocs[0][1]) == 2 and loader.allocs[0][2] == 8
    s.finish_remote_kv("ext", ok=True, invalid_block_ids=set())
    plan = _step(s)
    ext = next(c for c in plan.chunks if c.request_id == "ext")
    assert ext.start_pos == 8 and len(ext.token_ids) == 2
    for rid in ("ext", "local"):
        s.finish_request(rid, "stop")
    assert s.check_leaks() == []
