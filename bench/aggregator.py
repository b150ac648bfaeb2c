"""`pdserve bench aggregator`: per-rank reports per second through the aggregator, one core.

Workload (issue 4): tp ranks (default 8); every step each rank reports `--ids` finished
sending ids, `--ids` finished receiving ids, and the same `--events` worker-side BlockStored
events (4 hashes, a parent, 64 token ids each). Ids and events are new every step, and every
rank gets its own equal copies (as after decoding from the wire). Only aggregation is timed.

pdserve: `KVOutputAggregator.add_report`, one call per rank report (what the scheduler's control
servicer does).

Baseline, fed the same reports in the same run: vLLM's own code when vLLM is importable (run
from `.venv-vllm`): each rank's report is a `ModelRunnerOutput` whose `KVConnectorOutput` holds
the ids and an `LMCacheKVEvents` container (vLLM's `KVEventAggregator`) of vLLM `BlockStored`
structs, built as a worker builds it (untimed); timed is what the engine core and the
scheduler do per step: `KVOutputAggregator.aggregate` over the step's outputs, then the
scheduler-side connector's `update_connector_output` + `take_events` (LMCacheConnectorV1's,
the vLLM connector that consumes aggregated worker events). Without vLLM the baseline is a
re-implementation of those semantics (reference spec §1.7 and §2.2), labelled as such in the
output (`baseline`), never reported under the `vllm_*` keys.

Times are CPU seconds of this process (`time.process_time`), so other processes on a shared
machine do not distort the ratio. One run times both sides on the same steps, in the order
`args.baseline_first` gives; `--repeat N` (default 3, bench/repeats.py) interleaves N runs ABBA and
reports the median and min–max of the ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
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
    parser.add_argument("--json", action="store_true", help="print one JSON object")


# -- the baseline: vLLM's own code -----------------------------------------------------------

class RealVllmBaseline:
    """vLLM's engine-core aggregation and scheduler-side event path, imported from vLLM."""

    name = "vllm"

    def __init__(self) -> None:
        import vllm
        from vllm.distributed.kv_events import BlockStored as VllmBlockStored
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator as VllmAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import (
            LMCacheConnectorV1,
            LMCacheKVEvents,
        )
        from vllm.v1.outputs import KVConnectorOutput as VllmOutput
        from vllm.v1.outputs import ModelRunnerOutput

        self.version = str(vllm.__version__)
        self.label = (f"vLLM {self.version}: KVOutputAggregator.aggregate + "
                      "LMCacheConnectorV1.update_connector_output/take_events")
        self._block_stored, self._aggregator, self._events = VllmBlockStored, VllmAggregator, LMCacheKVEvents
        self._output, self._runner_output, self._connector_type = VllmOutput, ModelRunnerOutput, LMCacheConnectorV1

    def rank_report(self, sending: frozenset[str], recving: frozenset[str], events: Sequence[BlockStored]) -> Any:
        """One rank's step output as vLLM's worker builds it: fresh sets and structs."""
        container = self._events(num_workers=1)
        container.add_events([self._block_stored(
            block_hashes=list(e.block_hashes), parent_block_hash=e.parent_block_hash, token_ids=list(e.token_ids),
            block_size=e.block_size, lora_id=e.lora_id, medium=e.medium, lora_name=e.lora_name,
            group_idx=e.group_idx) for e in events])
        output = self._output(finished_sending=set(sending), finished_recving=set(recving),
                              kv_cache_events=container)
        return self._runner_output(req_ids=[], req_id_to_index={}, kv_connector_output=output)

    def time(self, steps: list[list[Any]], tp: int) -> tuple[float, int, int]:
        aggregator = self._aggregator(tp)
        # The scheduler-side methods read only `_kv_cache_events`; the connector's constructor
        # would start LMCache, which the measured path does not touch.
        connector = object.__new__(self._connector_type)
        connector._kv_cache_events = None
        num_ids = num_events = 0
        start = time.process_time()
        for outputs in steps:
            kv = aggregator.aggregate(outputs).kv_connector_output
            connector.update_connector_output(kv)
            num_events += len(list(connector.take_events()))
            num_ids += len(kv.finished_sending or ()) + len(kv.finished_recving or ())
        return time.process_time() - start, num_ids, num_events


# -- the fallback baseline: vLLM's semantics re-implemented -----------------------------------

class ReimplementedBaseline:
    """Used only where vLLM is not installed, and labelled so."""

    name = "reimplementation"
    version = None

    def __init__(self) -> None:
        self._block_stored, type_name = _vllm_event_type()
        self.label = f"re-implementation of vLLM's semantics ({type_name} events; vLLM not installed)"

    def rank_report(self, sending: frozenset[str], recving: frozenset[str], events: Sequence[BlockStored]) -> Any:
        vllm_events = tuple(self._block_stored(list(e.block_hashes), e.parent_block_hash, list(e.token_ids),
                                               e.block_size, e.lora_id, e.medium, e.lora_name, None, e.group_idx)
                            for e in events)
        return KVConnectorOutput(finished_sending=sending, finished_recving=recving), VllmKVEvents(vllm_events)

    def time(self, steps: list[list[Any]], tp: int) -> tuple[float, int, int]:
        agg = VllmOutputAggregator(tp)
        num_ids = num_events = 0
        start = time.process_time()
        for outputs in steps:
            sending, recving, events = agg.aggregate(outputs)
            num_ids += len(sending) + len(recving)
            num_events += len(events)
        return time.process_time() - start, num_ids, num_events


def load_baseline() -> RealVllmBaseline | ReimplementedBaseline:
    """vLLM's own code where it imports; the labelled re-implementation otherwise."""
    try:
        return RealVllmBaseline()
    except ImportError as e:
        print(f"vLLM not importable ({e}); baseline: the re-implementation of its semantics", file=sys.stderr)
        return ReimplementedBaseline()


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
    baseline_outputs: list[Any]


def _make_step(step: int, args: argparse.Namespace, baseline: RealVllmBaseline | ReimplementedBaseline) -> _Step:
    outputs, baseline_outputs = [], []
    for rank in range(args.tp):
        # Each rank gets its own objects with equal values (as decoded from its report).
        sending = frozenset(f"send-{step}-{i}-{rank}"[: -len(str(rank)) - 1] for i in range(args.ids))
        recving = frozenset(f"recv-{step}-{i}-{rank}"[: -len(str(rank)) - 1] for i in range(args.ids))
        events = tuple(_event(step, i) for i in range(args.events))
        outputs.append(KVConnectorOutput(finished_sending=sending, finished_recving=recving,
                                         kv_cache_events=events))
        baseline_outputs.append(baseline.rank_report(sending, recving, events))
    return _Step(outputs, baseline_outputs)


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


def run(args: argparse.Namespace) -> int:
    for name in ("tp", "ids", "events", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1")
    baseline = load_baseline()
    seconds: dict[str, float] = {}
    counts: dict[str, tuple[int, int]] = {}
    steps = [_make_step(s, args, baseline) for s in range(args.steps)]
    sides = [("pdserve", _time_pdserve),
             ("baseline", lambda st, tp: baseline.time([s.baseline_outputs for s in st], tp))]
    baseline_first = getattr(args, "baseline_first", False)
    for name, fn in sides[::-1] if baseline_first else sides:
        seconds[name], num_ids, num_events = fn(steps, args.tp)
        counts[name] = (num_ids, num_events)
    want = (2 * args.ids * args.steps, args.events * args.steps)
    if counts["pdserve"] != want or counts["baseline"] != want:
        raise RuntimeError(f"aggregators released {counts}, expected {want} (ids, events)")
    _report(args, baseline, seconds, baseline_first)
    return 0


def _report(args: argparse.Namespace, baseline: RealVllmBaseline | ReimplementedBaseline,
            best: dict[str, float], baseline_first: bool) -> None:
    reports = args.tp * args.steps
    ours, theirs = reports / best["pdserve"], reports / best["baseline"]
    result: dict[str, Any] = {
        "rank_reports_per_s": round(ours, 1),
        "baseline": baseline.label,
        "baseline_rank_reports_per_s": round(theirs, 1),
        "ratio": round(ours / theirs, 2),
        "ms_per_aggregated_step": round(1000 * best["pdserve"] / args.steps, 3),
        "baseline_ms_per_aggregated_step": round(1000 * best["baseline"] / args.steps, 3),
        "tp": args.tp, "ids_per_rank_per_step": args.ids, "events_per_rank_per_step": args.events,
        "steps": args.steps, "baseline_first": baseline_first, "clock": "process_time",
    }
    if baseline.version is not None:
        result.update(vllm_rank_reports_per_s=result["baseline_rank_reports_per_s"], vllm_version=baseline.version,
                      ratio_vs_vllm=result["ratio"])
    if args.json:
        print(json.dumps(result))
        return
    print(f"tp {args.tp}, {args.ids}+{args.ids} finished ids and {args.events} BlockStored per rank per step")
    print(f"  pdserve KVOutputAggregator {ours:10.1f} rank-reports/s  ({result['ms_per_aggregated_step']} ms per step)")
    print(f"  baseline                   {theirs:10.1f} rank-reports/s  "
          f"({result['baseline_ms_per_aggregated_step']} ms per step)")
    print(f"    = {baseline.label}")
    print(f"  ratio                      {result['ratio']:10.2f}x")
