"""gpu-check section `vllm_layouts`: vLLM's KV memory in every layout the connector accepts,
registered in place and moved between two processes — without vLLM.

The GPU check machine has CUDA torch but no vLLM, so the tensors are built the way vLLM 0.32.0
builds them, by pdserve's stand-in (`connectors/vllm/kv_region.py: allocate_like_vllm`, checked
against vLLM's own allocator by `tests/vllm/test_vllm_kv_region.py`):

- vLLM 0.32.0 `vllm/v1/kv_cache_layout.py`: `KVCacheLayout`, six stride permutations of the
  logical `[L, B, H, N, C]` (C: one token's K and V of one head); `vllm/v1/worker/utils.py
  allocate_kv_cache`: one int8 buffer per worker, a `[B, H, N, C]` view per layer at
  `offset + l * layer_stride + b * block_stride`, block-outermost layouts interleaving every
  layer's page inside a block.
- The FlashAttention backend (`vllm/v1/attention/backends/flash_attn.py`) declares no
  `supported_kv_cache_layouts()` (None: any layout), kernel blocks a multiple of 16 tokens,
  head sizes a multiple of 8, fp16 / bf16. So on a GPU vLLM takes the connector's preference
  (`PdserveConnector.get_required_kvcache_layout`: BHLNC), and another backend's set, or
  `VLLM_KV_CACHE_LAYOUT`, may resolve any of the six: `describe_kv_caches` accepts all six, and
  this section checks all six.

Per layout: a writer process registers its tensors as the connector does (`describe_kv_caches`
-> `KVRegion` -> `UcxWorkerConnector`, pins behind a `ComputeFence` on the current stream); a
reader process pulls random block lists (runs and scattered blocks) into a TP-1 rank, and the
same lists as head ranges into both ranks of a TP-2 engine; every pulled block, and every head
range, is compared byte for byte with the writer's. Then a run of `run_blocks` blocks is timed
(median of `iters` pulls) beside a device-to-device copy of the same bytes in one process.

`device="cpu"` runs the same section on CPU tensors (the suite's test and `--dry-run`), small
sizes; `corrupt=<layout>` flips one byte the reader received for that layout (the test of the
check itself).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

VLLM_VERSION = "0.32.0"  # the vLLM whose allocation and layouts the section reproduces
ALL_LAYOUTS = ("BHLNC", "BLHNC", "BLNHC", "LBHNC", "LBNHC", "LHBNC")  # KVCacheLayout, vLLM 0.32.0
PREFERRED = "BHLNC"  # connectors/vllm/connector.py PREFERRED_GPU_LAYOUT
WAIT_S = 60.0


@dataclass(frozen=True, slots=True)
class LayoutShape:
    """One rank's KV as vLLM sizes it: layers, blocks, KV heads, tokens a block, head size."""

    num_layers: int
    num_blocks: int
    kv_heads: int
    block_size: int
    head_dim: int
    dtype: str

    @property
    def block_nbytes(self) -> int:
        elem = 4 if self.dtype == "float32" else 2
        return self.num_layers * self.kv_heads * self.block_size * 2 * self.head_dim * elem


# A Llama-3-8B-like rank on FlashAttention: 32 layers, 8 KV heads, 16-token blocks, head size
# 128, bf16 (2 MiB a block); 512 blocks = 1 GiB a rank.
GPU_SHAPE = LayoutShape(32, 512, 8, 16, 128, "bfloat16")
CPU_SHAPE = LayoutShape(3, 64, 2, 4, 8, "float16")


def check_vllm_layouts(device: str, *, layouts: tuple[str, ...] = ALL_LAYOUTS, shape: LayoutShape | None = None,
                       run_blocks: int = 0, iters: int = 3, corrupt: str = "", seed: int = 1) -> dict[str, Any]:
    """The section's report (see the module docstring): one row per layout; ok when every
    pulled block and head range is byte-exact in every layout."""
    unknown = set(layouts) - set(ALL_LAYOUTS)
    if unknown or not layouts or iters < 1:
        raise ValueError(f"layouts must name some of {ALL_LAYOUTS} (got {sorted(unknown) or 'none'}); iters >= 1")
    shape = shape or (GPU_SHAPE if device == "cuda" else CPU_SHAPE)
    if shape.kv_heads % 2:
        raise ValueError("kv_heads must be even (the TP-2 reader takes half of them each)")
    run_blocks = min(run_blocks or (128 if device == "cuda" else 16), shape.num_blocks)
    writer, reader = _Actor("writer", device, shape), _Actor("reader", device, shape)
    rows: list[dict[str, Any]] = []
    try:
        for i, layout in enumerate(layouts):
            rows.append(_check_layout(layout, writer, reader, shape, run_blocks, iters,
                                      corrupt == layout, random.Random(seed + i)))
    finally:
        writer.close()
        reader.close()
    copy_gbps = _copy_gbps(device, run_blocks * shape.block_nbytes, iters)
    for row in rows:
        row["copy_gbps"] = copy_gbps
        row["run_vs_copy"] = float(f"{row['run_gbps'] / copy_gbps:.3g}") if row.get("run_gbps") else None
    ok = all(r["whole_blocks_exact"] and r["head_ranges_exact"] for r in rows)
    return {"ok": ok, "device": device, "vllm_version": VLLM_VERSION, "preferred_layout": PREFERRED,
            "shape": asdict(shape), "block_nbytes": shape.block_nbytes, "run_blocks": run_blocks,
            "run_nbytes": run_blocks * shape.block_nbytes, "iters": iters,
            "how": "vLLM 0.32.0's allocation (allocate_like_vllm) registered in place (describe_kv_caches), "
                   "pulled over pdserve's UCX connector between two processes; copy_gbps: a device-to-device "
                   "copy of a run's bytes in one process (host memcpy on the CPU)", "layouts": rows}


def _check_layout(layout: str, writer: _Actor, reader: _Actor, shape: LayoutShape, run_blocks: int, iters: int,
                  corrupt: bool, rng: random.Random) -> dict[str, Any]:
    meta = writer.call("setup", layout)
    region = reader.call("setup", layout, meta)
    row: dict[str, Any] = {"layout": layout, **region}
    try:
        # byte-exactness: random runs and scattered blocks, whole blocks into TP 1, head ranges into TP 2
        jobs = _jobs(rng, shape.num_blocks)
        _pull(writer, reader, jobs, targets=[0])
        if corrupt:
            reader.call("corrupt", 0, jobs[0][2][0])
        want = {tag: writer.call("digests", remote) for tag, remote, _ in jobs}
        bad = [f"{tag}: block {local[i]}" for tag, _, local in jobs
               for i, (a, b) in enumerate(zip(want[tag], reader.call("digests", 0, local), strict=True)) if a != b]
        row["whole_blocks_exact"] = not bad
        row["whole_block_mismatches"] = bad[:8]
        heads = [(f"h{tag}", remote, local) for tag, remote, local in jobs]
        _pull(writer, reader, heads, targets=[1, 2])
        half = shape.kv_heads // 2
        bad = []
        for tag, remote, local in heads:
            theirs = writer.call("head_digests", remote)
            for rank in (0, 1):
                mine = reader.call("head_digests", 1 + rank, local)
                for h in range(half):
                    if mine[h] != theirs[rank * half + h]:
                        bad.append(f"{tag}: tp-2 rank {rank} head {h}")
        row["head_ranges_exact"] = not bad
        row["head_range_mismatches"] = bad[:8]
        row["blocks_checked"] = sum(len(local) for _, _, local in jobs)
        # bandwidth: a run of blocks [0, run_blocks) into [0, run_blocks)
        samples = []
        for i in range(iters + 1):
            tag = f"run{i}"
            seconds = _pull(writer, reader, [(tag, list(range(run_blocks)), list(range(run_blocks)))], targets=[0])
            if i:
                samples.append(seconds)
        row["run_seconds"] = statistics.median(samples)
        row["run_gbps"] = float(f"{run_blocks * shape.block_nbytes / row['run_seconds'] / 1e9:.4g}")
        row["transport"] = reader.call("transport", 0)
    finally:  # the reader first: it holds the endpoints
        reader.call("teardown")
        writer.call("teardown")
    return row


def _jobs(rng: random.Random, num_blocks: int) -> list[tuple[str, list[int], list[int]]]:
    """Random block lists: a run, scattered blocks, a longer run; local blocks disjoint."""
    local_pool = rng.sample(range(num_blocks), min(num_blocks, 24))
    jobs = []
    for i, n in enumerate((3, 5, 8)):
        start = rng.randrange(0, num_blocks - n)
        remote = list(range(start, start + n)) if i % 2 == 0 else rng.sample(range(num_blocks), n)
        jobs.append((f"j{i}", remote, local_pool[:n]))
        local_pool = local_pool[n:]
    return jobs


def _pull(writer: _Actor, reader: _Actor, jobs: list[tuple[str, list[int], list[int]]], targets: list[int]) -> float:
    """Pins each job on the writer (behind a compute fence) for `targets` (reader connector
    indexes), pulls it into each, waits; returns the slowest reader's seconds."""
    for tag, remote, _ in jobs:
        writer.call("pin", tag, remote, len(targets))
    seconds = reader.call("pull", targets, jobs)
    writer.call("wait_sent", [tag for tag, _, _ in jobs])
    return float(seconds)


def _copy_gbps(device: str, nbytes: int, iters: int) -> float:
    import torch

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    samples = []
    for i in range(iters + 1):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        if i:
            samples.append(time.perf_counter() - t0)
    return float(f"{nbytes / statistics.median(samples) / 1e9:.4g}")


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


# -- the two processes ------------------------------------------------------------------------

class _Actor:
    """A spawned process holding one side's connectors, driven over a pipe."""

    def __init__(self, role: str, device: str, shape: LayoutShape) -> None:
        spawn = mp.get_context("spawn")
        self.role = role
        self.conn, child = spawn.Pipe()
        self.proc = spawn.Process(target=_actor_main, args=(child, role, device, shape), daemon=True,
                                  name=f"gpu-check-vllm-{role}")
        self.proc.start()
        child.close()

    def call(self, command: str, *args: Any, timeout: float = WAIT_S * 2) -> Any:
        self.conn.send((command, args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"vllm_layouts {self.role}: {command} did not answer in {timeout:.0f} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"vllm_layouts {self.role}: {command}: {value}")
        return value

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop", ()))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def _actor_main(conn: Connection, role: str, device: str, shape: LayoutShape) -> None:
    import os

    import torch

    torch.set_num_threads(1)
    sys.stdout.flush()
    os.dup2(2, 1)  # UCX prints; stdout belongs to the parent's summary
    side = _Writer(device, shape) if role == "writer" else _Reader(device, shape)
    while True:
        try:
            command, args = conn.recv()
        except EOFError:
            break
        if command == "stop":
            side.teardown()
            break
        try:
            conn.send(("ok", getattr(side, command)(*args)))
        except Exception as e:
            conn.send(("err", f"{type(e).__name__}: {e}"))


class _Rank:
    """One rank's vLLM-allocated KV, registered in place with a UCX connector."""

    def __init__(self, layout: str, device: str, shape: LayoutShape, *, engine_id: str, tp_rank: int, tp_size: int,
                 seed: int) -> None:
        import torch

        from connectors.ucx.config import UcxConnectorConfig
        from connectors.ucx.worker import UcxWorkerConnector
        from connectors.vllm.kv_region import allocate_like_vllm, describe_kv_caches, logical_view

        heads = shape.kv_heads // tp_size
        self.caches = allocate_like_vllm(layout, num_layers=shape.num_layers, num_blocks=shape.num_blocks,
                                         num_heads=heads, block_size=shape.block_size, head_dim=shape.head_dim,
                                         dtype=getattr(torch, shape.dtype), device=device)
        self.region = describe_kv_caches(self.caches, num_blocks=shape.num_blocks, block_size=shape.block_size,
                                         head_dim=shape.head_dim, layout_name=layout)
        if seed:
            gen = torch.Generator(device=device).manual_seed(seed)
            self.region.memory.copy_(torch.randint(0, 256, (self.region.nbytes,), dtype=torch.uint8, device=device,
                                                   generator=gen))
        self.kv = logical_view(self.region).permute(1, 2, 0, 3, 4)  # [B, H, L, N, C] bytes, a view
        self.device = torch.device(device)
        self.connector = UcxWorkerConnector(engine_id=engine_id, epoch=1, tp_rank=tp_rank, tp_size=tp_size,
                                            num_kv_heads=shape.kv_heads, compatibility_hash=f"gpu-check-vllm-{layout}",
                                            kv_cache=self.region,
                                            config=UcxConnectorConfig(transfer_timeout_s=WAIT_S / 2, lease_s=WAIT_S))

    def digests(self, blocks: list[int]) -> list[str]:
        return [_digest(self.kv[b]) for b in blocks]

    def head_digests(self, blocks: list[int]) -> list[str]:
        """Per local head: one digest over that head of every block in `blocks`."""
        return [hashlib.blake2b(b"".join(bytes.fromhex(_digest(self.kv[b, h])) for b in blocks),
                                digest_size=16).hexdigest() for h in range(self.kv.shape[1])]

    def region_facts(self) -> dict[str, Any]:
        from connectors.ucx.transport import Segment

        layout = self.region.layout
        run = Segment(0, 0, 8)
        return {"registered_layout": self.connector.handshake_metadata.region.layout,
                "memory_type": self.region.memory_type, "region_nbytes": self.region.nbytes,
                "strides": list(layout.strides), "ranges_per_8_block_run": len(layout.pieces(run, remote=True))}

    def close(self) -> None:
        self.connector.shutdown()


def _digest(t: Any) -> str:
    return hashlib.blake2b(t.contiguous().cpu().numpy().tobytes(), digest_size=16).hexdigest()


def _wait(connector: Any, tags: set[str], field: str) -> None:
    deadline = time.monotonic() + WAIT_S
    done: set[str] = set()
    while time.monotonic() < deadline:
        r = connector.get_transfer_results()
        if r.failed_recving:
            raise RuntimeError(f"pulls failed: {connector.take_failure_reasons()}")
        done |= getattr(r, field)
        if tags <= done:
            return
        connector.wait_for_results(0.02)
    raise TimeoutError(f"{sorted(tags - done)} not {field} within {WAIT_S:.0f} s")


class _Writer:
    """The prefill side: a TP-1 rank with random KV."""

    def __init__(self, device: str, shape: LayoutShape) -> None:
        self.device, self.shape = device, shape
        self.rank: _Rank | None = None

    def setup(self, layout: str) -> bytes:
        self.rank = _Rank(layout, self.device, self.shape, engine_id=f"writer-{layout}", tp_rank=0, tp_size=1,
                          seed=7)
        return self.rank.connector.get_handshake_metadata()

    def pin(self, tag: str, blocks: list[int], readers: int) -> None:
        from connectors.vllm.kv_region import ComputeFence

        assert self.rank is not None
        # as the vLLM connector pins: behind an event on vLLM's (here: the current) stream
        self.rank.connector.expect_send(tag, blocks, None, readers, ready=ComputeFence.record(self.rank.device))

    def wait_sent(self, tags: list[str]) -> None:
        assert self.rank is not None
        _wait(self.rank.connector, set(tags), "finished_sending")

    def digests(self, blocks: list[int]) -> list[str]:
        assert self.rank is not None
        return self.rank.digests(blocks)

    def head_digests(self, blocks: list[int]) -> list[str]:
        assert self.rank is not None
        return self.rank.head_digests(blocks)

    def teardown(self) -> None:
        if self.rank is not None:
            self.rank.close()
            self.rank = None


class _Reader:
    """The decode side: a TP-1 rank (index 0) and both ranks of a TP-2 engine (1, 2)."""

    def __init__(self, device: str, shape: LayoutShape) -> None:
        self.device, self.shape = device, shape
        self.ranks: list[_Rank] = []
        self.layout = ""

    def setup(self, layout: str, writer_meta: bytes) -> dict[str, Any]:
        self.layout = layout
        self.ranks = [_Rank(layout, self.device, self.shape, engine_id=f"reader-{layout}", tp_rank=0, tp_size=1,
                            seed=0)]
        self.ranks += [_Rank(layout, self.device, self.shape, engine_id=f"reader2-{layout}", tp_rank=r, tp_size=2,
                             seed=0) for r in range(2)]
        for rank in self.ranks:
            rank.connector.add_peer(writer_meta)
        return self.ranks[0].region_facts()

    def pull(self, targets: list[int], jobs: list[tuple[str, list[int], list[int]]]) -> float:
        from connectors.ucx.handshake import KVTransferDescriptor

        s = self.shape
        t0 = time.perf_counter()
        for i in targets:
            for tag, remote, local in jobs:
                d = KVTransferDescriptor(f"writer-{self.layout}", 1, tag, tuple(remote), len(remote) * s.block_size, 1,
                                         s.block_size, s.kv_heads)
                self.ranks[i].connector.start_pull(tag, d, local)
        for i in targets:
            _wait(self.ranks[i].connector, {tag for tag, _, _ in jobs}, "finished_recving")
        return time.perf_counter() - t0

    def corrupt(self, index: int, block: int) -> None:
        """Flips one byte of a received block (the check of the check)."""
        kv = self.ranks[index].kv
        kv[block, 0, 0, 0, 0] ^= 0xFF

    def digests(self, index: int, blocks: list[int]) -> list[str]:
        return self.ranks[index].digests(blocks)

    def head_digests(self, index: int, blocks: list[int]) -> list[str]:
        return self.ranks[index].head_digests(blocks)

    def transport(self, index: int) -> str:
        return ",".join(sorted({t for t in self.ranks[index].connector.peer_transports().values() if t}))

    def teardown(self) -> None:
        for rank in self.ranks:
            rank.close()
        self.ranks = []
