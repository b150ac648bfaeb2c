"""Random operation sequences against the pure core: block accounting never drifts and every
block returns to the pool (hypothesis; torch-free)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.hashing import BlockHasher
from engine.batch_scheduler import BatchScheduler, BatchSchedulerConfig
from engine.block_pool import BlockPool, NoFreeBlocksError
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestMode, SamplingParams

OPS = st.lists(st.tuples(st.sampled_from(["add", "add_prefill", "add_remote", "step", "step", "step", "abort",
                                          "finish_remote", "release"]),
                         st.integers(0, 5), st.integers(1, 40)), min_size=1, max_size=60)


def _check(s: BatchScheduler) -> None:
    pool = s.kv.pool
    held = Counter(b.block_id for blocks in s.kv.req_to_blocks.values() for b in blocks)
    for block in pool.blocks:
        assert block.ref_cnt == held.get(block.block_id, 0)
        assert (block.ref_cnt == 0) == (block.block_id in pool._free)
    for h, block in pool._cached.items():
        assert block.block_hash == h
    for request in s.running:
        assert request.num_computed_tokens <= request.num_tokens


@settings(max_examples=60, deadline=None)
@given(OPS, st.integers(4, 12))
def test_random_operations_keep_block_accounting_exact(ops, num_blocks) -> None:
    pool = BlockPool(num_blocks, 4)
    s = BatchScheduler(BatchSchedulerConfig(4, 16), KVCacheManager(pool, BlockHasher(4)))
    step_no = 0
    for op, i, n in ops:
        rid = f"r{i}"
        prompt = [(i * 7 + k) % 50 for k in range(min(n, num_blocks * 4 - 2))]
        if op.startswith("add") and rid not in s.requests:
            mode = {"add": RequestMode.NORMAL, "add_prefill": RequestMode.PREFILL_ONLY,
                    "add_remote": RequestMode.REMOTE_KV}[op]
            outputs = [1] if mode is RequestMode.REMOTE_KV else []
            req = Request(rid, prompt, SamplingParams(max_tokens=6), mode=mode, all_token_ids=prompt + outputs)
            try:
                s.add_request(req)
            except NoFreeBlocksError:
                pass
        elif op == "step":
            step_no += 1
            plan = s.schedule()
            for request, _ in s.update_from_output(plan, {c.request_id: step_no % 50 for c in plan.chunks
                                                          if c.sample}):
                if request.num_output_tokens >= request.params.max_tokens or request.mode is RequestMode.PREFILL_ONLY:
                    s.finish_request(request.request_id, "length")
        elif op == "abort":
            s.abort(rid)
        elif op == "finish_remote" and rid in s.remote:
            s.finish_remote_kv(rid, ok=n % 2 == 0, invalid_block_ids={n % num_blocks})
        elif op == "release":
            s.release(rid)
        _check(s)
    # Liveness: whatever state we are in, the queue drains (no preemption livelock).
    for rid in list(s.remote):
        s.finish_remote_kv(rid, ok=True, invalid_block_ids=set())
    for _ in range(300):
        for rid in list(s.pinned):  # pinned blocks belong to the data plane until release
            s.release(rid)
        if not s.has_unfinished_requests():
            break
        plan = s.schedule()
        for request, _ in s.update_from_output(plan, {c.request_id: 3 for c in plan.chunks if c.sample}):
            if request.num_output_tokens >= request.params.max_tokens or request.mode is RequestMode.PREFILL_ONLY:
                s.finish_request(request.request_id, "length")
        _check(s)
    assert not s.has_unfinished_requests()
    for rid in list(s.requests):
        s.abort(rid)
    _check(s)
    assert s.check_leaks() == []
