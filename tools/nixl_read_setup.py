"""Micro-measure: the per-READ setup of the NIXL transport, one-off descriptor lists against
prepared ones (docs/decisions/0009-nixl-rma-transport.md).

In one process, two NIXL agents (a writer region and a reader region of the benchmark's block
geometry: 30 layers, 4 KV heads, head_dim 64, 16-token blocks, fp32). For a pull of N blocks,
times what the reader does before the READ is posted:

- `one-off` (before): `descriptor_rows` on both sides, `get_xfer_descs` twice, `initialize_xfer`;
- `prepared` (now): `block_indices` on both sides, `make_prepped_xfer` from the lists prepared
  once (`strided_list` + `prep_xfer_dlist`, timed apart as the one-time cost).

The two variants take turns (ABAB), first back to back (each handle released at once: the
CPU cost on warm caches), then each followed by its READ, posted and waited for untimed (as
in a pull: the copy has just evicted the caches).
Usage: .venv/bin/python tools/nixl_read_setup.py [--reps 50]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from connectors.ucx.nixl_transport import _nixl_api, block_indices, descriptor_rows, strided_list
from connectors.ucx.transport import HeadGeometry, Segment

HEADS, HEAD_NBYTES, BLOCKS = 4, 30 * 2 * 16 * 64 * 4, 300


def _agent(api: Any, name: str) -> Any:
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
    return agent


def _interleaved_us(variants: list[Callable[[], Any]], run: Callable[[Any], None] | None,
                    reps: int) -> list[float]:
    """Median microseconds of each variant's setup, the variants taking turns (ABAB); `run`
    (the READ, untimed) follows each setup, or the handle is released at once (warm caches)."""
    times: list[list[float]] = [[] for _ in variants]
    for _ in range(reps):
        for i, make in enumerate(variants):
            t0 = time.perf_counter()
            handle = make()
            times[i].append(time.perf_counter() - t0)
            if run is None:
                handle.release()
            else:
                run(handle)
    return [statistics.median(t) * 1e6 for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    api = _nixl_api()
    geometry = HeadGeometry(HEADS, HEAD_NBYTES)
    writer_mem = np.ones(BLOCKS * geometry.block_nbytes, dtype=np.uint8)
    reader_mem = np.zeros_like(writer_mem)
    writer, reader = _agent(api, "setup-writer"), _agent(api, "setup-reader")
    wbase, rbase = int(writer_mem.ctypes.data), int(reader_mem.ctypes.data)
    writer.register_memory([(wbase, writer_mem.nbytes, 0, "")], "DRAM")
    reader.register_memory([(rbase, reader_mem.nbytes, 0, "")], "DRAM")
    peer = reader.add_remote_agent(writer.get_agent_metadata())

    def run(handle: Any) -> None:
        state = reader.transfer(handle)
        while state == "PROC":
            state = reader.check_xfer_state(handle)
        assert state == "DONE", state
        handle.release()

    print(f"per-READ setup, median of {args.reps}, microseconds (4 KV heads, "
          f"{geometry.block_nbytes // 1024} KiB blocks)")
    print(f"{'':>27} {'back to back':^26}  {'each after its READ':^26}")
    print(f"{'pull':>20} {'blocks':>6} {'one-off':>8} {'prepared':>9} {'ratio':>6} {'one-off':>8} {'prepared':>9} "
          f"{'ratio':>6}")
    for label, head, count in (("head range (2 of 4)", 2, 2), ("whole blocks", 0, 0)):
        t0 = time.perf_counter()
        width = count or HEADS
        local_list = reader.prep_xfer_dlist("NIXL_INIT_AGENT", strided_list(rbase, geometry, BLOCKS, 0, width), "DRAM")
        remote_list = reader.prep_xfer_dlist(peer, strided_list(wbase, geometry, BLOCKS, head, width), "DRAM")
        prep_us = (time.perf_counter() - t0) / 2 * 1e6
        for n in (16, 64, 256):
            segs = (Segment(0, 0, n, head, 0, count),)

            def one_off(segs: tuple[Segment, ...] = segs) -> Any:
                local = descriptor_rows(segs, geometry, rbase, remote=False)
                remote = descriptor_rows(segs, geometry, wbase, remote=True)
                return reader.initialize_xfer("READ", reader.get_xfer_descs(local, "DRAM"),
                                              reader.get_xfer_descs(remote, "DRAM"), peer)

            def prepared(segs: tuple[Segment, ...] = segs, lists: tuple[Any, Any] = (local_list, remote_list)) -> Any:
                return reader.make_prepped_xfer("READ", lists[0], block_indices(segs, remote=False),
                                                lists[1], block_indices(segs, remote=True))

            warm = _interleaved_us([one_off, prepared], None, args.reps)
            cold = _interleaved_us([one_off, prepared], run, args.reps)
            print(f"{label:>20} {n:>6} {warm[0]:8.0f} {warm[1]:9.0f} {warm[0] / warm[1]:5.1f}x"
                  f" {cold[0]:8.0f} {cold[1]:9.0f} {cold[0] / cold[1]:5.1f}x")
        print(f"{'':>20} prepare once: {prep_us:.0f} us per list")
        local_list.release()
        remote_list.release()


if __name__ == "__main__":
    main()
