"""A peer fetch into a prefill engine (decision 0046): before a remote request's prefill, its
prefill engine pulls the prefix another engine caches, so the prefill computes only the rest.

The pull is a request of its own, internal to the scheduler (`Request.internal`: no client,
not counted as a request): the prompt's first `num_blocks` blocks and one token more. The holder
pins the prefix as for a pull into a decode engine (`GenerationServicer._peer_fetch_leg`: a
Prefill with `peer_fetch`), then the prefill engine runs a Decode with the holder's descriptor
and `peer_fetch` set (admitted whatever its role): it pulls the blocks over the KV data plane,
computes the one token and ends, and the pulled blocks stay in its prefix cache for the
request's own Prefill, sent next. Everything the pull needs — the holder's lease and its
release exactly once, the aggregator's verdict, the transfer tracker, engine-down and lease
handling, the engine's recompute when the pull fails — is the existing one, keyed by the pull's
own request id.

Faults: a failed pin, a failed or refused pull, a holder or prefill engine that dies, a pull that
outlasts `peer_fetch_timeout_s`, or blocks evicted on the prefill engine before the prefill
reaches them: the prefill computes what is missing, the output is unchanged, and the failure is
counted (`pdserve_kv_peer_fetch_failures_total`, reasons pin_failed, transfer_failed,
pull_failed, evicted). A slow holder delays the request by at most the pin's and the pull's
timeouts (`GenerationServicer._fetch_timeout_s`: `peer_fetch_timeout_s`, and at most twice the
TTFT predicted without the fetch).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING

import grpc

from pdserve.v1 import engine_pb2 as eng_pb
from pdserve.v1 import generation_pb2 as gen_pb
from services.common.request_owner import owned_id
from services.scheduler.lifecycle import EngineRef, RequestState
from services.scheduler.peer_fetch import PeerFetch
from services.scheduler.request import Request
from services.scheduler.validation import ValidRequest

if TYPE_CHECKING:  # generation imports this module
    from services.scheduler.generation import GenerationServicer

logger = logging.getLogger(__name__)

_DONE = (gen_pb.FINISH_REASON_STOP, gen_pb.FINISH_REASON_LENGTH)


class PullFailed(Exception):
    """The prefill engine's pull did not complete (refused, failed, timed out, engine gone)."""


class PrefillFetch:
    """Runs fetches into prefill engines for a `GenerationServicer` (see the module docstring)."""

    def __init__(self, servicer: GenerationServicer) -> None:
        self.servicer = servicer

    async def run(self, request: Request, fetch: PeerFetch) -> int:
        """Pulls `fetch`'s prefix into its target (the request's prefill engine); the prompt
        tokens pulled (0: the fetch failed, counted; the prefill then computes them)."""
        s = self.servicer
        prompt = request.valid.prompt_token_ids[:fetch.num_tokens + 1]
        valid = ValidRequest(prompt, gen_pb.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), 1)
        pull_id = owned_id(f"{request.client_id}.{uuid.uuid4().hex[:12]}.fetch", s.control.scheduler_id)
        sub = s.table.admit(pull_id, valid, s._remaining(request), client_id=request.client_id)
        sub.internal, sub.peer_fetch = True, fetch
        target = s.registry.engines.get(fetch.target_id)
        sub.decode_tp_size = target.tp_size if target is not None else 0
        state, reason = RequestState.ABORTED, "cancelled"
        try:
            descriptor = await s._peer_fetch_leg(sub, fetch)  # a failure is counted there
            if descriptor is None:
                state, reason = RequestState.FAILED, "pin_failed"
                return 0
            await self._pull(sub, fetch, descriptor)
            state, reason = RequestState.FINISHED, "done"
            return 0 if sub.peer_fetch_failed else sub.num_peer_fetched_tokens
        except PullFailed as e:
            logger.info("request %s: peer fetch into %s failed, its prefill computes the prefix: %s",
                        request.request_id, fetch.target_id, e)
            s._peer_fetch_failed(sub, fetch, "pull_failed")
            state, reason = RequestState.FAILED, "pull_failed"
            return 0
        finally:
            s._end(sub, state, reason)

    async def _pull(self, sub: Request, fetch: PeerFetch, descriptor: eng_pb.TransferDescriptor) -> None:
        s = self.servicer
        engine = s.registry.engine(fetch.target_id)
        if engine is None or not engine.routable:
            raise PullFailed(f"engine {fetch.target_id} is not available")
        ref = EngineRef(engine.engine_id, engine.epoch)
        sub.start_decode(ref)
        assert sub.prefill is not None
        s.control.tracker.start(sub.request_id, sub.prefill, ref)
        message = eng_pb.DecodeRequest(request_id=sub.request_id, prompt_token_ids=sub.valid.prompt_token_ids,
                                       sampling=sub.valid.sampling, peer_fetch=True)
        message.descriptor.CopyFrom(descriptor)
        call = s.channels.stub(engine).Decode(message, timeout=s._fetch_timeout_s(sub, fetch))
        sub.call = call
        sub.leg_started_at, sub.kv_ready_at = time.monotonic(), None
        first = True
        try:
            async for response in call:
                if first:
                    s._transferred(sub, engine.engine_id, response.num_transferred_tokens)
                    first = False
                if response.finish_reason in _DONE:
                    return
        except asyncio.CancelledError:
            if sub.engine_failed is None:
                raise  # the request's client left
            raise PullFailed(sub.engine_failed) from None
        except grpc.aio.AioRpcError as e:
            raise PullFailed(f"{e.code().name} {e.details()}") from None
        finally:
            sub.call = None
            call.cancel()
        raise PullFailed("the pull's stream ended without a finish reason")

    def settle(self, request: Request, fetch: PeerFetch, num_fetched: int) -> None:
        """The request's prefill answered: of its cached tokens, the fetched ones count as the
        peer's (what its prefill engine evicted before the prefill reached it was recomputed:
        counted as a failure)."""
        if request.prefill_engine_id != fetch.target_id:  # prefilled elsewhere after a failure
            return
        own = fetch.num_local_blocks * fetch.block_size  # what it cached itself before the pull
        peer = min(num_fetched, max(0, request.num_cached_tokens - own))
        if peer < num_fetched:
            self.servicer._peer_fetch_failed(request, fetch, "evicted")
        request.num_cached_tokens -= peer
        request.num_peer_fetched_tokens = peer
        request.peer_fetch_engine_id = fetch.holder_id
