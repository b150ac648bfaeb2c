"""LLMEngine: the synchronous, step-driven engine the services and `pdserve offline` drive.

One engine = one model over `tp` ranks, one paged KV cache per rank, one BatchScheduler. Call
`add_request(...)`, then `step()` until `has_unfinished_requests()` is False. Every public
method validates first and raises ValueError on bad input without changing any state.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from connectors.base import SchedulerConnector
from connectors.hashing import DEFAULT_HASH_SEED, BlockHasher
from connectors.kv_events import KVCacheEvent
from engine.batch_scheduler import BatchScheduler, BatchSchedulerConfig
from engine.block_pool import BlockPool
from engine.byte_size import parse_size
from engine.config import KVCacheSpec, ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.device import DevicePlan, cpu_has_native_bf16, plan_devices, probe_host, resolve_kind
from engine.device import resolve_dtype as _resolve_dtype
from engine.kv_cache import make_kv_cache_spec
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.request import Request, RequestMode, RequestOutput, RequestStatus, SamplingParams
from engine.sampler import Sampler
from engine.workers import DTYPES, RankInitHook, RankSetup, Workers

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineLoad:
    num_running: int
    num_waiting: int
    num_pinned: int
    num_waiting_for_remote_kv: int
    kv_usage: float
    num_free_blocks: int
    num_blocks: int


def resolve_device(device: str) -> str:
    """The device kind (cpu or cuda) `device` (auto, cpu, cuda) means on this host; raises
    DeviceUnavailableError for cuda without a GPU."""
    return resolve_kind(device, probe_host())


def resolve_dtype(dtype: str, device: str) -> str:
    """The dtype name `dtype` (auto or a name) means on a device of kind `device` (see
    engine/device.py: bf16 on CUDA, and on CPUs with native bf16)."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    return _resolve_dtype(dtype, kind, kind == "cpu" and cpu_has_native_bf16())


def kv_memory_bytes(kv_cache_memory: int | str, gpu_memory_fraction: float, plan: DevicePlan) -> int:
    """The per-rank KV budget: `gpu_memory_fraction` of rank 0's GPU memory on CUDA when set,
    else `kv_cache_memory`."""
    if not 0.0 <= gpu_memory_fraction < 1.0:
        raise ValueError(f"gpu_memory_fraction must be in [0, 1), got {gpu_memory_fraction}")
    if gpu_memory_fraction == 0.0 or plan.kind != "cuda":
        return parse_size(kv_cache_memory)
    _, total = torch.cuda.mem_get_info(torch.device(plan.device_for(0)))
    return int(total * gpu_memory_fraction)


class LLMEngine:
    def __init__(self, model: str | Path | None = None, *, tp: int = 1, kv_cache_memory: int | str = "256MiB",
                 block_size: int = 16, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 max_model_len: int = 0, dtype: str = "auto", device: str = "auto",
                 hash_seed: str = DEFAULT_HASH_SEED, kv_medium: str = "", torch_threads: int = 0,
                 num_blocks: int | None = None, rank_init: RankInitHook | None = None,
                 scheduler_connector: SchedulerConnector | None = None, load_tokenizer: bool = True,
                 devices: str = "", gpu_memory_fraction: float = 0.0, tp_timeout_s: float = 300.0) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if tp_timeout_s <= 0:
            raise ValueError(f"tp_timeout_s must be > 0, got {tp_timeout_s}")
        if model is None or str(model) == "":
            from engine.demo_model import demo_model_dir

            model = demo_model_dir()
        self.device_plan = plan_devices(device, dtype, tp, devices)
        self.model_config = ModelConfig.from_dir(model, dtype=self.device_plan.dtype, max_model_len=max_model_len)
        self.model_config.check_tp(tp)
        threads = torch_threads or max(1, (os.cpu_count() or 1) // tp)
        torch.set_num_threads(threads)
        element_size = torch.tensor([], dtype=DTYPES[self.model_config.dtype]).element_size()
        self.kv_cache_spec: KVCacheSpec = make_kv_cache_spec(
            self.model_config, block_size=block_size,
            memory_bytes=kv_memory_bytes(kv_cache_memory, gpu_memory_fraction, self.device_plan), tp_size=tp,
            num_blocks=num_blocks, element_size=element_size, device_kind=self.device_plan.kind)
        self.tokenizer = _load_tokenizer(Path(model)) if load_tokenizer else None
        self.medium = kv_medium or ("GPU" if self.device_plan.kind == "cuda" else "CPU")
        pool = BlockPool(self.kv_cache_spec.num_blocks, block_size, medium=self.medium)
        self.hasher = BlockHasher(block_size, hash_seed)
        self.kv = KVCacheManager(pool, self.hasher)
        self.batch_scheduler = BatchScheduler(
            BatchSchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
            self.kv, connector=scheduler_connector)
        self.sampler = Sampler()
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._order = 0
        logger.info("engine on %s (tp %d)", self.device_plan.describe(), tp)
        self.workers = Workers(RankSetup(self.model_config, self.kv_cache_spec, self.device_plan.rank_devices,
                                         threads, rank_init, timeout_s=tp_timeout_s))
        # Finished ids reach the worker connectors even in a step with nothing to compute.
        self._has_connectors = rank_init is not None
        self._closed = False

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    mode: RequestMode = RequestMode.NORMAL, output_token_ids: list[int] | None = None,
                    remote_kv_tokens: int | None = None) -> None:
        """Queues a request (see module doc of engine/request.py for the modes). ValueError on bad
        input; NoFreeBlocksError (a RuntimeError) when a REMOTE_KV request's prompt blocks do not
        fit now. Either way nothing changes. `remote_kv_tokens` (REMOTE_KV only): the tokens
        whose KV the data plane brings (default: all but the last token); the rest is computed
        here, e.g. after a peer fetch of a prefix."""
        outputs = list(output_token_ids or [])
        self._validate(request_id, prompt_token_ids, params, outputs)
        request = Request(request_id, list(prompt_token_ids), params, mode=mode,
                          all_token_ids=list(prompt_token_ids) + outputs,
                          num_initial_output_tokens=len(outputs), arrival_order=self._order)
        if remote_kv_tokens is not None:
            if mode is not RequestMode.REMOTE_KV or not 0 < remote_kv_tokens < len(request.all_token_ids):
                raise ValueError(f"remote_kv_tokens {remote_kv_tokens} needs a REMOTE_KV request of more tokens")
            request.remote_kv_target = remote_kv_tokens
        self.batch_scheduler.add_request(request)
        self._order += 1
        self.sampler.add_request(request_id, params)
        if self.tokenizer is not None and params.detokenize:
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, request.all_token_ids, params.stop)

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams, outputs: list[int]) -> None:
        cfg = self.model_config
        if not request_id:
            raise ValueError("request_id must be non-empty")
        if request_id in self.batch_scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise ValueError("prompt is empty")
        bad = [t for t in prompt + outputs if not isinstance(t, int) or not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {cfg.vocab_size}): {bad[:5]}")
        params.validate(cfg.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (model directory has no tokenizer.json)")
        total = len(prompt) + len(outputs)
        if total >= cfg.max_model_len:
            raise ValueError(f"prompt of {total} tokens does not fit max_model_len {cfg.max_model_len} "
                             "(one token must remain to generate)")
        if len(outputs) >= params.max_tokens:
            raise ValueError(f"{len(outputs)} output tokens already given but max_tokens is {params.max_tokens}")
        need = cdiv(min(total + params.max_tokens, cfg.max_model_len), self.kv_cache_spec.block_size)
        if cdiv(total + 1, self.kv_cache_spec.block_size) > self.kv_cache_spec.num_blocks:
            raise ValueError(f"prompt of {total} tokens needs more KV blocks than the cache has "
                             f"({self.kv_cache_spec.num_blocks}); raise --kv-cache-memory")
        if need > self.kv_cache_spec.num_blocks:
            logger.warning("request %s may need %d blocks of %d; it can be preempted repeatedly",
                           request_id, need, self.kv_cache_spec.num_blocks)

    def finish_remote_kv(self, request_id: str, ok: bool, invalid_block_ids: set[int] | None = None) -> None:
        """The data plane finished filling a REMOTE_KV request's blocks (ok) or failed; what was
        not received (not ok, or blocks from the first invalid one on) is recomputed locally."""
        self.batch_scheduler.finish_remote_kv(request_id, ok, set(invalid_block_ids or ()))

    def abort_request(self, request_id: str) -> bool:
        """Ends a request in any state (a pinned one is released). The next step() reports it once
        with finish_reason "abort" (except pinned ones, which had finished already)."""
        request = self.batch_scheduler.requests.get(request_id)
        if request is None:
            return False
        was_pinned = request.status is RequestStatus.PINNED
        self.batch_scheduler.abort(request_id)
        self._forget(request_id)
        if not was_pinned:
            self._pending_outputs.append(RequestOutput(request_id, [], "", True, "abort",
                                                       request.num_cached_tokens or 0, request.num_prompt_tokens))
        return True

    def pin_cached_prefix(self, request_id: str, prompt_token_ids: list[int]) -> int:
        """A peer-fetch pin: `request_id` holds the longest cached prefix of the prompt's full
        blocks, PINNED for readers (`release` / `abort_request` end it), without a step or any
        compute. Returns the tokens pinned (a multiple of the block size); 0, with nothing
        changed, when the prompt's first block is not cached. ValueError on bad input."""
        params = SamplingParams(max_tokens=1, detokenize=False)
        self._validate(request_id, prompt_token_ids, params, [])
        request = Request(request_id, list(prompt_token_ids), params, mode=RequestMode.PREFILL_ONLY,
                          all_token_ids=list(prompt_token_ids), arrival_order=self._order)
        num_tokens = self.batch_scheduler.pin_cached(request)
        if num_tokens:
            self._order += 1
        return num_tokens

    def release(self, request_id: str) -> bool:
        """Frees a PINNED (prefill-only, finished) request's blocks. Idempotent: False when the
        request is not pinned (already released, aborted or unknown)."""
        return self.batch_scheduler.release(request_id)

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one batch; returns what each touched request produced."""
        outputs, self._pending_outputs = self._pending_outputs, []
        plan = self.batch_scheduler.schedule()
        for request in self.batch_scheduler.take_capacity_finished():
            self._forget(request.request_id)
            outputs.append(RequestOutput(request.request_id, [], "", True, "length",
                                         request.num_cached_tokens or 0, request.num_prompt_tokens))
        idle = not plan.chunks and not (plan.finished_ids and self._has_connectors)
        if idle and _no_commands(plan.connector_meta):
            return outputs
        logits = self.workers.execute(plan)
        sampled: dict[str, int] = {}
        if logits is not None:
            ids = [c.request_id for c in plan.chunks if c.sample]
            params = [self.batch_scheduler.requests[i].params for i in ids]
            sampled = dict(zip(ids, self.sampler.sample(logits, ids, params), strict=True))
        for request, token in self.batch_scheduler.update_from_output(plan, sampled):
            outputs.append(self._process_token(request, token))
        return outputs

    def flush_commands(self) -> None:
        """Hands the connector commands queued since the last step (a finished prefill's send)
        and the finished ids to every rank without computing anything: queued prompts wait for
        the next `step`."""
        plan = self.batch_scheduler.schedule_commands()
        if _no_commands(plan.connector_meta) and not (plan.finished_ids and self._has_connectors):
            return
        self.workers.execute(plan)

    def _process_token(self, request: Request, token: int) -> RequestOutput:
        detok = self._detok.get(request.request_id)
        delta = detok.add(token) if detok is not None else ""
        reason = self._finish_reason(request, token, detok)
        if reason is not None and detok is not None:
            delta += detok.flush()
        out = RequestOutput(request.request_id, [token], delta, reason is not None, reason,
                            request.num_cached_tokens or 0, request.num_prompt_tokens)
        if reason is not None:
            self.batch_scheduler.finish_request(request.request_id, reason)
            self._forget(request.request_id)
        return out

    def _finish_reason(self, request: Request, token: int, detok: IncrementalDetokenizer | None) -> str | None:
        p = request.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.model_config.eos_token_ids):
            return "stop"
        if detok is not None and detok.stopped:
            return "stop"
        if request.num_output_tokens >= p.max_tokens or request.num_tokens >= self.model_config.max_model_len:
            return "length"
        if request.mode is RequestMode.PREFILL_ONLY:
            return "length"
        return None

    def _forget(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
        self.sampler.remove_request(request_id)

    # -- introspection ----------------------------------------------------------------------

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.kv.get_block_ids(request_id)

    def num_local_cached_tokens(self, request_id: str) -> int:
        """Tokens of the request served by this engine's own prefix cache (0 for unknown ids)."""
        request = self.batch_scheduler.requests.get(request_id)
        return (request.num_cached_tokens or 0) if request is not None else 0

    def has_outputs_to_report(self) -> bool:
        """An abort's (or a capacity finish's) output waits for the next step() to report it."""
        return bool(self._pending_outputs)

    def has_unfinished_requests(self) -> bool:
        s = self.batch_scheduler
        return s.has_unfinished_requests() or bool(self._pending_outputs) or \
            (self._has_connectors and bool(s._finished_since_plan))

    def take_events(self) -> list[KVCacheEvent]:
        return self.kv.pool.take_events()

    def take_connector_outputs(self) -> list[Any]:
        """Rank 0's worker-connector outputs not taken by a `report_output` hook (drained)."""
        outs, self.workers.rank0.outputs = self.workers.rank0.outputs, []
        return outs

    def reset_prefix_cache(self) -> bool:
        return self.kv.pool.reset_prefix_cache()

    def load(self) -> EngineLoad:
        s = self.batch_scheduler
        return EngineLoad(len(s.running), len(s.waiting), len(s.pinned), len(s.remote), self.kv.pool.usage(),
                          self.kv.pool.num_free_blocks, self.kv.pool.num_blocks)

    @property
    def kv_cache(self) -> torch.Tensor:
        """Rank 0's KV cache tensor (layout of KVCacheSpec)."""
        return self.workers.kv_cache

    def check_leaks(self) -> list[str]:
        problems = self.batch_scheduler.check_leaks()
        if self._detok:
            problems.append(f"detokenizers left: {sorted(self._detok)[:10]}")
        if self.sampler.num_generators:
            problems.append(f"sampler generators left: {self.sampler.num_generators}")
        return problems

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.workers.shutdown()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- conveniences -----------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Runs prompts concurrently to completion; returns the generated token ids per prompt."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{self._order + i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        result: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished_requests():
            for out in self.step():
                result[out.request_id].extend(out.new_token_ids)
        return [result[rid] for rid in ids]


def _no_commands(connector_meta: Any) -> bool:
    """True when the step plan carries nothing for the ranks' connectors: a plan without
    chunks is still broadcast when it does (e.g. data-plane commands between forwards)."""
    from connectors.base import EmptyConnectorMetadata

    if connector_meta is None or isinstance(connector_meta, EmptyConnectorMetadata):
        return True
    is_empty = getattr(connector_meta, "is_empty", None)
    return bool(is_empty()) if callable(is_empty) else False


def _load_tokenizer(model_dir: Path) -> Any:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        logger.warning("%s has no tokenizer.json: outputs carry token ids only", model_dir)
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
