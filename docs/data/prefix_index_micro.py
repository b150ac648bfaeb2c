"""Micro-benchmark of `InMemoryPrefixIndex` (docs/benchmarks.md, issue 18, seventh pass).

Store+evict per event in `bench events`' shape (64 engines, 64 one-hash events per step, 200k
bound), matches (64 and 256 engines), an engine's drop. Run from a tree's root:
`.venv/bin/python docs/data/prefix_index_micro.py` (the "before" numbers ran this file from a
detached worktree of main). Best of 3-5 repetitions each.
"""

import random
import sys
import time
from collections.abc import Callable

sys.path.insert(0, ".")
from services.scheduler.prefix_index import InMemoryPrefixIndex  # noqa: E402

Batch = tuple[str, list[int], bytes]


def best(fn: Callable[[], float], reps: int = 5) -> float:
    return min(fn() for _ in range(reps))


def _batches(removed: int, again: int, steps: int, per: int) -> list[Batch]:
    rnd, prev, batches = random.Random(1), dict[str, list[int]](), list[Batch]()
    for s in range(steps):
        e, base = f"e{s % 64}", rnd.getrandbits(57) << 7
        hs, kinds = list(range(base, base + per)), b""
        if removed and e in prev:  # BlockRemoved of the engine's previous step
            hs, kinds = hs[:per - removed] + prev[e][:removed], b"\x01" * (per - removed) + b"\x02" * removed
        if again and e in prev:  # blocks of the previous step stored again
            hs = hs[:per - again] + prev[e][:again]
        prev[e] = hs
        batches.append((e, hs, kinds))
    return batches


def store_us(removed: int = 0, again: int = 0, bound: int = 200_000, steps: int = 12000, per: int = 64,
             asked: int = 0) -> float:
    """`asked`: block hashes (held by nobody) matched before the timed stores, which fill the
    index's memory of the holders of hashes asked about."""
    batches = _batches(removed, again, steps, per)
    rnd = random.Random(5)
    prompts = [[rnd.getrandbits(64)] for _ in range(asked)]

    def once() -> float:
        idx = InMemoryPrefixIndex(max_entries=bound)
        for e, hs, k in batches[:steps // 2]:
            idx.apply_compact(e, 1, "CPU_OFFLOAD", hs, [1] * per, k)
        for hs in prompts:
            idx.match(hs)
        t = time.perf_counter()
        for e, hs, k in batches[steps // 2:]:
            idx.apply_compact(e, 1, "CPU_OFFLOAD", hs, [1] * per, k)
        return (time.perf_counter() - t) / ((steps - steps // 2) * per) * 1e6

    return best(once, 3)


def match_us(num_engines: int = 64) -> dict[str, tuple[float, float]]:
    """Match of a 32-block prompt: held by one engine, its first 16 blocks by one engine, held
    by 4 engines (a shared prefix), block 0 held by nobody. Each case: its prompts' first match
    (their block 0 never asked about before: one pass) and a match again (best of 5 passes)."""
    idx = InMemoryPrefixIndex(max_entries=1_000_000)
    rnd, prompts = random.Random(2), list[list[int]]()
    for s in range(100 * num_engines):  # 100 prompts of 32 blocks per engine, each held by one
        base = rnd.getrandbits(57) << 7
        prompts.append(list(range(base, base + 32)))
        idx.apply_compact(f"e{s % num_engines}", 1, "GPU", prompts[-1], [1] * 32, b"")
    shared = prompts[-400:]
    for s, hs in enumerate(shared):  # the same prompts stored by 3 more engines each
        for k in (1, 2, 3):
            idx.apply_compact(f"e{(s + k * 16) % num_engines}", 1, "GPU", hs, [1] * 32, b"")
    half = [hs[:16] + [rnd.getrandbits(64) for _ in range(16)] for hs in prompts[1000:2000]]
    miss = [[rnd.getrandbits(64) for _ in range(32)] for _ in range(1000)]

    def timed(ps: list[list[int]]) -> float:
        t = time.perf_counter()
        for hs in ps:
            idx.match(hs)
        return (time.perf_counter() - t) / len(ps) * 1e6

    cases = {"held by one engine": prompts[:1000], "16 of 32 held by one": half, "held by 4 engines": shared,
             "block 0 unknown": miss}
    return {case: (timed(ps), best(lambda ps=ps: timed(ps))) for case, ps in cases.items()}


def drop_ms(n: int = 1_000_000) -> tuple[float, int]:
    idx, rnd = InMemoryPrefixIndex(max_entries=n), random.Random(3)
    for s in range(n // 64):
        base = rnd.getrandbits(57) << 7
        idx.apply_compact(f"e{s % 64}", 1, "GPU", list(range(base, base + 64)), [1] * 64, b"")
    t = time.perf_counter()
    idx.remove_engine("e5")
    return (time.perf_counter() - t) * 1e3, len(idx)


if __name__ == "__main__":
    print(f"store+evict us/event: stored {store_us():.3f} | 16 of 64 removed {store_us(removed=16):.3f}"
          f" | 16 of 64 stored again {store_us(again=16):.3f} | stored, 4,096 hashes asked before {store_us(asked=4096):.3f}")
    for num_engines in (64, 256):
        cases = " | ".join(f"{case} {first:.1f} / {again:.1f}" for case, (first, again) in match_us(num_engines).items())
        print(f"match us (32-block prompt, {num_engines} engines; first / again): {cases}")
    ms, left = drop_ms()
    print(f"remove_engine of 1 of 64 engines at 1M entries: {ms:.1f} ms (left {left})")
