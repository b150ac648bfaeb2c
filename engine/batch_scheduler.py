"""BatchScheduler: continuous batching over one engine's KV blocks.

Torch-free. Each `schedule()` builds a StepPlan under a token budget: running requests first
(one decode token each, or the next prefill chunk), then waiting ones (prefix-cache hits are
skipped, only the uncached suffix is computed, long prompts are chunked). When blocks run out,
the most recently admitted running request is preempted by recompute: its blocks go back to the
pool and it restarts from the waiting queue's head (its prefix may still be cached).

Extra states: WAITING_FOR_REMOTE_KV (decode: blocks allocated, the data plane fills them, then
`finish_remote_kv`) and PINNED (prefill-only request finished; blocks kept until `release`).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from connectors.base import SchedulerConnector
from engine.block_pool import KVCacheBlock, NoFreeBlocksError
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestMode, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledChunk:
    """Tokens [start_pos, start_pos + len(token_ids)) of one request, computed this step."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sample: bool  # the chunk ends at the request's last token: sample the next one


@dataclass(slots=True)
class StepPlan:
    """What every rank computes in one step (rank 0 broadcasts it)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    connector_meta: Any = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(slots=True)
class BatchSchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


class BatchScheduler:
    def __init__(self, config: BatchSchedulerConfig, kv: KVCacheManager, *,
                 connector: SchedulerConnector | None = None) -> None:
        config.validate()
        self.config = config
        self.kv = kv
        self.connector = connector
        self.block_size = kv.block_size
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}
        self.pinned: dict[str, Request] = {}
        self._finished_since_plan: list[str] = []
        self.num_preemptions = 0
        self.capacity_finished: list[Request] = []

    # -- admission ---------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queues a request; REMOTE_KV requests get their prompt blocks now (NoFreeBlocksError
        when the pool cannot hold them, with nothing changed)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.mode is RequestMode.REMOTE_KV:
            self._admit_remote(request)
        else:
            self.waiting.append(request)
        self.requests[request.request_id] = request
        if self.connector is not None:
            self.connector.on_new_request(request)

    def _admit_remote(self, request: Request) -> None:
        target = self.remote_kv_tokens(request)
        hits = self.kv.get_computed_blocks(request, max_tokens=target)
        num_hit = len(hits) * self.block_size
        if not self.kv.allocate_slots(request, target - num_hit, hits):
            raise NoFreeBlocksError(f"request {request.request_id!r}: not enough free KV blocks for "
                                    f"{target} prompt tokens ({self.kv.pool.num_free_blocks} blocks free)")
        request.num_computed_tokens = num_hit
        request.num_cached_tokens = num_hit
        request.remote_kv_target = target
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.remote[request.request_id] = request

    @staticmethod
    def remote_kv_tokens(request: Request) -> int:
        """Tokens whose KV a REMOTE_KV request expects from the data plane (cached ones included)."""
        if request.remote_kv_target is not None:
            return request.remote_kv_target
        return min(request.num_prompt_tokens, request.num_tokens - 1)

    def finish_remote_kv(self, request_id: str, ok: bool, invalid_block_ids: set[int]) -> None:
        """Moves a WAITING_FOR_REMOTE_KV request to the waiting queue's head. Tokens up to the
        first invalid block (or only the locally cached ones when not ok) count as computed;
        the rest is recomputed."""
        request = self.remote.get(request_id)
        if request is None:
            raise ValueError(f"request {request_id!r} is not waiting for remote KV")
        valid = self.remote_kv_tokens(request) if ok else request.num_computed_tokens
        block_ids = self.kv.get_block_ids(request_id)
        bad = [i for i, b in enumerate(block_ids) if b in invalid_block_ids]
        if bad:
            valid = min(valid, bad[0] * self.block_size)
        request.num_computed_tokens = max(request.num_computed_tokens, valid)
        request.remote_kv_target = None
        del self.remote[request_id]
        self.kv.cache_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    # -- scheduling --------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, n, plan):
                break
            plan.chunks.append(self._chunk(request, n))
            budget -= n
            i += 1
        if not plan.preempted_ids:
            budget = self._schedule_waiting(plan, budget)
        return self._with_commands(plan)

    def schedule_commands(self) -> StepPlan:
        """A plan without chunks: only the finished ids and the connector's commands queued since
        the last plan (nothing is computed; `update_from_output` need not see it)."""
        return self._with_commands(StepPlan())

    def _with_commands(self, plan: StepPlan) -> StepPlan:
        plan.finished_ids, self._finished_since_plan = self._finished_since_plan, []
        if self.connector is not None:
            plan.connector_meta = self.connector.build_connector_meta(plan)
        return plan

    def _allocate_or_preempt(self, request: Request, n: int, plan: StepPlan) -> bool:
        while not self.kv.allocate_slots(request, n):
            if self.running == [request] and self._outgrew_cache(request):
                # Alone, every other block free, still out of blocks: it can never fit.
                self.finish_request(request.request_id, "length")
                self.capacity_finished.append(request)
                return False
            victim = self.running.pop()
            self._preempt(victim)
            plan.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def take_capacity_finished(self) -> list[Request]:
        """Requests ended with "length" because their sequence outgrew the whole KV cache."""
        out, self.capacity_finished = self.capacity_finished, []
        return out

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            fresh = request.request_id not in self.kv.req_to_blocks  # new or preempted
            computed = self.kv.get_computed_blocks(request) if fresh else []
            num_hit = len(computed) * self.block_size
            num_ext, is_async = self._external_match(request, num_hit) if fresh else (0, False)
            if num_ext is None:
                break  # the connector does not know yet; keep FIFO order and ask next step
            if is_async and num_ext > 0:
                if not self._park_for_external_kv(request, computed, num_ext):
                    break
                continue
            n = min(request.num_tokens - request.num_computed_tokens - num_hit - num_ext, budget)
            if not self.kv.allocate_slots(request, num_ext + n, computed):
                if self.running or plan.chunks:
                    break  # running requests will free blocks
                if self._preempt_waiting_holder(request, plan):
                    continue
                if self._outgrew_cache(request):
                    self.waiting.popleft()
                    self.finish_request(request.request_id, "length")
                    self.capacity_finished.append(request)
                    continue
                break  # pinned or remote-KV blocks must be released first
            request.num_computed_tokens += num_hit + num_ext
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_hit
            if fresh and self.connector is not None:
                self.connector.update_state_after_alloc(request, self.kv.get_block_ids(request.request_id), num_ext)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.chunks.append(self._chunk(request, n))
            budget -= n
        return budget

    def _preempt_waiting_holder(self, request: Request, plan: StepPlan) -> bool:
        """Nothing runs and the queue head does not fit: free the blocks of another waiting
        request that holds some (e.g. one whose remote KV arrived); it recomputes later."""
        for other in reversed(self.waiting):
            if other is not request and other.request_id in self.kv.req_to_blocks:
                self.kv.free(other.request_id)
                other.num_computed_tokens = 0
                other.status = RequestStatus.PREEMPTED
                other.num_preemptions += 1
                self.num_preemptions += 1
                plan.preempted_ids.append(other.request_id)
                return True
        return False

    def _outgrew_cache(self, request: Request) -> bool:
        """True when every block the request does not hold is free and it still does not fit."""
        held = len(self.kv.req_to_blocks.get(request.request_id, ()))
        return self.kv.pool.num_free_blocks + held == self.kv.pool.num_blocks

    def _external_match(self, request: Request, num_hit: int) -> tuple[int | None, bool]:
        """Tokens the scheduler-side connector can load beyond the local prefix hit."""
        if self.connector is None:
            return 0, False
        num_ext, is_async = self.connector.get_num_new_matched_tokens(request, num_hit)
        if num_ext is not None and num_hit + num_ext >= request.num_tokens:
            raise RuntimeError(f"connector offered {num_ext} tokens of request {request.request_id!r}, "
                               "leaving none to compute")
        return num_ext, is_async

    def _park_for_external_kv(self, request: Request, computed: list[KVCacheBlock], num_ext: int) -> bool:
        """An asynchronous connector load: blocks now, WAITING_FOR_REMOTE_KV until the load is
        reported finished (`finish_remote_kv`)."""
        num_hit = len(computed) * self.block_size
        if not self.kv.allocate_slots(request, num_ext, computed):
            return False
        request.num_computed_tokens = num_hit
        request.num_cached_tokens = num_hit
        request.remote_kv_target = num_hit + num_ext
        assert self.connector is not None
        self.connector.update_state_after_alloc(request, self.kv.get_block_ids(request.request_id), num_ext)
        self.waiting.popleft()
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.remote[request.request_id] = request
        return True

    def _chunk(self, request: Request, n: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:start + n],
            start_pos=start,
            block_ids=self.kv.get_block_ids(request.request_id),
            sample=start + n == request.num_tokens,
        )

    def _preempt(self, request: Request) -> None:
        logger.debug("preempting %s (recompute)", request.request_id)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(self, plan: StepPlan, sampled: dict[str, int]) -> list[tuple[Request, int]]:
        """Advances computed counts, caches newly full blocks, appends sampled tokens.

        Returns (request, new token) for every request that sampled one; the caller decides
        whether it finished and then calls `finish_request`.
        """
        out = []
        for chunk in plan.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            request.num_computed_tokens = chunk.start_pos + len(chunk.token_ids)
            self.kv.cache_blocks(request, request.num_computed_tokens)
            if chunk.sample:
                token = sampled[chunk.request_id]
                request.all_token_ids.append(token)
                out.append((request, token))
        return out

    # -- completion --------------------------------------------------------------------------

    def finish_request(self, request_id: str, reason: str) -> None:
        """Ends a request. A PREFILL_ONLY request that was not aborted becomes PINNED (its blocks
        stay until `release`); every other request returns its blocks now."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return
        request.finish_reason = reason
        self._remove_from_queues(request)
        self._finished_since_plan.append(request_id)
        if self.connector is not None:
            self.connector.request_finished(request, self.kv.get_block_ids(request_id))
        if request.mode is RequestMode.PREFILL_ONLY and reason != "abort":
            request.status = RequestStatus.PINNED
            self.pinned[request_id] = request
            return
        request.status = RequestStatus.FINISHED
        self.kv.free(request_id)
        del self.requests[request_id]

    def pin_cached(self, request: Request) -> int:
        """A peer-fetch pin (decision 0049): the request takes a reference on the cached full
        blocks of its prompt's longest cached prefix and is PINNED at once, as a finished
        PREFILL_ONLY request is (`release`, `abort`, the connector's send for readers and the
        leak checks treat it alike), without being scheduled: nothing is computed. Returns the
        tokens pinned; 0, with nothing changed, when not even the first block is cached."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.mode is not RequestMode.PREFILL_ONLY:
            raise ValueError(f"request {request.request_id!r}: only a PREFILL_ONLY request is pinned")
        hits = self.kv.get_cached_full_blocks(request)
        if not hits:
            return 0
        # Cached blocks are never short: the pool holds them already (a free one leaves the
        # free queue), so nothing is allocated and this cannot fail.
        allocated = self.kv.allocate_slots(request, 0, hits)
        assert allocated
        request.num_computed_tokens = request.num_cached_tokens = len(hits) * self.block_size
        request.finish_reason = "length"
        request.status = RequestStatus.PINNED
        self.requests[request.request_id] = request
        self.pinned[request.request_id] = request
        if self.connector is not None:
            self.connector.request_finished(request, self.kv.get_block_ids(request.request_id))
        return request.num_computed_tokens

    def release(self, request_id: str) -> bool:
        """Frees a PINNED request's blocks. False (and nothing changes) when it is not pinned."""
        request = self.pinned.pop(request_id, None)
        if request is None:
            return False
        request.status = RequestStatus.FINISHED
        self.kv.free(request_id)
        del self.requests[request_id]
        return True

    def abort(self, request_id: str) -> bool:
        """Ends a request in any state; a pinned one is released. False for unknown ids."""
        if request_id in self.pinned:
            return self.release(request_id)
        if request_id not in self.requests:
            return False
        self.finish_request(request_id, "abort")
        return True

    def _remove_from_queues(self, request: Request) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.remote[request.request_id]
        else:
            self.waiting.remove(request)

    # -- introspection -----------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.remote)

    def check_leaks(self) -> list[str]:
        problems = self.kv.check_leaks()
        for name in ("requests", "waiting", "running", "remote", "pinned"):
            if getattr(self, name):
                problems.append(f"batch scheduler {name} not empty: {len(getattr(self, name))}")
        return problems
