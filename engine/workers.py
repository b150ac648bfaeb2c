"""Rank workers: one per tensor-parallel rank, each with its model shard and KV cache.

Rank 0 lives in the engine's process; ranks 1..N-1 are spawned processes. They form a gloo
process group of their own (a private TCPStore + ProcessGroupGloo, so several engines can live
in one process). Every step rank 0 broadcasts the StepPlan (pickled, over gloo); every rank runs
its shard (o_proj / down_proj outputs are all-reduced: over gloo on CPU, over a NCCL group on the
same store when the ranks run on CUDA), and rank 0 samples from the logits. A None plan tells
the ranks to shut down. Rank r runs on `RankSetup.devices[r]` (engine/device.py decides).

Per step, every rank drives its optional worker-side connector: `start_load_kv(meta)` before the
forward, `wait_for_save()` after, then `collect_output(...)`; a non-empty output is handed to
the connector's `report_output(output)` when it has one (the services wire that to the rank's
control stream), otherwise rank 0 keeps it for `LLMEngine.take_connector_outputs()`.

Idle ranks never time out: ranks 1..N wait for the next plan in a gloo broadcast bounded by the
group's timeout (`RankSetup.timeout_s`, which also bounds every all-reduce of a step), and rank 0
broadcasts only when there is work — so while the engine is idle, a keepalive thread on rank 0
broadcasts `KEEPALIVE` every `keepalive_s` (a quarter of the timeout, at most 30 s). The waits
stay bounded, so a rank whose peer died or hung still fails within the timeout; a rank 0 killed
outright closes its gloo connections and the others fail at once.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from connectors.base import WorkerConnector, collect_output
from engine.batch_scheduler import StepPlan
from engine.config import KVCacheSpec, ModelConfig
from engine.device import bind_thread_device
from engine.kv_cache import allocate_kv_cache
from engine.model_runner import ModelRunner
from engine.models import load_model

logger = logging.getLogger(__name__)

RankInitHook = Callable[[int, int, torch.Tensor, KVCacheSpec], WorkerConnector | None]
"""(rank, tp_size, kv_cache, spec) -> WorkerConnector | None; must be picklable for tp > 1."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

KEEPALIVE = "keepalive"
"""What rank 0 broadcasts instead of a plan while idle; the other ranks wait again."""
MAX_KEEPALIVE_S = 30.0


def keepalive_interval(timeout_s: float) -> float:
    """How often an idle rank 0 broadcasts: well inside the ranks' wait timeout."""
    return min(MAX_KEEPALIVE_S, timeout_s / 4)


@dataclass(slots=True)
class RankSetup:
    """Everything a rank needs to build itself (picklable)."""

    model_config: ModelConfig
    spec: KVCacheSpec
    devices: tuple[str, ...]  # one per rank: "cpu" or "cuda:N"
    torch_threads: int
    rank_init: RankInitHook | None = None
    store_port: int = 0
    timeout_s: float = 300.0


class TPGroup:
    """The ranks of one engine: gloo for control (plans) and CPU tensors, NCCL for CUDA tensors."""

    def __init__(self, rank: int, size: int, store: Any, timeout_s: float, device: str = "cpu") -> None:
        self.rank, self.size = rank, size
        self._store = store
        timeout = datetime.timedelta(seconds=timeout_s)
        self.pg: Any = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.nccl: Any = _nccl_group(store, rank, size, timeout) if device.startswith("cuda") else None

    def all_reduce(self, t: torch.Tensor) -> None:
        pg = self.nccl if t.is_cuda and self.nccl is not None else self.pg
        pg.allreduce([t]).wait()

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's obj, on every rank."""
        if self.rank == 0:
            data = pickle.dumps(obj)
            size = torch.tensor([len(data)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.pg.broadcast([size], dist.BroadcastOptions()).wait()
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else \
            torch.empty(int(size.item()), dtype=torch.uint8)
        self.pg.broadcast([buf], dist.BroadcastOptions()).wait()
        return obj if self.rank == 0 else pickle.loads(buf.numpy().tobytes())


def _nccl_group(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    """A NCCL group over the same store (keys prefixed apart from gloo's); the caller has set
    its CUDA device already, so NCCL binds this rank to that GPU."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, options)


class RankWorker:
    """One rank's model shard, KV cache and worker connector."""

    def __init__(self, setup: RankSetup, rank: int, group: TPGroup | None) -> None:
        tp = setup.spec.tp_size
        dtype = DTYPES[setup.model_config.dtype]
        device = setup.devices[rank]
        self.rank = rank
        self.group = group
        self.device = device
        model = load_model(setup.model_config, rank=rank, tp_size=tp,
                           all_reduce=group.all_reduce if group is not None else None,
                           device=device, dtype=dtype)
        self.kv_cache = allocate_kv_cache(setup.spec, dtype, device)
        self.runner = ModelRunner(model, self.kv_cache, setup.spec.block_size, device)
        self.connector = setup.rank_init(rank, tp, self.kv_cache, setup.spec) if setup.rank_init else None
        if self.connector is not None:
            self.connector.register_kv_caches(self.kv_cache, setup.spec)
        self.outputs: list[Any] = []
        self._warned = False

    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        c = self.connector
        if c is not None:
            c.start_load_kv(plan.connector_meta)
        logits = self.runner.execute(plan, compute_logits=self.rank == 0)
        if c is not None:
            if self.device.startswith("cuda"):
                # The step's KV writes are complete before the connector may hand blocks to UCX,
                # which copies on its own streams.
                torch.cuda.current_stream().synchronize()
            c.wait_for_save()
            self._collect(plan)
        return logits

    def _collect(self, plan: StepPlan) -> None:
        assert self.connector is not None
        output = collect_output(self.connector, frozenset(plan.finished_ids))
        if output.is_empty():
            return
        report = getattr(self.connector, "report_output", None)
        if callable(report):
            report(output)
        elif self.rank == 0:
            self.outputs.append(output)
        elif not self._warned:
            # Nobody could drain it here: a rank > 0 without a report hook drops its outputs.
            logger.warning("rank %d: worker connector has no report_output; dropping its outputs", self.rank)
            self._warned = True

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
            self.connector = None


def _rank_main(setup: RankSetup, rank: int) -> None:
    torch.set_num_threads(setup.torch_threads)
    store = dist.TCPStore("127.0.0.1", setup.store_port, setup.spec.tp_size, False,
                          timeout=datetime.timedelta(seconds=setup.timeout_s))
    try:
        bind_thread_device(setup.devices[rank])
    except Exception as e:
        store.set(f"error{rank}", f"{type(e).__name__}: {e}")
        raise
    store.set(f"started{rank}", "1")
    group = TPGroup(rank, setup.spec.tp_size, store, setup.timeout_s, setup.devices[rank])
    try:
        worker = RankWorker(setup, rank, group)
    except Exception as e:
        store.set(f"error{rank}", f"{type(e).__name__}: {e}")
        raise
    store.set(f"loaded{rank}", "1")
    group.broadcast_object("ready")
    try:
        while True:
            plan = group.broadcast_object(None)
            if plan is None:
                break
            if plan != KEEPALIVE:
                worker.execute(plan)
    finally:
        worker.shutdown()


class Workers:
    """The engine's ranks: rank 0 in-process, the others as spawned processes."""

    def __init__(self, setup: RankSetup) -> None:
        tp = setup.spec.tp_size
        if len(setup.devices) != tp:
            raise ValueError(f"{len(setup.devices)} devices for {tp} ranks")
        self.procs: list[Any] = []
        self.group: TPGroup | None = None
        bind_thread_device(setup.devices[0])
        if tp > 1:
            store = dist.TCPStore("127.0.0.1", 0, tp, True, timeout=datetime.timedelta(seconds=setup.timeout_s),
                                  wait_for_workers=False)
            setup.store_port = store.port
            ctx = mp.get_context("spawn")
            for rank in range(1, tp):
                p = ctx.Process(target=_rank_main, args=(setup, rank), daemon=True,
                                name=f"pdserve-rank{rank}")
                p.start()
                self.procs.append(p)
            self._wait_for_ranks(store, "started", setup.timeout_s)
            self.group = TPGroup(0, tp, store, setup.timeout_s, setup.devices[0])
        self.rank0 = RankWorker(setup, 0, self.group)
        # Every broadcast and every step's collectives run under this lock, in one order on all ranks.
        self._lock = threading.Lock()
        self._last_broadcast = time.monotonic()
        self._stop_keepalive = threading.Event()
        self._keepalive: threading.Thread | None = None
        if self.group is not None:
            self._wait_for_ranks(store, "loaded", setup.timeout_s)
            self.group.broadcast_object("ready")
            self._keepalive = threading.Thread(target=self._keep_alive, args=(keepalive_interval(setup.timeout_s),),
                                               name="pdserve-tp-keepalive", daemon=True)
            self._keepalive.start()
        logger.info("engine ranks ready (tp=%d, devices %s, %s, pid %d)", tp, ",".join(setup.devices),
                    setup.model_config.dtype, os.getpid())

    def _wait_for_ranks(self, store: Any, stage: str, timeout_s: float) -> None:
        """Waits until every spawned rank reached `stage`; a rank that died or reported an error
        fails the engine's start with its message instead of a collective timeout."""
        deadline = time.monotonic() + timeout_s
        pending = {r + 1: p for r, p in enumerate(self.procs)}
        while pending:
            for rank, p in list(pending.items()):
                if store.check([f"error{rank}"]):
                    msg = store.get(f"error{rank}").decode()
                    self._kill()
                    raise RuntimeError(f"rank {rank} failed to start: {msg}")
                if store.check([f"{stage}{rank}"]):
                    del pending[rank]
                elif not p.is_alive():
                    self._kill()
                    raise RuntimeError(f"rank {rank} exited with code {p.exitcode} before {stage!r}")
            if time.monotonic() > deadline:
                self._kill()
                raise RuntimeError(f"ranks {sorted(pending)} not {stage} within {timeout_s:.0f} s")
            time.sleep(0.02)

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
            p.join(timeout=5)
        self.procs = []

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.rank0.kv_cache

    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        with self._lock:
            if self.group is not None:
                self.group.broadcast_object(plan)
                self._last_broadcast = time.monotonic()
            return self.rank0.execute(plan)

    def _keep_alive(self, interval_s: float) -> None:
        """Broadcasts KEEPALIVE whenever no plan went out for `interval_s`; ends on shutdown or
        when a broadcast fails (a dead rank: the engine loop's rank check reports it)."""
        while not self._stop_keepalive.wait(interval_s / 4):
            if time.monotonic() - self._last_broadcast < interval_s:
                continue
            with self._lock:
                if self.group is None or self._stop_keepalive.is_set():
                    return
                try:
                    self.group.broadcast_object(KEEPALIVE)
                except RuntimeError as e:
                    logger.error("tp keepalive broadcast failed (a rank died?): %s", e)
                    return
                self._last_broadcast = time.monotonic()

    def shutdown(self) -> None:
        # A collective with a dead rank can block until the gloo timeout: with one rank gone,
        # the others are terminated instead of asked.
        self._stop_keepalive.set()
        if self._keepalive is not None:
            with self._lock:  # a keepalive in flight finishes first
                pass
        all_alive = all(p.is_alive() for p in self.procs)
        if self.group is not None:
            if all_alive:
                try:
                    self.group.broadcast_object(None)
                except RuntimeError as e:
                    logger.warning("rank shutdown broadcast failed: %s", e)
            self.group = None
        for p in self.procs:
            p.join(timeout=30 if all_alive else 0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        self.procs = []
        self.rank0.shutdown()
