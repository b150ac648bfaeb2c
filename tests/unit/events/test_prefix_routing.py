"""PrefixAwarePolicy: the engine holding the prefix wins, load counts, ties spread, epochs."""

from collections.abc import Sequence

import pytest

from connectors.hashing import BlockHasher
from connectors.kv_events import AllBlocksCleared, BlockStored
from services.scheduler.prefix_index import EngineMatch, InMemoryPrefixIndex
from services.scheduler.prefix_routing import PrefixAwarePolicy, parse_medium_weights
from services.scheduler.routing import (
    REASON_LOAD,
    REASON_PREFIX,
    EngineView,
    Router,
    RoutingPolicy,
    RoutingRequest,
)

HASHER = BlockHasher(block_size=4)


def request(tokens: list[int]) -> RoutingRequest:
    return RoutingRequest(HASHER.external_hashes(tokens), len(tokens))


def store(idx: InMemoryPrefixIndex, engine: str, epoch: int, tokens: list[int], medium: str = "GPU") -> None:
    idx.apply(engine, epoch, [BlockStored(tuple(HASHER.external_hashes(tokens)), None, (), 4, medium=medium)])


def engines(**load: float) -> list[EngineView]:
    return [EngineView(e, 1, "prefill", num_waiting=int(w)) for e, w in load.items()]


def test_is_a_routing_policy() -> None:
    assert isinstance(PrefixAwarePolicy(InMemoryPrefixIndex()), RoutingPolicy)


def test_engine_holding_the_prefix_wins() -> None:
    idx = InMemoryPrefixIndex()
    shared = list(range(32))
    store(idx, "p1", 1, shared)
    policy = PrefixAwarePolicy(idx)
    for tail in range(5):
        d = policy.choose_prefill(request(shared + [100 + tail] * 8), engines(p0=0, p1=0))
        assert (d.engine_id, d.reason, d.matched_blocks) == ("p1", REASON_PREFIX, 8)


def test_medium_weights_rank_engines() -> None:
    idx = InMemoryPrefixIndex()
    prompt = list(range(16))
    store(idx, "gpu", 1, prompt, "GPU")
    store(idx, "disk", 1, prompt, "STORAGE")
    policy = PrefixAwarePolicy(idx)
    assert policy.choose_prefill(request(prompt), engines(disk=0, gpu=0)).engine_id == "gpu"
    cheap_disk = PrefixAwarePolicy(idx, medium_weights={"GPU": 0.1, "STORAGE": 1.0})
    assert cheap_disk.choose_prefill(request(prompt), engines(disk=0, gpu=0)).engine_id == "disk"


def test_load_term_outweighs_a_small_prefix() -> None:
    idx = InMemoryPrefixIndex()
    prompt = list(range(64))  # 16 blocks
    store(idx, "busy", 1, prompt[:8])  # 2 blocks cached
    policy = PrefixAwarePolicy(idx, load_weight=0.25)
    # busy: 2 - 0.25*4*16 = -14 ; idle: 0
    assert policy.choose_prefill(request(prompt), engines(busy=4, idle=0)).engine_id == "idle"
    store(idx, "busy", 1, prompt)  # the whole prompt: 16 - 16*0.25*... with load 1
    assert policy.choose_prefill(request(prompt), engines(busy=1, idle=0)).engine_id == "busy"


def test_cold_start_and_ties_spread_load() -> None:
    policy = PrefixAwarePolicy(InMemoryPrefixIndex())
    picks = [policy.choose_prefill(request(list(range(i, i + 8))), engines(a=0, b=0, c=0)) for i in range(6)]
    assert sorted(d.engine_id or "" for d in picks) == ["a", "a", "b", "b", "c", "c"]
    assert {d.reason for d in picks} == {REASON_LOAD}
    loaded = [policy.choose_prefill(request([1, 2, 3, 4]), engines(a=2, b=0, c=1)) for _ in range(3)]
    assert {d.engine_id for d in loaded} == {"b"}


def test_new_epoch_vanishes_from_routing_at_once() -> None:
    idx = InMemoryPrefixIndex()
    prompt = list(range(16))
    store(idx, "p1", 1, prompt)
    policy = PrefixAwarePolicy(idx)
    assert policy.choose_prefill(request(prompt), [EngineView("p1", 1, "prefill")]).matched_blocks == 4
    # the registry already knows epoch 2; entries of epoch 1 must not count
    d = policy.choose_prefill(request(prompt), [EngineView("p0", 1, "prefill"), EngineView("p1", 2, "prefill")])
    assert (d.matched_blocks, d.reason) == (0, REASON_LOAD)
    idx.apply("p1", 2, [AllBlocksCleared()])
    assert idx.match(HASHER.external_hashes(prompt)) == {}


def test_router_counts_prefix_decisions() -> None:
    idx = InMemoryPrefixIndex()
    store(idx, "p1", 1, list(range(8)))
    router = Router(PrefixAwarePolicy(idx))
    router.route(request(list(range(8))), engines(p0=0, p1=0), [EngineView("d0", 1, "decode")])
    assert router.decisions[REASON_PREFIX] == 1


class CountingIndex(InMemoryPrefixIndex):
    def __init__(self) -> None:
        super().__init__()
        self.num_matches = 0

    def match(self, block_hashes: Sequence[int]) -> dict[str, EngineMatch]:
        self.num_matches += 1
        return super().match(block_hashes)


def test_router_looks_the_prompt_up_once_for_path_and_policy() -> None:
    idx = CountingIndex()
    store(idx, "p1", 1, list(range(8)))
    store(idx, "d1", 1, list(range(4)))
    router = Router(PrefixAwarePolicy(idx), index=idx)
    route = router.route(request(list(range(8))), engines(p0=0, p1=0),
                         [EngineView("d0", 1, "decode"), EngineView("d1", 1, "decode")])
    assert idx.num_matches == 1
    assert (route.prefill.engine_id, route.prefill.reason, route.prefill.matched_blocks) == ("p1", REASON_PREFIX, 2)
    assert (route.decode.engine_id, route.decode.matched_blocks) == ("d1", 1)
    # a policy asked directly still looks the prompt up itself
    assert PrefixAwarePolicy(idx).choose_prefill(request(list(range(8))), engines(p0=0, p1=0)).engine_id == "p1"
    assert idx.num_matches == 2


def test_parse_medium_weights() -> None:
    w = parse_medium_weights("GPU=2, CPU_OFFLOAD=0.25,NVME=0.4")
    assert (w["GPU"], w["CPU_OFFLOAD"], w["NVME"], w["CPU"]) == (2.0, 0.25, 0.4, 0.8)
    for bad in ("GPU", "=1", "GPU=x", "GPU=-1"):
        with pytest.raises(ValueError, match="medium_weights"):
            parse_medium_weights(bad)
    with pytest.raises(ValueError, match='load_weight must be >= 0, got -1'):
        PrefixAwarePolicy(InMemoryPrefixIndex(), load_weight=-1)
