"""`VllmBackend`: vLLM's `AsyncLLM` in-process behind the Engine API (`--engine vllm`).

The scheduler cannot tell it from pdserve's own engine: every rank registers on its own control
stream (the `PdserveConnector` worker half, inside vLLM's workers) with the same engine id,
epoch, compatibility hash and UCX handshake; descriptors, leases, events and verdicts are the
same.

- prefill: a vLLM request with `max_tokens=1` and `kv_transfer_params={"do_remote_decode"}`.
  The connector pins the prompt's blocks in the step that computes it, vLLM holds them after the
  request finishes, and the finished request's `kv_transfer_params` are the descriptor. The
  blocks go back to vLLM on the scheduler's ReleaseBlocks, a Release/Abort (here, through the
  worker extension), every reader's done, or the lease's end.
- decode: the prompt plus the tokens already generated (the first token from the prefill, or
  more after a migration) as vLLM's prompt, `max_tokens` reduced by those; with a descriptor,
  `kv_transfer_params={"do_remote_prefill", **descriptor}` makes vLLM wait in
  WAITING_FOR_REMOTE_KVS while every rank pulls the prompt's blocks after its local prefix hit;
  a failed pull's blocks are recomputed by vLLM (kv_load_failure_policy "recompute").
- peer fetch (decision 0043): the holder's Prefill (either role) is a prefill of the prompt's
  first whole blocks, pinned for the reader's TP; the puller's Decode carries a descriptor of
  fewer tokens than its prompt, which vLLM loads as a partial external hit and computes the
  rest of the prompt after it.
- role (decision 0047): vLLM's connector is `kv_both`, so every call above runs whatever the
  role; the role is what the Engine API admits (`role_state`). A SetRole reaches rank 0's
  worker, not this process: the changes it took come back with every load report (at least
  every `IDLE_LOAD_INTERVAL_S`) and at once when a call its last-seen role would refuse
  arrives (`sync_role`), so the new role's calls are admitted as soon as the scheduler routes
  them; the old role's grace period starts when this process reads the change.
- load: vLLM's scheduler stats (running, waiting, KV usage) as of its last step, rank 0's pinned
  prefills and pulls (worker extension, which also hands the load to rank 0's heartbeat every
  `LOAD_INTERVAL_S`). While the engine is idle (no request in flight, no pin or pull, the same
  load as last reported) the report goes out only every `IDLE_LOAD_INTERVAL_S`: every report is a
  `collective_rpc`, and vLLM's workers busy-poll their shared-memory RPC queue for 1 s after each
  one (`SpinCondition.busy_loop_s`), so a 0.5 s report kept every idle worker spinning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncGenerator
from typing import Any

from connectors.vllm.engine import VllmEngine, VllmEngineSettings, events_endpoint, sampling_params
from connectors.vllm.params import (
    PDSERVE_ID,
    READER_TP,
    PdserveConnectorConfig,
    descriptor_from_params,
    descriptor_to_params,
)
from services.common.bound_ports import listen_port
from services.common.config import EngineConfig
from services.engine.backend import (
    BackendError,
    BackendLoad,
    DecodeInput,
    DuplicateRequest,
    Inspection,
    InvalidRequest,
    NotReady,
    PrefillInput,
    PrefillResult,
    RequestAborted,
    TokenDelta,
    check_reader_tp,
)
from services.engine.role_state import EngineRole

logger = logging.getLogger(__name__)

LOAD_INTERVAL_S = 0.5
IDLE_LOAD_INTERVAL_S = 5.0  # > vLLM's 1 s busy-poll window, so idle workers park on their socket
FINISH_REASONS = (None, "stop", "length", "abort")


class RequestFailed(BackendError):
    """vLLM ended the request with an error (INTERNAL: the scheduler retries it elsewhere)."""


class VllmBackend:
    """An `EngineBackend` over vLLM's async engine (see the module docstring)."""

    def __init__(self, config: EngineConfig, engine_address: str) -> None:
        self.config = config
        self.engine_address = engine_address
        self._epoch = secrets.randbits(63) | 1
        self.engine: VllmEngine | None = None
        self._ready = False
        self._draining = False
        # Changed in place (decision 0047): the SetRole reaches rank 0's worker, which this reads.
        self.role_state = EngineRole(config.role)
        self._live: dict[str, str] = {}  # request id -> "prefill" / "decode", while vLLM runs it
        self._worker_counts = [0, 0]  # pinned prefills, pulls vLLM waits on (rank 0's view)
        self._load_task: asyncio.Task[None] | None = None
        self._reported: tuple[Any, ...] = ()  # the load of the last report (`_load_key`)
        self._reported_at = 0.0  # the event loop's time of the last report

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def failed(self) -> bool:
        return self.engine is not None and self.engine.errored

    def set_draining(self, draining: bool) -> None:
        self._draining = draining

    async def start(self) -> None:
        cfg = self.config
        connector = PdserveConnectorConfig(
            engine_id=cfg.engine_id, role=cfg.role, epoch=self._epoch, scheduler=cfg.scheduler,
            engine_address=self.engine_address, hash_seed=cfg.hash_seed, transfer_timeout_s=cfg.transfer_timeout_s,
            lease_s=cfg.lease_s, max_inflight_transfers=cfg.max_inflight_transfers, ucx_tls=cfg.ucx_tls,
            ucx_net_devices=cfg.ucx_net_devices, metrics_port=cfg.metrics_port, metrics_any_port=listen_port("metrics_port", cfg.metrics_port, cfg.ephemeral_ports) == 0,
            ports_file=cfg.ports_file,
            events_endpoint=events_endpoint(cfg.engine_id, self._epoch), tls_ca=cfg.tls_ca, tls_cert=cfg.tls_cert,
            tls_key=cfg.tls_key, tls_server_name=cfg.tls_server_name, kv_staging=cfg.kv_staging)
        settings = VllmEngineSettings(
            model=cfg.model or _demo_model(), tp=cfg.tp, dtype=cfg.dtype, block_size=cfg.block_size,
            kv_cache_bytes=cfg.kv_cache_bytes, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=cfg.max_model_len, connector=connector,
            vllm_args=dict(getattr(cfg, "vllm", {}) or {}), torch_threads=cfg.torch_threads,
            gpu_memory_fraction=cfg.gpu_memory_fraction, devices=cfg.devices, self_check=cfg.vllm_self_check)
        self.engine = VllmEngine(settings)
        await self.engine.start()
        await self._refresh_load()
        self._ready = True
        self._load_task = asyncio.create_task(self._report_load_forever())

    async def _report_load_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(LOAD_INTERVAL_S)
            try:
                if not await self._idle_since_last_report() or loop.time() - self._reported_at >= IDLE_LOAD_INTERVAL_S:
                    await self._refresh_load()
            except Exception:  # the engine died: `failed` says so, the process exits
                logger.exception("reporting the vLLM engine's load failed")
                return

    async def _idle_since_last_report(self) -> bool:
        """No request in flight, no pin or pull at the last report, and the same load as then."""
        if self._live or any(self._worker_counts):
            return False
        return self._load_key(await self.load()) == self._reported

    def _load_key(self, load: BackendLoad) -> tuple[Any, ...]:
        return load.num_running, load.num_waiting, load.kv_usage, load.num_free_blocks, self._draining

    async def _refresh_load(self) -> None:
        assert self.engine is not None
        load = await self.load()
        answers = await self.engine.rpc("pdserve_report_load", load.num_running, load.num_waiting, load.kv_usage,
                                        load.num_free_blocks, self._draining, self.role_state.role_epoch)
        if answers:
            pinned, pulling, roles = answers[0]
            self._worker_counts = [pinned, pulling]
            self._follow_roles(roles)
        self._reported = self._load_key(load)
        self._reported_at = asyncio.get_running_loop().time()

    def _follow_roles(self, changes: list[tuple[str, int, str]]) -> None:
        """Rank 0's role changes, applied in order to the role the Engine API admits."""
        for role, role_epoch, reason in changes:
            self.role_state.take(self.config.engine_id, role, role_epoch, reason)

    async def sync_role(self) -> None:
        """Reads rank 0's role changes now (a call the role admitted last seen was refused)."""
        if self.engine is not None and self._ready:
            await self._refresh_load()

    def _require(self) -> VllmEngine:
        if self.engine is None or not self._ready:
            raise NotReady("engine is still starting")
        return self.engine

    def _admit(self, request_id: str, role: str) -> None:
        if request_id in self._live:
            raise DuplicateRequest(f"request {request_id} is already running here")
        self._live[request_id] = role

    # -- requests ----------------------------------------------------------------------------------

    async def prefill(self, request: PrefillInput) -> PrefillResult:
        engine = self._require()
        rid = request.request_id
        check_reader_tp(self.config.tp, request.decode_tp_size, engine.num_kv_heads())
        try:
            # Either role computes it: a peer fetch's (decision 0043) is a prefill of the prefix held here.
            params = sampling_params(request.sampling, max_tokens=1,
                                     kv_transfer_params={"do_remote_decode": True, PDSERVE_ID: rid,
                                                         READER_TP: request.decode_tp_size})
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        self._admit(rid, "prefill")
        try:
            async with contextlib.aclosing(_generate(engine, rid, request.prompt_token_ids, params)) as stream:
                deltas = [d async for d in stream]
        finally:
            self._live.pop(rid, None)
        last = deltas[-1]
        if last.finish_reason not in FINISH_REASONS:
            await self.release(rid)
            raise RequestFailed(f"vLLM ended request {rid}: {last.finish_reason}")
        if last.finish_reason == "abort" or not last.kv_transfer_params:
            await self.release(rid)
            raise RequestAborted(f"request {rid} was aborted")
        token_ids = [t for d in deltas for t in d.token_ids]
        reason = "stop" if last.finish_reason == "stop" else ("length" if request.sampling.max_tokens == 1 else None)
        return PrefillResult(token_ids[0], "".join(d.text for d in deltas), reason, deltas[0].num_cached_tokens,
                             descriptor_from_params(last.kv_transfer_params))

    async def decode(self, request: DecodeInput) -> AsyncGenerator[TokenDelta, None]:
        engine = self._require()
        rid = request.request_id
        outputs = list(request.output_token_ids)
        remaining = request.sampling.max_tokens - len(outputs)
        transfer: dict[str, Any] | None = None
        if request.descriptor is not None:
            transfer = {"do_remote_prefill": True, **descriptor_to_params(request.descriptor)}
            transfer[PDSERVE_ID] = rid
        try:
            if remaining < 1:
                raise ValueError(f"max_tokens {request.sampling.max_tokens} leaves nothing after {len(outputs)} "
                                 "tokens already generated")
            params = sampling_params(request.sampling, max_tokens=remaining, kv_transfer_params=transfer)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        self._admit(rid, "decode")
        prompt = list(request.prompt_token_ids) + outputs
        first = True
        try:
            async with contextlib.aclosing(_generate(engine, rid, prompt, params)) as deltas:
                async for d in deltas:
                    if d.finish_reason not in FINISH_REASONS:
                        raise RequestFailed(f"vLLM ended request {rid}: {d.finish_reason}")
                    delta = TokenDelta(d.token_ids, d.text, d.finish_reason)
                    if first:
                        first = False
                        delta.num_cached_tokens, delta.num_transferred_tokens = _split_cached(d, request)
                    yield delta
                    if d.finish_reason is not None:
                        return
        finally:
            self._live.pop(rid, None)

    async def abort(self, request_id: str) -> bool:
        engine = self._require()
        running = request_id in self._live
        await engine.abort(request_id)
        pinned = await self.release(request_id)
        return running or pinned

    async def release(self, request_id: str) -> bool:
        engine = self._require()
        return any(await engine.rpc("pdserve_release", request_id))

    async def load(self) -> BackendLoad:
        """vLLM's scheduler as of its last step, plus rank 0's pins and pulls."""
        view = self.engine.view if self.engine is not None else None
        total = self.engine.num_blocks() if self.engine is not None and self.engine.llm is not None else 0
        usage = view.kv_cache_usage if view is not None else 0.0
        pinned, pulling = self._worker_counts
        return BackendLoad(num_running=view.num_running if view else 0, num_waiting=view.num_waiting if view else 0,
                           num_pinned=pinned, num_waiting_for_remote_kv=pulling,
                           num_free_blocks=round(total * (1.0 - usage)), num_blocks=total, kv_usage=usage)

    async def inspect(self) -> Inspection:
        engine = self._require()
        await self._refresh_load()
        leaks = [leak for answer in await engine.rpc("pdserve_leaks") for leak in answer]
        if self._live:
            leaks.append(f"service: {len(self._live)} requests in flight")
        load = await self.load()
        if load.kv_usage > 0:
            leaks.append(f"vLLM block pool: {load.kv_usage:.1%} of the KV cache in use")
        return Inspection(load, leaks)

    def shutdown(self) -> None:
        if self._load_task is not None:
            self._load_task.cancel()
        if self.engine is not None:
            self.engine.shutdown()


async def _generate(engine: VllmEngine, rid: str, prompt: list[int], params: Any) -> AsyncGenerator[Any, None]:
    """The engine's deltas, with vLLM's input errors as InvalidRequest."""
    try:
        async for delta in engine.generate(rid, prompt, params):
            yield delta
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


def _split_cached(first: Any, request: DecodeInput) -> tuple[int, int]:
    """(cached, transferred) prompt tokens. vLLM counts both its local prefix hit and the KV its
    connector loaded as cached; the loaded part (vLLM's own per-request count) is transferred."""
    if request.descriptor is None or first.num_external_tokens is None:
        return first.num_cached_tokens, 0
    transferred = min(first.num_external_tokens, first.num_cached_tokens)
    return first.num_cached_tokens - transferred, transferred


def _demo_model() -> str:
    from engine.demo_model import demo_model_dir

    return str(demo_model_dir())
