"""`VllmSchedulerHalf`: the scheduler side of `PdserveConnector`, in vLLM's engine core.

Pure bookkeeping (no vLLM, torch, gRPC or UCX imports): vLLM's `Request`, `SchedulerOutput` and
`KVCacheManager` are read through the few attributes named below, so the logic is tested with
hand-built objects.

Contracts:
- Prefill (`kv_transfer_params` has `do_remote_decode`): in the step whose tokens complete the
  prompt, the plan carries a `SendSpec` so every rank pins the prompt's blocks *before* that
  step's output leaves the engine core (the descriptor can never reach a reader before the
  pin), for the reader's TP (`pdserve_reader_tp`: each rank pins for the decode ranks reading
  its KV heads). `request_finished` then holds the blocks (returns True) and answers the transfer
  descriptor as `kv_transfer_params`; the blocks go back to vLLM only when every worker reports
  the request in `finished_sending` — which a worker does once the pdserve scheduler's
  ReleaseBlocks arrived, its readers said done, the lease ran out, or the request was aborted.
  A request that never got pinned (aborted before its prompt completed) is never held.
- Decode (`do_remote_prefill` + a descriptor): `get_num_new_matched_tokens` offers the
  descriptor's tokens beyond the local prefix hit (asynchronously); `update_state_after_alloc`
  plans one `PullSpec` per request, ever, into the blocks after the local hit. With nothing to
  pull (a full local hit, or a descriptor this engine cannot read) it still plans an empty pull
  (`vllm_waits=False`) so the pdserve scheduler hears "done reading" and releases the prefill
  engine's blocks at once. An aborted request still pulling gets a `CancelSpec`; the worker
  then reports it received, which is when vLLM frees its blocks.
- A peer fetch (decision 0043) is both, on two engines: the holder serves a prefill of the
  prompt's first whole blocks (whatever its role: its prefix cache answers all but the last
  block), the puller a decode whose descriptor covers fewer tokens than its prompt. The pull
  fills the blocks between its local hit and the descriptor's end; vLLM then computes the rest
  of the prompt itself (a partial external hit, as any connector's), and a failed pull is
  recomputed from its first invalid block (`kv_load_failure_policy="recompute"`).
- `take_events` returns nothing: vLLM's block-pool events reach the pdserve scheduler through
  vLLM's own publisher (see `events.py`); this connector caches no KV outside vLLM.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from connectors.ucx.handshake import KVTransferDescriptor
from connectors.vllm.params import (
    PDSERVE_ID,
    READER_TP,
    REMOTE_DECODE,
    REMOTE_PREFILL,
    CancelSpec,
    PdserveConnectorConfig,
    PdserveConnectorMetadata,
    PullSpec,
    SendSpec,
    descriptor_from_params,
    descriptor_to_params,
)

logger = logging.getLogger(__name__)


def _params(request: Any) -> dict[str, Any]:
    return getattr(request, "kv_transfer_params", None) or {}


def _pdserve_id(request: Any) -> str:
    return str(_params(request).get(PDSERVE_ID) or request.request_id)


def _is_aborted(request: Any) -> bool:
    return getattr(getattr(request, "status", None), "name", "") == "FINISHED_ABORTED"


class VllmSchedulerHalf:
    """See the module docstring."""

    def __init__(self, config: PdserveConnectorConfig, *, block_size: int, tp_size: int, num_kv_heads: int) -> None:
        self.config = config
        self.block_size = block_size
        self.tp_size = tp_size
        self.num_kv_heads = num_kv_heads
        self._kv_cache_manager: Any = None
        # vllm id -> (pdserve id, prompt tokens, reader TP), not yet pinned
        self._prefills: dict[str, tuple[str, int, int]] = {}
        self._pinned: dict[str, SendSpec] = {}  # vllm id -> its pin, until request_finished
        self._planned: set[str] = set()  # decode requests whose pull was planned (never twice)
        self._pulling: dict[str, str] = {}  # vllm id -> pdserve id, pulls vLLM waits on
        self._plan = PdserveConnectorMetadata()

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager

    # -- prefill side -----------------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        params = _params(request)
        if params.get(REMOTE_DECODE):
            self._prefills[request.request_id] = (_pdserve_id(request), int(request.num_prompt_tokens),
                                                  int(params.get(READER_TP) or 0))

    def _plan_pins(self, scheduler_output: Any) -> None:
        if not self._prefills:
            return
        computed = _computed_before(scheduler_output)
        for vllm_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            entry = self._prefills.get(vllm_id)
            if entry is None or computed.get(vllm_id, 0) + num_scheduled < entry[1]:
                continue
            request_id, num_prompt, reader_tp = entry
            del self._prefills[vllm_id]
            block_ids = tuple(self._block_ids(vllm_id)[:self._num_blocks(num_prompt)])
            spec = SendSpec(vllm_id, request_id, block_ids, reader_tp)
            self._pinned[vllm_id] = spec
            self._plan.sends.append(spec)

    # -- decode side -----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Side-effect free: the descriptor's tokens beyond the local hit, loaded asynchronously."""
        descriptor = self._remote_descriptor(request)
        if descriptor is None or request.request_id in self._planned:
            return 0, False
        count = descriptor.num_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _remote_descriptor(self, request: Any) -> KVTransferDescriptor | None:
        params = _params(request)
        if not params.get(REMOTE_PREFILL):
            return None
        try:
            descriptor = descriptor_from_params(params)
        except ValueError as e:
            logger.warning("%s: %s; computing the prompt locally", request.request_id, e)
            return None
        problem = self._descriptor_problem(descriptor, request)
        if problem is not None:
            logger.warning("%s: cannot read its KV (%s); computing the prompt locally", request.request_id, problem)
            return None
        return descriptor

    def _descriptor_problem(self, d: KVTransferDescriptor, request: Any) -> str | None:
        if d.block_size != self.block_size:
            return f"block_size {d.block_size} != {self.block_size}"
        if not 0 < d.num_tokens <= int(request.num_prompt_tokens):
            return f"num_tokens {d.num_tokens} not in [1, {request.num_prompt_tokens}]"
        if len(d.block_ids) != self._num_blocks(d.num_tokens):
            return f"{len(d.block_ids)} block ids for {d.num_tokens} tokens"
        return None

    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        vllm_id = request.request_id
        if vllm_id in self._planned:
            return
        params = _params(request)
        if not params.get(REMOTE_PREFILL) or PDSERVE_ID not in params:
            return
        self._planned.add(vllm_id)
        descriptor = self._remote_descriptor(request)
        if descriptor is None:  # unreadable: the pdserve scheduler still hears "done" (empty pull)
            descriptor = _empty_descriptor(params, _pdserve_id(request))
            num_external_tokens = 0
        local: tuple[int, ...] = ()
        if num_external_tokens > 0:
            first = (descriptor.num_tokens - num_external_tokens) // self.block_size
            local = tuple(self._block_ids(vllm_id)[first:self._num_blocks(descriptor.num_tokens)])
            self._pulling[vllm_id] = descriptor.request_id
        self._plan.pulls.append(PullSpec(vllm_id, descriptor.request_id, descriptor, local, bool(local)))

    def update_connector_output(self, finished_recving: set[str] | None) -> None:
        for vllm_id in finished_recving or ():
            self._pulling.pop(vllm_id, None)

    # -- every step / end of a request -----------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> PdserveConnectorMetadata:
        self._plan_pins(scheduler_output)
        plan, self._plan = self._plan, PdserveConnectorMetadata()
        return plan

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Called once per request before vLLM frees its blocks; True = hold them."""
        vllm_id = request.request_id
        self._prefills.pop(vllm_id, None)
        self._planned.discard(vllm_id)
        request_id = self._pulling.pop(vllm_id, None)
        if request_id is not None:  # aborted while pulling: the worker ends the pull and reports it
            self._plan.cancels.append(CancelSpec(vllm_id, request_id))
            return False, None
        spec = self._pinned.pop(vllm_id, None)
        if spec is None:
            return False, None
        if _is_aborted(request):
            self._plan.cancels.append(CancelSpec(vllm_id, spec.request_id))
            return True, None
        lease_until_ms = int((time.time() + self.config.lease_s) * 1000)
        descriptor = KVTransferDescriptor(self.config.engine_id, self.config.epoch, spec.request_id, spec.block_ids,
                                          int(request.num_prompt_tokens), self.tp_size, self.block_size,
                                          self.num_kv_heads, lease_until_ms)
        return True, descriptor_to_params(descriptor)

    def num_tracked(self) -> int:
        """Requests this half still tracks (0 when idle: the leak check)."""
        return len(self._prefills) + len(self._pinned) + len(self._planned) + len(self._pulling)

    # -- helpers ---------------------------------------------------------------------------------

    def _num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_ids(self, vllm_id: str) -> list[int]:
        if self._kv_cache_manager is None:
            raise RuntimeError("bind_kv_cache_manager() first")
        return list(self._kv_cache_manager.get_block_ids(vllm_id)[0])


def _computed_before(scheduler_output: Any) -> dict[str, int]:
    """Tokens each scheduled request had computed before this step."""
    computed = {r.req_id: int(r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    computed.update({rid: int(n) for rid, n in zip(cached.req_ids, cached.num_computed_tokens, strict=False)})
    return computed


def _empty_descriptor(params: dict[str, Any], request_id: str) -> KVTransferDescriptor:
    return KVTransferDescriptor(str(params.get("engine_id", "")), int(params.get("epoch", 0) or 0), request_id, (),
                                0, int(params.get("tp_size", 1) or 1), int(params.get("block_size", 0) or 0),
                                int(params.get("num_kv_heads", 0) or 0))
