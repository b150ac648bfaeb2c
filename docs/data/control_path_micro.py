"""The Control servicer's path for per-rank compact reports, in process (decision 0021).

64 engines x tp 8 registered with a real `ControlServicer` (registry, aggregator, joiner) whose
sink is a real `EventPlane` republisher (prefix index, no ZMQ); each engine step has 64 stamped
CPU_OFFLOAD BlockStored (`bench.events_load.stamped_compact_wire`). Every report is parsed from its
bytes (what gRPC does before the servicer sees it) and applied as the stream reader applies it
(`touch`, `_apply_message`). No gRPC, no other process: the servicer's own CPU per step.

    PYTHONPATH=.:protos .venv/bin/python docs/data/control_path_micro.py rank 2000
    # modes: rank (every rank sends each step's copy), merged (rank 0 sends it for all,
    # merged_event_ranks), backlog (each rank's 8 steps of an engine read in turn)

Run it from a detached worktree of another commit (PYTHONPATH pointing there) for the baseline,
alternating runs.
"""

from __future__ import annotations

import asyncio
import sys
import time

from bench.events_load import length_delimited, stamped_compact_wire, varint
from pdserve.v1 import control_pb2 as cpb
from services.common.config import SchedulerConfig
from services.scheduler.control import ControlServicer, RankConnection, hello_from_proto
from services.scheduler.events.plane import EventPlane
from services.scheduler.registry import EngineRegistry

ENGINES, TP, EVENTS, BACKLOG_STEPS = 64, 8, 64, 8


def _register(control: ControlServicer, registry: EngineRegistry) -> list[list[tuple[RankConnection, object]]]:
    conns = []
    for e in range(ENGINES):
        row = []
        for r in range(TP):
            identity = cpb.RankIdentity(engine_id=f"bench-p{e}", role=cpb.ROLE_PREFILL, epoch=1000 + e, tp_rank=r,
                                        tp_size=TP, pp_size=1)
            hello = hello_from_proto(cpb.Hello(rank=identity, compatibility_hash="bench", protocol_version=1,
                                               engine_address="127.0.0.1:1", hash_seed="0", block_size=16))
            reg = registry.register(hello)
            control.aggregator.register_engine(reg.engine.engine_id, reg.engine.epoch, range(TP))
            conn = RankConnection(hello.rank_id, reg.rank.conn_id, reg.engine.epoch, reg.engine.role, asyncio.Queue())
            control.connections[hello.rank_id] = conn
            row.append((conn, reg.engine))
        conns.append(row)
    return conns


def _messages(mode: str, steps: int) -> list[tuple[int, int, bytes]]:
    """(engine, rank, serialized RankMessage) in arrival order."""
    seqs = [[0] * TP for _ in range(ENGINES)]
    merged = length_delimited(11, b"".join(varint(r) for r in range(1, TP)))
    t = time.time()
    per_step = []
    for s in range(steps):
        e = s % ENGINES
        body = length_delimited(12, stamped_compact_wire(t + s * 1e-4, EVENTS))
        step = []
        for r in range(1 if mode == "merged" else TP):
            seqs[e][r] += 1
            report = b"\x08" + varint(seqs[e][r]) + body + (merged if mode == "merged" else b"")
            step.append((e, r, length_delimited(2, report)))
        per_step.append(step)
    if mode != "backlog":
        return [m for step in per_step for m in step]
    out = []
    for g in range(0, steps, ENGINES * BACKLOG_STEPS):
        chunk = per_step[g:g + ENGINES * BACKLOG_STEPS]
        for e in range(ENGINES):
            mine = [step for step in chunk if step[0][0] == e]
            for r in range(TP):
                out += [step[r] for step in mine]
    return out


async def main(mode: str, steps: int) -> None:
    plane = EventPlane.from_config(SchedulerConfig(zmq_endpoint="", prefix_index_max_entries=200_000),
                                   model_name="bench")
    registry = EngineRegistry(block_size=16, hash_seed="0", heartbeat_timeout_s=120.0)
    control = ControlServicer(registry, sink=plane.republisher, heartbeat_interval_s=5.0)
    conns = _register(control, registry)
    messages = _messages(mode, steps)
    parse = cpb.RankMessage.FromString
    t0 = time.process_time()
    for e, r, raw in messages:
        conn, engine = conns[e][r]
        registry.touch(conn.rank_id, conn.conn_id)
        control._apply_message(conn, engine, parse(raw))  # type: ignore[arg-type]
    if hasattr(control, "joiner"):
        control.joiner.flush_all()
    dt = time.process_time() - t0
    published = plane.republisher.stats().num_events
    print(f"{mode}: {dt / steps * 1e6:.1f} us/step, {dt / steps / EVENTS * 1e6:.2f} us/event; published "
          f"{published} of {steps * EVENTS}, malformed {control.counters['reports_malformed']}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "rank", int(sys.argv[2]) if len(sys.argv) > 2 else 2000))
