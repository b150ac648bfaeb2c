"""`VllmEngine`: vLLM's `AsyncLLM` in-process, configured to serve behind the pdserve scheduler.

The engine service's vLLM backend (`services.engine.vllm`) drives it; this module holds every
vLLM import of that path (pdserve imports vLLM only under `connectors/vllm/`).

What pdserve fixes in vLLM's configuration (so it agrees with the scheduler and the other
engines): the KV connector (`PdserveConnector`, `kv_role=kv_both`, the engine's identity and
epoch in its extra config), the worker extension (`PdserveWorkerExtension`), prefix caching with
`sha256_cbor` block hashes and `PYTHONHASHSEED` = the cluster's hash seed (vLLM's NONE_HASH), the
block size, KV-cache events on a private `ipc://` ZMQ endpoint (forwarded by rank 0), the KV cache
budget, dtype and `tensor_parallel_size`. Everything else is vLLM's default or the user's `--vllm-arg`.

Defaults mean vLLM's own, so the defaults serve: `--dtype auto` is vLLM's auto (the checkpoint's
dtype where the platform supports it); an unset `--max-model-len` is vLLM's auto-fit (`-1`: the
model's context if the KV budget holds one such sequence, else the longest that fits — on CPU the
budget is `--kv-cache-memory`, 256 MiB by default, smaller than a float32 8k-token context of the
demo model). On CUDA the KV budget is `--gpu-memory-fraction` of the device's memory when set
(also vLLM's `gpu_memory_utilization`, so engines sharing a GPU pass vLLM's free-memory check),
else vLLM's `gpu_memory_utilization`; `--devices` becomes the workers' `CUDA_VISIBLE_DEVICES`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import tempfile
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from vllm import SamplingParams as VllmSamplingParams
from vllm import __version__ as vllm_version
from vllm.config import KVEventsConfig, KVTransferConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import StatLoggerBase

from connectors.vllm.greedy_check import CHECK_PROMPTS, CHECK_TOKENS, CompiledPathDiverges, GreedyCheck
from connectors.vllm.params import REFUSAL_FILE_ENV, PdserveConnectorConfig
from engine.request import SamplingParams
from services.engine.registry import EngineRefused

logger = logging.getLogger(__name__)

CONNECTOR_MODULE = "connectors.vllm.connector"
EXTENSION_CLS = "connectors.vllm.extension.PdserveWorkerExtension"
CPU_BLOCK_MULTIPLE = 32  # vLLM 0.32's CPU attention: "No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"


@dataclass(slots=True)
class VllmEngineSettings:
    """pdserve's settings of one vLLM engine (from `EngineConfig`)."""

    model: str
    tp: int
    dtype: str
    block_size: int
    kv_cache_bytes: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int  # 0: the model's
    connector: PdserveConnectorConfig
    vllm_args: dict[str, Any]
    # Compute threads of each vLLM worker process (pdserve's --torch-threads); 0: vLLM's choice.
    # vLLM's CPU worker forbids torch.set_num_threads, so this is OMP_NUM_THREADS of its workers
    # unless the environment sets that already.
    torch_threads: int = 0
    gpu_memory_fraction: float = 0.0  # CUDA: each rank's KV budget as a share of its GPU; 0: vLLM's own
    devices: str = ""  # CUDA: the GPUs of this engine's ranks ("0,1"), vLLM's CUDA_VISIBLE_DEVICES
    # At start, the serving path's greedy tokens against the model run eagerly (greedy_check.py).
    self_check: bool = True


@dataclass(slots=True)
class VllmDelta:
    """One streamed step of a request."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int
    kv_transfer_params: dict[str, Any] | None
    # Of num_cached_tokens, those vLLM loaded through the KV connector (its PrefillStats'
    # num_external_cached_tokens), on the request's first delta; None on the others.
    num_external_tokens: int | None = None


@dataclass(slots=True)
class SchedulerView:
    """vLLM's scheduler as of its last step (its stats, as a stat logger receives them)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0


def _stat_logger(view: SchedulerView) -> Any:
    class LatestStats(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                view.num_running = int(scheduler_stats.num_running_reqs)
                view.num_waiting = int(scheduler_stats.num_waiting_reqs)
                view.kv_cache_usage = float(scheduler_stats.kv_cache_usage)

        def log_engine_initialized(self) -> None:
            pass

    return LatestStats


def events_endpoint(engine_id: str, epoch: int) -> str:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)
    return f"ipc://{tempfile.gettempdir()}/pdserve-kv-events-{safe}-{epoch:x}"


AUTO_FIT_MAX_MODEL_LEN = -1  # vLLM: the longest context the KV budget holds, up to the model's


def kv_budget(s: VllmEngineSettings, *, cuda: bool, device_memory_bytes: int = 0) -> dict[str, Any]:
    """vLLM's KV-budget arguments: on CPU `kv_cache_memory_bytes` from --kv-cache-memory; on CUDA
    the --gpu-memory-fraction share of the device's memory (and the same share as vLLM's
    `gpu_memory_utilization`, its start-up check of free memory), or nothing (vLLM's
    `gpu_memory_utilization`, which --vllm-arg may set) when the fraction is 0."""
    if not cuda:
        return {"kv_cache_memory_bytes": s.kv_cache_bytes}
    if s.gpu_memory_fraction > 0:
        # vLLM sizes the KV by kv_cache_memory_bytes and still refuses to start unless
        # gpu_memory_utilization of the GPU is free (0.92 by default): the second engine on a
        # shared GPU (`pdserve up`'s placement) would never start. The KV share is what must be free.
        return {"kv_cache_memory_bytes": int(device_memory_bytes * s.gpu_memory_fraction),
                "gpu_memory_utilization": s.gpu_memory_fraction}
    return {}


def executor_env(s: VllmEngineSettings, *, cuda: bool) -> dict[str, str]:
    """vLLM environment for the engine's executor: on CPU at tp 1 the worker runs inside vLLM's
    engine-core process ("uni" executor, `VLLM_ENABLE_V1_MULTIPROCESSING=0`) instead of a process
    of its own. vLLM's CPU platform otherwise forces its multiprocessing executor, whose engine
    core and worker each busy-wait (`sched_yield`) on their shared-memory queue between steps:
    two spinning processes per engine beside the compute, which on a 2-core host running a
    prefill and a decode engine took the cores the decode steps needed (decision 0024). The
    environment wins when it sets the variable; tp > 1 and CUDA keep vLLM's choice."""
    return {} if cuda or s.tp != 1 else {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _cuda_memory_bytes() -> tuple[bool, int]:
    """Whether vLLM runs on CUDA here, and the total memory of the first visible GPU."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda_alike():
        return False, 0
    import torch

    return True, int(torch.cuda.get_device_properties(0).total_memory)


def worker_environment(s: VllmEngineSettings, environ: Mapping[str, str]) -> dict[str, str]:
    """What this process's environment gets before vLLM starts (its workers inherit it):
    `PYTHONHASHSEED` (vLLM's NONE_HASH), `OMP_NUM_THREADS` from --torch-threads unless set, and
    for --devices the workers' `CUDA_VISIBLE_DEVICES` — indices among the GPUs this process
    sees, so an inherited `CUDA_VISIBLE_DEVICES` (a device plugin's "4,5", or GPU UUIDs) is
    mapped through, never replaced. Raises ValueError for an index it does not hold."""
    env = {"PYTHONHASHSEED": s.connector.hash_seed}
    if s.torch_threads > 0 and "OMP_NUM_THREADS" not in environ:
        env["OMP_NUM_THREADS"] = str(s.torch_threads)
    if s.devices:
        from engine.device import parse_devices

        ids = parse_devices(s.devices)
        inherited = environ.get("CUDA_VISIBLE_DEVICES")
        if inherited is None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, ids))
        else:
            visible = [x.strip() for x in inherited.split(",") if x.strip()]
            if any(i >= len(visible) for i in ids):
                raise ValueError(f"--devices {s.devices}: this process sees {len(visible)} GPU(s) "
                                 f"(CUDA_VISIBLE_DEVICES={inherited!r}); indices are among those")
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[i] for i in ids)
    return env


COMPILE_ARGS = ("enforce_eager", "compilation_config")


def compile_defaults(s: VllmEngineSettings, *, cuda: bool) -> dict[str, Any]:
    """pdserve's one departure from vLLM's compile default: on CPU the model runs eagerly
    (`enforce_eager`) unless `--vllm-arg` sets `enforce_eager` or `compilation_config`. vLLM's
    CPU default compiles the model with inductor, whose fused bfloat16 graph answered the README's
    question wrongly where the eager forward and float32 answer right, and takes minutes to
    compile at every start (decision 0040). CUDA keeps vLLM's default (compiled, CUDA graphs),
    which the start-up self-check compares with the eager forward."""
    if cuda or any(name in s.vllm_args for name in COMPILE_ARGS):
        return {}
    return {"enforce_eager": True}


def engine_args(s: VllmEngineSettings, *, cuda: bool = False, device_memory_bytes: int = 0) -> AsyncEngineArgs:
    kwargs: dict[str, Any] = dict(
        model=s.model, tensor_parallel_size=s.tp, dtype=s.dtype, block_size=s.block_size,
        **kv_budget(s, cuda=cuda, device_memory_bytes=device_memory_bytes), max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens, max_model_len=s.max_model_len or AUTO_FIT_MAX_MODEL_LEN,
        enable_prefix_caching=True, prefix_caching_hash_algo="sha256_cbor",
        worker_extension_cls=EXTENSION_CLS,
        kv_transfer_config=KVTransferConfig(kv_connector="PdserveConnector", kv_connector_module_path=CONNECTOR_MODULE,
                                            kv_role="kv_both", kv_load_failure_policy="recompute",
                                            kv_connector_extra_config=_asdict(s.connector)),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=bool(s.connector.events_endpoint), publisher="zmq",
                                        endpoint=s.connector.events_endpoint or "tcp://*:5557", replay_endpoint=None,
                                        topic=f"kv@{s.connector.engine_id}"),
    )
    kwargs.update(compile_defaults(s, cuda=cuda))
    known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    unknown = sorted(set(s.vllm_args) - known)
    if unknown:
        raise ValueError(f"vllm: not vLLM {vllm_version} engine arguments: {', '.join(unknown)}")
    kwargs.update(s.vllm_args)
    return AsyncEngineArgs(**kwargs)


def _asdict(config: PdserveConnectorConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__slots__}  # type: ignore[attr-defined]


def sampling_params(p: SamplingParams, *, max_tokens: int, kv_transfer_params: dict[str, Any] | None) -> VllmSamplingParams:
    """pdserve's sampling params as vLLM's (streamed as deltas); raises ValueError on bad values."""
    return VllmSamplingParams(
        n=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else 0, seed=p.seed,
        max_tokens=max_tokens, stop=list(p.stop) or None, stop_token_ids=list(p.stop_token_ids) or None,
        ignore_eos=p.ignore_eos, output_kind=RequestOutputKind.DELTA, detokenize=p.detokenize,
        extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None)


def _record_external_tokens(processor: Any, into: dict[str, int]) -> None:
    """Wraps vLLM's output processor so that each request's first output records how many of its
    prompt tokens vLLM loaded through the KV connector (`PrefillStats.num_external_cached_tokens`,
    by external request id) before the output reaches the request's stream. vLLM's
    RequestOutput carries only the sum of local prefix hits and loaded tokens."""
    process_outputs = processor.process_outputs

    def recording(engine_core_outputs: list[Any], *args: Any, **kwargs: Any) -> Any:
        for output in engine_core_outputs:
            stats = output.prefill_stats
            state = processor.request_states.get(output.request_id) if stats is not None else None
            if state is not None:
                into[state.external_req_id] = int(stats.num_external_cached_tokens)
        return process_outputs(engine_core_outputs, *args, **kwargs)

    processor.process_outputs = recording


class VllmEngine:
    """vLLM's async engine with pdserve's connector (see the module docstring)."""

    def __init__(self, settings: VllmEngineSettings) -> None:
        self.settings = settings
        self.llm: AsyncLLM | None = None
        self.view = SchedulerView()
        self._external_tokens: dict[str, int] = {}  # vLLM's external request id -> connector-loaded tokens

    async def start(self) -> None:
        # Before vLLM (or torch) first touches CUDA in this process: its workers inherit it.
        os.environ.update(worker_environment(self.settings, os.environ))
        cuda, device_memory = _cuda_memory_bytes()
        if not cuda and self.settings.block_size % CPU_BLOCK_MULTIPLE:
            raise ValueError(f"block_size {self.settings.block_size}: vLLM's CPU attention needs a multiple of "
                             f"{CPU_BLOCK_MULTIPLE}; run the whole cluster (scheduler and engines) with "
                             f"--block-size {CPU_BLOCK_MULTIPLE}")
        for name, value in executor_env(self.settings, cuda=cuda).items():
            os.environ.setdefault(name, value)
        args = engine_args(self.settings, cuda=cuda, device_memory_bytes=device_memory)
        fd, refusal = tempfile.mkstemp(prefix="pdserve-vllm-refusal-")
        os.close(fd)
        os.environ[REFUSAL_FILE_ENV] = refusal  # the engine core inherits it
        try:
            self.llm = AsyncLLM.from_engine_args(args, stat_loggers=[_stat_logger(self.view)])
        except Exception as e:
            with open(refusal) as f:
                reason = f.read().strip()
            if reason:
                raise EngineRefused(f"vLLM engine {self.settings.connector.engine_id} refused at start: {reason}") from e
            raise
        finally:
            os.unlink(refusal)
        _record_external_tokens(self.llm.output_processor, self._external_tokens)
        if self.settings.self_check:
            try:
                await self._self_check()
            except BaseException:
                self.shutdown()  # vLLM's engine-core process goes with the refusal
                raise
        await self.llm.collective_rpc("pdserve_connect")
        logger.info("vLLM engine %s ready (%d KV blocks of %d tokens)", self.settings.connector.engine_id,
                    self.num_blocks(), self.settings.block_size)

    async def _self_check(self) -> None:
        """Before the engine registers: the check prompts greedy on the serving path, then with
        every compiled module run eagerly; raises EngineRefused when the tokens differ. The
        prefix cache is emptied before the reference run (its prompts are computed afresh) and
        after (no check prompt stays cached)."""
        assert self.llm is not None
        switched = await self.llm.collective_rpc("pdserve_eager_forward", args=(True,))
        await self.llm.collective_rpc("pdserve_eager_forward", args=(False,))
        if not any(switched):
            logger.info("self-check skipped: vLLM runs this model eagerly, the serving path is the reference")
            return
        prompts = await self._check_prompts()
        served = await self._greedy(prompts, "served")
        await self.llm.reset_prefix_cache()
        await self.llm.collective_rpc("pdserve_eager_forward", args=(True,))
        try:
            reference = await self._greedy(prompts, "reference")
        finally:
            await self.llm.collective_rpc("pdserve_eager_forward", args=(False,))
            await self.llm.reset_prefix_cache()
        check = GreedyCheck(tuple(text for text, _ in CHECK_PROMPTS), served, reference)
        try:
            check.verify()
        except CompiledPathDiverges as e:
            raise EngineRefused(f"vLLM engine {self.settings.connector.engine_id} refused at start: {e}") from None
        logger.info("self-check passed: %d prompts, %d greedy tokens each, identical compiled and eager",
                    len(prompts), CHECK_TOKENS)

    async def _check_prompts(self) -> list[list[int]]:
        assert self.llm is not None
        tokenizer = self.llm.get_tokenizer()
        prompts = []
        for text, chat in CHECK_PROMPTS:
            if chat and getattr(tokenizer, "chat_template", None):
                ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                    tokenize=True)
                ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
            else:
                ids = tokenizer.encode(text)
            prompts.append([int(t) for t in ids])
        return prompts

    async def _greedy(self, prompts: list[list[int]], mode: str) -> tuple[tuple[int, ...], ...]:
        """Each prompt alone (never batched with another: both runs step the same batches)."""
        assert self.llm is not None
        params = VllmSamplingParams(n=1, temperature=0.0, max_tokens=CHECK_TOKENS, ignore_eos=True,
                                    output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)
        answers = []
        for i, prompt in enumerate(prompts):
            tokens: list[int] = []
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=prompt), params,
                                               f"pdserve-self-check-{mode}-{i}-{secrets.token_hex(4)}"):
                tokens = list(out.outputs[0].token_ids)
            answers.append(tuple(tokens))
        return tuple(answers)

    def num_kv_heads(self) -> int:
        """The model's KV heads over all ranks (what a reader's TP must map onto)."""
        assert self.llm is not None
        return int(self.llm.vllm_config.model_config.get_total_num_kv_heads())

    def num_blocks(self) -> int:
        assert self.llm is not None
        return int(self.llm.vllm_config.cache_config.num_gpu_blocks or 0)

    @property
    def errored(self) -> bool:
        return self.llm is not None and bool(self.llm.errored)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: VllmSamplingParams
                       ) -> AsyncIterator[VllmDelta]:
        """Streams the request's deltas; cancelling the iteration aborts it in vLLM."""
        assert self.llm is not None
        try:
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=prompt_token_ids), params, request_id):
                completion = out.outputs[0]
                yield VllmDelta(list(completion.token_ids), completion.text, completion.finish_reason,
                                int(out.num_cached_tokens or 0), out.kv_transfer_params,
                                self._external_tokens.pop(request_id, None))
        finally:
            self._external_tokens.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        assert self.llm is not None
        await self.llm.abort(request_id)

    async def rpc(self, method: str, *args: Any) -> list[Any]:
        """Calls a `PdserveWorkerExtension` method on every worker; one answer per worker."""
        assert self.llm is not None
        return list(await self.llm.collective_rpc(method, args=args))

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
