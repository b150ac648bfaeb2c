"""A rank process for the UCX data-plane tests: a real KV tensor, a real connector, driven over a pipe.

The parent sends `(command, args)` tuples; the child answers `("ok", value)` or `("err", text)`.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

SPEC_DEFAULTS: dict[str, Any] = {
    "tp_rank": 0, "tp_size": 1, "num_kv_heads": 2, "num_blocks": 256, "num_layers": 2, "block_size": 4,
    "head_dim": 8, "seed": 0, "timeout_s": 2.0, "lease_s": 30.0, "max_inflight": 64, "hash": "compat-test",
    "device": "cpu", "kv_staging": "none", "kv_staging_blocks": 0, "kv_transport": "ucx-tag",
    "vllm_layout": None,  # a KVCacheLayout name: vLLM's own tensors (allocate_like_vllm), registered in place
    "copy_delay_s": 0.0,  # with kv_staging host: each copy out of the KV into the pool takes this long
}


class RankProc:
    """Parent-side handle of one rank process."""

    def __init__(self, engine_id: str, epoch: int, **spec: Any) -> None:
        self.spec = {**SPEC_DEFAULTS, **spec, "engine_id": engine_id, "epoch": epoch}
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=rank_main, args=(child, self.spec), daemon=True)
        self.proc.start()
        child.close()

    def call(self, command: str, *args: Any, timeout: float = 60.0) -> Any:
        self.conn.send((command, args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.spec['engine_id']}: {command} did not answer in {timeout}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def signal(self, signum: int) -> None:
        """Sends a signal to the rank process (SIGSTOP / SIGKILL in the failure tests). After
        SIGKILL it returns once the process is gone: a kill is asynchronous, and a pull posted to
        a process still dying may be answered by it (e.g. a NIXL READ over CMA copies its memory)
        and fail by timeout instead of as a dead peer."""
        if self.proc.pid is None:
            raise RuntimeError("rank process not started")
        os.kill(self.proc.pid, signum)
        if signum == signal.SIGKILL:
            self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("shutdown", timeout=15)
            except Exception:
                self.proc.kill()
        self.proc.join(timeout=15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


@dataclass(slots=True)
class _Seen:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    failure_reasons: dict[str, str] = field(default_factory=dict)
    duplicates: set[str] = field(default_factory=set)


def _stats(stats: Any) -> dict[str, Any]:
    if stats is None:
        return {"pairs": [], "lease_expiries": 0}
    return {"pairs": [asdict(p) for p in stats.pairs.values()], "lease_expiries": stats.lease_expiries}


def connector_stats_data(connector: Any) -> dict[str, list[float]]:
    """The host-staging series of the connector's stats since the last call."""
    stats = connector.get_kv_connector_stats()
    data = stats.data if stats is not None else {}
    return {k: list(v) for k, v in data.items() if k.startswith("host_")}


def _vllm_region(spec: dict[str, Any], heads: int) -> tuple[Any, Any]:
    """vLLM's KV tensors in `spec["vllm_layout"]` (random bytes with a seed) as the `KVRegion`
    the vLLM connector registers, and its logical [B, H, L, N, C] byte view (a block's digest
    is then the same whatever the layout)."""
    import torch

    from connectors.vllm.kv_region import allocate_like_vllm, describe_kv_caches, logical_view

    caches = allocate_like_vllm(spec["vllm_layout"], num_layers=spec["num_layers"], num_blocks=spec["num_blocks"],
                                num_heads=heads, block_size=spec["block_size"], head_dim=spec["head_dim"],
                                dtype=torch.float16, device=spec["device"])
    region = describe_kv_caches(caches, num_blocks=spec["num_blocks"], block_size=spec["block_size"],
                                head_dim=spec["head_dim"], layout_name=spec["vllm_layout"])
    if spec["seed"]:
        noise = torch.randint(0, 256, (region.nbytes,), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(spec["seed"]))
        region.memory.copy_(noise.to(region.memory.device))
    return region, logical_view(region).permute(1, 2, 0, 3, 4)


def _fence(device: str) -> Any:
    import torch

    from connectors.vllm.kv_region import ComputeFence

    return ComputeFence.record(torch.device(device))


def rank_main(conn: Connection, spec: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    from connectors.head_map import num_local_heads, rank_heads
    from connectors.ucx.config import UcxConnectorConfig
    from connectors.ucx.handshake import KVTransferDescriptor
    from connectors.ucx.worker import UcxWorkerConnector

    heads = num_local_heads(spec["tp_size"], spec["num_kv_heads"])
    head_start = rank_heads(spec["tp_rank"], spec["tp_size"], spec["num_kv_heads"])[0]
    if spec["vllm_layout"]:
        region, kv = _vllm_region(spec, heads)
    else:
        kv = torch.zeros(spec["num_blocks"], heads, spec["num_layers"], 2, spec["block_size"], spec["head_dim"])
        if spec["seed"]:
            kv.uniform_(generator=torch.Generator().manual_seed(spec["seed"]))
        kv = region = kv.to(spec["device"])
    if spec["copy_delay_s"]:
        from connectors.ucx.host_staging import TensorBlocks

        class SlowBlocks(TensorBlocks):
            def read(self, block_ids: list[int]) -> Any:
                time.sleep(spec["copy_delay_s"])
                return super().read(block_ids)

        region = SlowBlocks(kv)
    config = UcxConnectorConfig(transfer_timeout_s=spec["timeout_s"], lease_s=spec["lease_s"],
                                max_inflight_transfers=spec["max_inflight"], kv_staging=spec["kv_staging"],
                                kv_staging_blocks=spec["kv_staging_blocks"],
                                kv_transport=spec["kv_transport"])
    connector = UcxWorkerConnector(engine_id=spec["engine_id"], epoch=spec["epoch"], tp_rank=spec["tp_rank"],
                                   tp_size=spec["tp_size"], num_kv_heads=spec["num_kv_heads"],
                                   compatibility_hash=spec["hash"], kv_cache=region, config=config)
    seen = _Seen()

    def drain() -> None:
        r = connector.get_transfer_results()
        seen.invalid_block_ids |= connector.get_block_ids_with_load_errors()
        seen.failure_reasons.update(connector.take_failure_reasons())
        for name in ("finished_sending", "finished_recving", "failed_recving"):
            mine, new = getattr(seen, name), getattr(r, name)
            seen.duplicates |= mine & new
            mine |= new

    def wait_results(ids: list[str], timeout: float) -> dict[str, Any]:
        start = time.monotonic()
        want = set(ids)
        while True:
            drain()
            done = seen.finished_sending | seen.finished_recving | seen.failed_recving
            if want <= done or time.monotonic() - start > timeout:
                break
            connector.wait_for_results(0.01)
        return {"finished_sending": sorted(seen.finished_sending & want),
                "finished_recving": sorted(seen.finished_recving & want),
                "failed_recving": sorted(seen.failed_recving & want),
                "reasons": {k: v for k, v in seen.failure_reasons.items() if k in want},
                "duplicates": sorted(seen.duplicates),
                "elapsed": time.monotonic() - start}

    def take_invalid() -> list[int]:
        drain()
        ids = sorted(seen.invalid_block_ids)
        seen.invalid_block_ids.clear()
        return ids

    def digests(ids: list[int]) -> list[str]:
        return [hashlib.blake2b(kv[b].contiguous().cpu().numpy().tobytes(), digest_size=16).hexdigest() for b in ids]

    def head_digests(ids: list[int]) -> dict[int, list[str]]:
        """Per global KV head this rank holds: a digest of that head's K and V (every layer) per block."""
        return {head_start + h: [hashlib.blake2b(kv[b, h].contiguous().cpu().numpy().tobytes(),
                                                 digest_size=16).hexdigest() for b in ids] for h in range(heads)}

    def zero(ids: list[int]) -> None:
        for b in ids:
            kv[b].zero_()

    commands: dict[str, Any] = {
        "meta": connector.get_handshake_metadata,
        "add_peer": lambda m: asdict(connector.add_peer(m)),
        "remove_peer": connector.remove_peer,
        "expect_send": connector.expect_send,
        # pinned behind a CUDA event on the current stream (as the vLLM connector pins): a
        # no-op fence on the CPU
        "expect_send_fenced": lambda rid, ids, readers=1: connector.expect_send(
            rid, ids, None, readers, ready=_fence(spec["device"])),
        "start_pull": lambda rid, d, local: connector.start_pull(rid, KVTransferDescriptor(**d), local),
        "cancel": connector.cancel,
        "wait_results": wait_results,
        "invalid": take_invalid,
        "digests": digests,
        "head_digests": head_digests,
        "zero": zero,
        "stats": lambda: _stats(connector.get_kv_connector_stats()),
        "pending": connector.num_pending,
        "region_memory_type": lambda: connector.handshake_metadata.region.memory_type,
        "region_layout": lambda: connector.handshake_metadata.region.layout,
        "staging": lambda: {k: sum(v) for k, v in connector_stats_data(connector).items()},
        "staging_slots": connector.staging_slots,
        "registered_bytes": connector.registered_bytes,
    }
    while True:
        try:
            command, args = conn.recv()
        except EOFError:
            break
        if command == "shutdown":
            connector.shutdown()
            conn.send(("ok", None))
            break
        try:
            conn.send(("ok", commands[command](*args)))
        except Exception as e:
            conn.send(("err", f"{type(e).__name__}: {e}"))
