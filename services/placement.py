"""Where `pdserve up` puts every rank of every engine on one host's GPUs: the pure plan.

Contracts (`plan_placement`):
- Each role places by its own TP: a prefill engine has `prefill_tp` ranks, a decode engine
  `decode_tp`. Engines are numbered prefill-0.., then decode-0.. (the order of `--devices`
  in `PlacementPlan.engine_devices()`).
- The ranks of one engine always take distinct GPUs (NCCL runs one rank per GPU); a role whose
  TP exceeds the GPU count is refused whatever else is asked.
- Without `share_gpus` no GPU carries two ranks: engines take consecutive GPUs in order, and a
  cluster with more ranks than GPUs is refused, the reason naming the count and the way out.
- With `share_gpus` (`pdserve up` sets it unless `--exclusive-gpus`) ranks go round-robin over the GPUs, so the
  number of ranks per GPU differs by at most one. An engine's KV share
  (`gpu_memory_fraction`, of each of its GPUs' memory) is `kv_share` divided by the most
  ranks on any of its GPUs, or the explicit `memory_fraction`, which must keep every shared
  GPU below its whole memory.
- Every refusal raises `PlacementError` (a ValueError) with the reason; nothing is probed:
  the GPU count is an argument, so the plan is the same on a laptop and on the GPU host.
"""

from __future__ import annotations

from dataclasses import dataclass

# The share of a GPU's memory `pdserve up` gives to KV caches when nobody says otherwise; the rest
# holds weights and activations. Engines sharing a GPU split it.
DEFAULT_KV_SHARE = 0.5


class PlacementError(ValueError):
    """The cluster's shape cannot be placed on the GPUs; the message says why and what to change."""


@dataclass(frozen=True, slots=True)
class EnginePlacement:
    """One engine: its name (`prefill-0`), role, the GPU of each rank, its KV share per GPU."""

    name: str
    role: str
    gpus: tuple[int, ...]  # index r: rank r's GPU
    memory_fraction: float

    @property
    def devices(self) -> str:
        """The engine's `--devices` value, e.g. `2,3`."""
        return ",".join(map(str, self.gpus))


@dataclass(frozen=True, slots=True)
class PlacementPlan:
    """Every engine's placement on `num_gpus` GPUs."""

    num_gpus: int
    engines: tuple[EnginePlacement, ...]

    def engine_devices(self) -> list[str]:
        """`--devices` per engine, prefill engines first (`ClusterSpec.engine_devices`)."""
        return [e.devices for e in self.engines]

    def memory_fractions(self) -> list[float]:
        """`--gpu-memory-fraction` per engine, in the same order."""
        return [e.memory_fraction for e in self.engines]

    def ranks_on(self, gpu: int) -> list[tuple[str, int]]:
        """(engine name, rank) of every rank on `gpu`."""
        return [(e.name, r) for e in self.engines for r, g in enumerate(e.gpus) if g == gpu]

    def render(self) -> list[str]:
        """The table `pdserve up --plan` prints: one line per rank, then the unused GPUs."""
        lines = [f"{'engine':<12}{'rank':>5}{'gpu':>5}  kv-share"]
        for e in self.engines:
            lines += [f"{e.name:<12}{r:>5}{g:>5}  {e.memory_fraction:.4f}" for r, g in enumerate(e.gpus)]
        unused = [g for g in range(self.num_gpus) if not self.ranks_on(g)]
        if unused:
            lines.append(f"unused GPU(s): {', '.join(map(str, unused))}")
        return lines


def plan_placement(num_gpus: int, num_prefill: int, num_decode: int, prefill_tp: int, decode_tp: int, *,
                   share_gpus: bool = False, memory_fraction: float = 0.0,
                   kv_share: float = DEFAULT_KV_SHARE) -> PlacementPlan:
    """The placement of `num_prefill` engines of `prefill_tp` ranks and `num_decode` of
    `decode_tp` on `num_gpus` GPUs (see the module docstring). Raises PlacementError."""
    _check_shape(num_gpus, num_prefill, num_decode, prefill_tp, decode_tp, memory_fraction)
    roles = [("prefill", i, prefill_tp) for i in range(num_prefill)] + \
            [("decode", i, decode_tp) for i in range(num_decode)]
    total = num_prefill * prefill_tp + num_decode * decode_tp
    if total > num_gpus and not share_gpus:
        raise PlacementError(
            f"{_ranks_text(num_prefill, prefill_tp, 'prefill')} + {_ranks_text(num_decode, decode_tp, 'decode')} "
            f"= {total} ranks need {total} GPUs, {num_gpus} available: drop --exclusive-gpus to put several "
            "engines on one GPU (their KV memory split between them), or run fewer or smaller engines")
    cursor = 0
    gpus: list[tuple[str, str, tuple[int, ...]]] = []
    for role, index, tp in roles:
        gpus.append((f"{role}-{index}", role, tuple((cursor + r) % num_gpus for r in range(tp))))
        cursor += tp
    counts = [0] * num_gpus
    for _, _, ids in gpus:
        for g in ids:
            counts[g] += 1
    engines = tuple(EnginePlacement(name, role, ids, _fraction(ids, counts, memory_fraction, kv_share))
                    for name, role, ids in gpus)
    return PlacementPlan(num_gpus, engines)


def _check_shape(num_gpus: int, num_prefill: int, num_decode: int, prefill_tp: int, decode_tp: int,
                 memory_fraction: float) -> None:
    if num_gpus < 1:
        raise PlacementError("no GPU to place engines on (0 GPUs)")
    if num_prefill < 0 or num_decode < 1:
        raise PlacementError(f"need at least 0 prefill and 1 decode engine, got {num_prefill} and {num_decode}")
    if prefill_tp < 1 or decode_tp < 1:
        raise PlacementError(f"TP sizes must be >= 1, got prefill {prefill_tp}, decode {decode_tp}")
    if not 0.0 <= memory_fraction < 1.0:
        raise PlacementError(f"--gpu-memory-fraction must be in [0, 1), got {memory_fraction}")
    for role, count, tp in (("prefill", num_prefill, prefill_tp), ("decode", num_decode, decode_tp)):
        if count and tp > num_gpus:
            raise PlacementError(f"{role} tp {tp} needs {tp} GPUs (one per rank), {num_gpus} available; "
                                 "GPUs cannot be shared within one engine")


def _fraction(ids: tuple[int, ...], counts: list[int], memory_fraction: float, kv_share: float) -> float:
    """The engine's KV share of each of its GPUs; refused when its busiest GPU would overflow."""
    sharing = max(counts[g] for g in ids)
    if not memory_fraction:
        return kv_share / sharing
    if memory_fraction * sharing >= 1.0:
        raise PlacementError(f"--gpu-memory-fraction {memory_fraction} times {sharing} ranks on GPU "
                             f"{max(ids, key=lambda g: counts[g])} must stay below 1")
    return memory_fraction


def _ranks_text(count: int, tp: int, role: str) -> str:
    return f"{count} {role} x tp {tp}"
