"""`pdserve bench aggregator`: per-rank reports per second through the aggregator, one core.

Workload (issue 4): tp ranks (default 8); every step each rank reports `--ids` finished
sending ids, `--ids` finished receiving ids, and the same `--events` worker-side BlockStored
events (4 hashes, a parent, 64 token ids each). Ids and events are new every step, and every
rank gets its own equal copies (as after decoding from the wire). Only aggregation is timed.

pdserve: `KVOutputAggregator.add_report`, one call per rank report (what the scheduler's control
servicer does). Baseline, run side by side on the same inputs: vLLM's semantics as the reference
spec §1.7 and §2.2 describe them, re-implemented here: `KVOutputAggregator.aggregate` over the
step's outputs with per-id remaining counters; the first rank's events container (a Counter,
built on the worker) is the accumulator, every later one is merged with
`add_events(get_all_events())` + `increment_workers(1)`; then the scheduler side takes the
events counted once per sending worker. vLLM's events are msgspec Structs with list fields and a
Python `__hash__` (as vLLM declares them), when msgspec is installed.

Times are CPU seconds of this process (`time.process_time`), so other processes on a shared
machine do not distort the ratio; the best of `--repeat` runs is reported.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from connectors.aggregator import KVOutputAggregator
from connectors.kv_events import MEDIUM_CPU, BlockStored
from connectors.outputs import KVConnectorOutput


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=8, help="ranks per engine")
    parser.add_argument("--ids", type=int, default=256, help="finished ids per rank per step, per direction")
    parser.add_argument("--events", type=int, default=512, help="BlockStored events per rank per step")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per repetition")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions; the best is reported")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


# -- the baseline: vLLM's semantics --------------------------------------------------------

class VllmKVEvents:
    """vLLM's KVEventAggregator inside a KVConnectorKVEvents container: a Counter of events and
    a worker count. A worker builds one per step (`num_workers` 1) before it reaches the
    aggregator, so that part is not timed."""

    def __init__(self, events: Sequence[Any], num_workers: int = 1) -> None:
        self._counter: Counter[Any] = Counter()
        self._num_workers = num_workers
        self.add_events(list(events))

    def add_events(self, events: list[Any]) -> None:
        if not isinstance(events, list):
            raise TypeError("events must be a list")
        self._counter.update(events)

    def get_all_events(self) -> list[Any]:
        return list(self._counter.elements())

    def increment_workers(self, n: int = 1) -> None:
        self._num_workers += n

    def get_common_events(self) -> list[Any]:
        return [e for e, c in self._counter.items() if c == self._num_workers]


class VllmOutputAggregator:
    """vLLM's KVOutputAggregator: remaining counters keyed by id, persisting across steps."""

    def __init__(self, expected_finished_count: int) -> None:
        self._expected = expected_finished_count
        self._send_remaining: dict[str, int] = {}
        self._recv_remaining: dict[str, int] = {}

    def _update(self, ids: frozenset[str], remaining: dict[str, int], finished: set[str]) -> None:
        for request_id in ids:
            count = remaining.get(request_id, self._expected) - 1
            if count == 0:
                finished.add(request_id)
                remaining.pop(request_id, None)
            else:
                remaining[request_id] = count

    def aggregate(self, outputs: Sequence[tuple[KVConnectorOutput, VllmKVEvents]]
                  ) -> tuple[set[str], set[str], list[Any]]:
        sending: set[str] = set()
        recving: set[str] = set()
        invalid: set[int] = set()
        events: VllmKVEvents | None = None
        for out, container in outputs:
            if out.expected_finished_count and out.expected_finished_count != self._expected:
                self._expected = out.expected_finished_count
            self._update(out.finished_sending, self._send_remaining, sending)
            self._update(out.finished_recving, self._recv_remaining, recving)
            if events is None:
                events = container  # the first container is the accumulator
            else:
                events.add_events(container.get_all_events())
                events.increment_workers(1)
            invalid |= out.invalid_block_ids
        # The scheduler-side connector's take_events: the events every sending worker reported.
        return sending, recving, events.get_common_events() if events is not None else []


def _vllm_event_type() -> tuple[type, str]:
    """vLLM's BlockStored as it reaches the aggregator: a msgspec Struct with list fields and
    a Python `__hash__` over a tuple of its fields without lora_name (reference spec §1.2);
    a plain class with the same hash and equality when msgspec is not installed."""
    def vllm_hash(self: Any) -> int:
        return hash((tuple(self.block_hashes), self.parent_block_hash, tuple(self.token_ids),
                     self.block_size, self.lora_id, self.medium,
                     None if self.extra_keys is None else tuple(self.extra_keys), self.group_idx))

    try:
        import msgspec
    except ModuleNotFoundError:
        @dataclass(eq=True, slots=True)
        class PlainBlockStored:
            block_hashes: list[int]
            parent_block_hash: int | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None
            extra_keys: list[Any] | None = None
            group_idx: int | None = None
            __hash__ = vllm_hash

        return PlainBlockStored, "dataclass"

    class VllmBlockStored(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[Any] | None = None
        group_idx: int | None = None

        __hash__ = vllm_hash

    return VllmBlockStored, "msgspec"


# -- workload -------------------------------------------------------------------------------

@dataclass(slots=True)
class _Step:
    outputs: list[KVConnectorOutput]
    vllm_outputs: list[tuple[KVConnectorOutput, VllmKVEvents]]


def _make_step(step: int, args: argparse.Namespace, vllm_type: type) -> _Step:
    outputs, vllm_outputs = [], []
    for rank in range(args.tp):
        # Each rank gets its own objects with equal values (as decoded from its report).
        sending = frozenset(f"send-{step}-{i}-{rank}"[: -len(str(rank)) - 1] for i in range(args.ids))
        recving = frozenset(f"recv-{step}-{i}-{rank}"[: -len(str(rank)) - 1] for i in range(args.ids))
        events = tuple(_event(step, i) for i in range(args.events))
        outputs.append(KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                         kv_cache_events=events))
        vllm_events = tuple(vllm_type(list(e.block_hashes), e.parent_block_hash, list(e.token_ids),
                                      e.block_size, e.lora_id, e.medium, e.lora_name, None, e.group_idx)
                            for e in events)
        vllm_outputs.append((KVConnectorOutput(finished_sending=sending, finished_recving=recving),
                             VllmKVEvents(vllm_events)))
    return _Step(outputs, vllm_outputs)


def _event(step: int, i: int) -> BlockStored:
    base = (step * 1_000_003 + i * 4) * 2654435761 % (1 << 62)
    return BlockStored(block_hashes=tuple(base + k for k in range(1, 5)), parent_block_hash=base,
                       token_ids=tuple(range(i % 1000, i % 1000 + 64)), block_size=16, medium=MEDIUM_CPU,
                       group_idx=0)


def _time_pdserve(steps: list[_Step], tp: int) -> tuple[float, int, int]:
    agg = KVOutputAggregator()
    agg.register_engine("bench", 1, range(tp))
    num_ids = num_events = 0
    start = time.process_time()
    for step in steps:
        for rank, out in enumerate(step.outputs):
            res = agg.add_report("bench", 1, rank, out)
            num_ids += len(res.finished_sending) + len(res.finished_recving)
            num_events += len(res.events)
    return time.process_time() - start, num_ids, num_events


def _time_vllm(steps: list[_Step], tp: int) -> tuple[float, int, int]:
    agg = VllmOutputAggregator(tp)
    num_ids = num_events = 0
    start = time.process_time()
    for step in steps:
        sending, recving, events = agg.aggregate(step.vllm_outputs)
        num_ids += len(sending) + len(recving)
        num_events += len(events)
    return time.process_time() - start, num_ids, num_events


def run(args: argparse.Namespace) -> int:
    for name in ("tp", "ids", "events", "steps", "repeat"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1")
    best = {"pdserve": float("inf"), "vllm": float("inf")}
    counts: dict[str, tuple[int, int]] = {}
    vllm_type, vllm_type_name = _vllm_event_type()
    for rep in range(args.repeat):
        steps = [_make_step(rep * args.steps + s, args, vllm_type) for s in range(args.steps)]
        for name, fn in (("pdserve", _time_pdserve), ("vllm", _time_vllm)):
            seconds, num_ids, num_events = fn(steps, args.tp)
            best[name] = min(best[name], seconds)
            counts[name] = (num_ids, num_events)
    want = (2 * args.ids * args.steps, args.events * args.steps)
    if counts["pdserve"] != want or counts["vllm"] != want:
        raise RuntimeError(f"aggregators released {counts}, expected {want} (ids, events) per repetition")
    reports = args.tp * args.steps
    ours, theirs = reports / best["pdserve"], reports / best["vllm"]
    result = {
        "rank_reports_per_s": round(ours, 1),
        "baseline_rank_reports_per_s": round(theirs, 1),
        "ratio": round(ours / theirs, 2),
        "ms_per_aggregated_step": round(1000 * best["pdserve"] / args.steps, 3),
        "baseline_ms_per_aggregated_step": round(1000 * best["vllm"] / args.steps, 3),
        "tp": args.tp, "ids_per_rank_per_step": args.ids, "events_per_rank_per_step": args.events,
        "steps": args.steps, "repeat": args.repeat, "baseline_event_type": vllm_type_name,
        "clock": "process_time",
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"tp {args.tp}, {args.ids}+{args.ids} finished ids and {args.events} BlockStored per rank per step")
        print(f"  pdserve KVOutputAggregator   {ours:10.1f} rank-reports/s  "
              f"({result['ms_per_aggregated_step']} ms per step)")
        print(f"  vLLM semantics (baseline)    {theirs:10.1f} rank-reports/s  "
              f"({result['baseline_ms_per_aggregated_step']} ms per step)")
        print(f"  ratio                        {result['ratio']:10.2f}x")
    return 0
