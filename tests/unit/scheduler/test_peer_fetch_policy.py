"""The peer-fetch policy on hand-built engine views (no processes): which holder, how many
blocks, the cost comparison against the decision as routed, the modes, and the Router's wiring
(unmappable holders are never chosen, a fetch into the decode engine makes the request
decode-local, a remote request's prefill engine fetches when its decode engine already holds the
prefix — decision 0046)."""

import pytest

from services.scheduler.path_costs import CostPriors, PathCosts
from services.scheduler.path_policy import (
    LOCAL_PEER_FETCH,
    REASONS,
    REMOTE_PEER_FETCH,
    PathConfig,
    PathPolicy,
    PathRequest,
)
from services.scheduler.peer_fetch import (
    FETCH,
    NO_HOLDER,
    PIN_CALL_S,
    SLOWER,
    PeerFetchConfig,
    PeerFetchPolicy,
)
from services.scheduler.routing import EngineView, LoadBasedPolicy, Route, Router, RoutingRequest

PRIORS = CostPriors(prefill_fixed_s=0.01, prefill_per_token_s=0.0002, transfer_fixed_s=0.01,
                    transfer_per_token_s=0.00002)


def view(engine_id: str, role: str = "decode", **kw: float) -> EngineView:
    return EngineView(engine_id=engine_id, epoch=1, role=role, **kw)  # type: ignore[arg-type]


def path_policy() -> PathPolicy:
    return PathPolicy(PathConfig(mode="threshold", threshold_tokens=100_000), PathCosts(PRIORS))


def test_reason_is_a_known_path_reason() -> None:
    assert LOCAL_PEER_FETCH in REASONS and REMOTE_PEER_FETCH in REASONS


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="peer_fetch"):
        PeerFetchConfig(mode="sometimes")
    with pytest.raises(ValueError, match="min_blocks"):
        PeerFetchConfig(min_blocks=0)


def test_the_holder_with_the_most_blocks_is_fetched_from_and_one_token_is_left_to_compute() -> None:
    pol, path = PeerFetchPolicy(PeerFetchConfig("always")), path_policy()
    d0, d1, p0 = view("d0"), view("d1"), view("p0", "prefill")
    decision = path.decide(PathRequest(160), None, [d0], {})
    matched = {"d1": 10, "p0": 4, "d0": 1}
    out, fetch = pol.decide(PathRequest(160), decision, d0, [d1, p0], matched, path)
    assert fetch is not None and fetch.holder_id == "d1"
    # 160 tokens = 10 full blocks, but the last token is always computed: 9 blocks fetched.
    assert (fetch.num_blocks, fetch.num_local_blocks, fetch.num_tokens, fetch.num_pull_tokens) == (9, 1, 144, 128)
    assert (out.reason, out.decode_id, out.prefill_id, out.num_uncached_tokens) == (LOCAL_PEER_FETCH, "d0", None, 16)
    assert out.predicted_ttft_s == pytest.approx(fetch.predicted_s)
    assert out.alternative_ttft_s == decision.predicted_ttft_s
    assert pol.decisions[FETCH] == 1


def test_ties_go_to_the_less_loaded_holder() -> None:
    pol, path = PeerFetchPolicy(PeerFetchConfig("always")), path_policy()
    d0 = view("d0")
    a, b = view("a", num_running=4), view("b")
    decision = path.decide(PathRequest(400), None, [d0], {})
    _, fetch = pol.decide(PathRequest(400), decision, d0, [a, b], {"a": 8, "b": 8}, path)
    assert fetch is not None and fetch.holder_id == "b"


def test_too_few_blocks_beyond_the_own_cache_is_no_fetch() -> None:
    pol, path = PeerFetchPolicy(PeerFetchConfig("always", min_blocks=2)), path_policy()
    d0, d1 = view("d0"), view("d1")
    decision = path.decide(PathRequest(400), None, [d0], {"d0": 5})
    out, fetch = pol.decide(PathRequest(400), decision, d0, [d1], {"d0": 5, "d1": 6}, path)
    assert fetch is None and out is decision and pol.decisions[NO_HOLDER] == 1


def test_cost_mode_fetches_only_when_predicted_faster() -> None:
    pol, path = PeerFetchPolicy(PeerFetchConfig("cost")), path_policy()
    d0, d1 = view("d0"), view("d1")
    long = PathRequest(2000)
    decision = path.decide(long, None, [d0], {})
    # 100 blocks at 200 us per token to recompute vs 20 us per token to pull: fetch.
    out, fetch = pol.decide(long, decision, d0, [d1], {"d1": 100}, path)
    assert fetch is not None and out.reason == LOCAL_PEER_FETCH
    assert decision.predicted_ttft_s is not None and fetch.predicted_s < decision.predicted_ttft_s
    # A measured slow pair (the holder's link) makes recomputing faster: no fetch.
    for _ in range(20):
        path.costs.observe_transfer("d1", "d0", 1600, 5.0)
    out, fetch = pol.decide(long, decision, d0, [d1], {"d1": 100}, path)
    assert fetch is None and out is decision and pol.decisions[SLOWER] == 1


def test_a_loaded_holder_costs_more() -> None:
    pol, path = PeerFetchPolicy(PeerFetchConfig("cost")), path_policy()
    d0 = view("d0")
    idle, backlogged = view("d1"), view("d1", num_backlog_tokens=5000)
    args = (PathRequest(2000), path.decide(PathRequest(2000), None, [d0], {}), d0)
    _, a = pol.decide(*args, [idle], {"d1": 100}, path)
    _, b = pol.decide(*args, [backlogged], {"d1": 100}, path)
    assert a is not None and (b is None or b.predicted_s > a.predicted_s)


def test_a_busy_holder_pins_after_its_step() -> None:
    """A holder with requests running pins between its steps: its pin is predicted at least its
    measured step (1 s here), not an idle one-block prefill."""
    pol, path = PeerFetchPolicy(PeerFetchConfig("always")), path_policy()
    d0 = view("d0")
    for i in range(20):
        path.costs.observe_itl(1.0, "d1", float(i))
    args = (PathRequest(2000), path.decide(PathRequest(2000), None, [d0], {}), d0)
    _, idle = pol.decide(*args, [view("d1")], {"d1": 100}, path)
    _, busy = pol.decide(*args, [view("d1", num_inflight=1)], {"d1": 100}, path)
    assert idle is not None and busy is not None
    assert busy.predicted_s >= idle.predicted_s + 1.0


def test_off_never_fetches() -> None:
    pol, path = PeerFetchPolicy(PeerFetchConfig("off")), path_policy()
    d0, d1 = view("d0"), view("d1")
    decision = path.decide(PathRequest(400), None, [d0], {})
    assert pol.decide(PathRequest(400), decision, d0, [d1], {"d1": 20}, path) == (decision, None)


def test_router_turns_a_remote_decision_into_a_local_fetch_and_skips_unmappable_holders() -> None:
    path = PathPolicy(PathConfig(mode="remote"), PathCosts(PRIORS))
    router = Router(LoadBasedPolicy(), path=path, fetch=PeerFetchPolicy(PeerFetchConfig("always")))
    p0 = view("p0", "prefill")
    d0, d1 = view("d0", kv_usage=0.95), view("d1")
    hashes = list(range(1, 21))
    from services.scheduler.prefix_index import EngineMatch

    matches = {"d0": EngineMatch("d0", 1, 20, tuple(frozenset({"GPU"}) for _ in range(20)))}
    route = router.route(RoutingRequest(hashes, 330, prefix_matches=matches), [p0], [d0, d1])
    # d0 holds the prompt but is nearly full: the remote decision goes to d1, which fetches from d0.
    assert route.fetch is not None and route.fetch.holder_id == "d0" and route.fetch.target_id == "d1"
    assert route.prefill.engine_id is None and route.path is not None and route.path.reason == LOCAL_PEER_FETCH
    # A holder whose KV heads the decode engine cannot read is not a holder.
    d0_tp2 = view("d0", kv_usage=0.95, tp_size=2, num_kv_heads=3)
    d1_h3 = view("d1", num_kv_heads=3)
    route = router.route(RoutingRequest(hashes, 330, prefix_matches=matches), [p0], [d0_tp2, d1_h3])
    assert route.fetch is None


def test_a_busy_engine_is_never_routed_to_but_is_fetched_from() -> None:
    from services.scheduler.prefix_index import EngineMatch

    router = Router(LoadBasedPolicy(), path=PathPolicy(PathConfig(mode="threshold", threshold_tokens=100_000),
                                                       PathCosts(PRIORS)),
                    fetch=PeerFetchPolicy(PeerFetchConfig("always")))
    matches = {"d0": EngineMatch("d0", 1, 12, tuple(frozenset({"GPU"}) for _ in range(12)))}
    request = RoutingRequest(list(range(1, 15)), 229, prefix_matches=matches)
    route = router.route(request, [view("p0", "prefill")], [view("d1")], busy=[view("d0", num_inflight=1)])
    assert route.decode.engine_id == "d1"
    assert route.fetch is not None and (route.fetch.holder_id, route.fetch.num_blocks) == ("d0", 12)
    # Without the busy holder's view its blocks are unknown: nothing to fetch.
    assert router.route(request, [view("p0", "prefill")], [view("d1")]).fetch is None


def test_ranks_learn_every_engine_only_with_peer_fetch_on() -> None:
    from services.scheduler.control import audience, peer_roles
    from services.scheduler.registry import Role

    assert peer_roles(Role.DECODE) == audience(Role.DECODE) == (Role.PREFILL,)
    assert peer_roles(Role.DECODE, True) == audience(Role.DECODE, True) == (Role.PREFILL, Role.DECODE)
    assert peer_roles(Role.PREFILL) == audience(Role.PREFILL) == (Role.DECODE,)
    # A prefill engine pulls a prefix from any engine (decision 0046).
    assert peer_roles(Role.PREFILL, True) == audience(Role.PREFILL, True) == (Role.PREFILL, Role.DECODE)


# -- fetching into the prefill engine of a remote decision (decision 0046) -----------------------


def _remote_route(router: Router, holders: dict[str, int], decodes: list[EngineView] | None = None,
                  num_tokens: int = 330) -> Route:
    from services.scheduler.prefix_index import EngineMatch

    matches = {e: EngineMatch(e, 1, n, tuple(frozenset({"GPU"}) for _ in range(n))) for e, n in holders.items()}
    hashes = list(range(1, num_tokens // 16 + 1))
    return router.route(RoutingRequest(hashes, num_tokens, prefix_matches=matches), [view("p0", "prefill")],
                        decodes or [view("d0"), view("d1", num_running=3)])


def _remote_router(mode: str) -> Router:
    return Router(LoadBasedPolicy(), path=PathPolicy(PathConfig(mode="remote"), PathCosts(PRIORS)),
                  fetch=PeerFetchPolicy(PeerFetchConfig(mode)))


def test_a_remote_prompt_whose_decode_engine_holds_the_prefix_is_fetched_into_the_prefill_engine() -> None:
    # d0 holds the conversation's history and is the remote decision's decode engine (fewest
    # blocks to pull): nothing to fetch into it, so p0 pulls the history and prefills the rest.
    route = _remote_route(_remote_router("always"), {"d0": 20})
    assert route.fetch is not None and route.fetch.into_prefill
    assert (route.fetch.holder_id, route.fetch.target_id, route.fetch.num_blocks) == ("d0", "p0", 20)
    path = route.path
    assert path is not None and (path.reason, path.prefill_id, path.decode_id) == (REMOTE_PEER_FETCH, "p0", "d0")
    assert path.num_uncached_tokens == 330 - 20 * 16 and route.prefill.engine_id == "p0"
    assert path.predicted_ttft_s is not None and path.alternative_ttft_s is not None
    assert path.predicted_ttft_s < path.alternative_ttft_s


def test_the_cost_mode_fetches_into_the_prefill_engine_only_when_predicted_faster() -> None:
    router = _remote_router("cost")
    route = _remote_route(router, {"d0": 60}, num_tokens=1000)
    assert route.fetch is not None and route.fetch.into_prefill and route.path is not None
    assert route.path.reason == REMOTE_PEER_FETCH
    # The holder's link to p0 measured slow: pulling costs more than prefilling, no fetch.
    for _ in range(20):
        router.path.costs.observe_transfer("d0", "p0", 960, 10.0)
    route = _remote_route(router, {"d0": 60}, num_tokens=1000)
    assert route.fetch is None and route.path is not None and route.path.reason != REMOTE_PEER_FETCH
    assert router.fetch is not None and router.fetch.decisions[SLOWER] == 1


def test_a_fetch_into_the_decode_engine_is_preferred_and_a_prefill_engine_holding_the_prefix_needs_none() -> None:
    # d0, nearly full, holds it; the decision decodes on d1: d1 pulls (as before decision 0046).
    route = _remote_route(_remote_router("always"), {"d0": 20}, [view("d0", kv_usage=0.95), view("d1")])
    assert route.fetch is not None and not route.fetch.into_prefill
    assert route.path is not None and route.path.reason == LOCAL_PEER_FETCH
    # p0 itself holds as much as anyone: nothing to fetch anywhere.
    assert _remote_route(_remote_router("always"), {"d0": 20, "p0": 20}).fetch is None


def test_a_pin_on_pdserves_engine_waits_for_its_current_step_only() -> None:
    """Decision 0049: pdserve's engine pins between two steps without computing, so its pin is
    the rest of its step (a whole measured step, 1 s here, when busy) plus the call, whatever
    its backlog and load; a vLLM holder's pin is still a prefill behind its backlog."""
    pol, path = PeerFetchPolicy(PeerFetchConfig("always")), path_policy()
    for i in range(20):
        path.costs.observe_itl(1.0, "d1", float(i))
    loaded = dict(num_inflight=3, num_running=4, num_waiting=2, num_backlog_tokens=20_000)
    assert pol.pin_s(view("d1", native_engine=True), path) == pytest.approx(PIN_CALL_S)
    assert pol.pin_s(view("d1", native_engine=True, num_running=1), path) == pytest.approx(PIN_CALL_S + 1.0)
    assert pol.pin_s(view("d1", native_engine=True, **loaded), path) == pytest.approx(PIN_CALL_S + 1.0)
    vllm = pol.pin_s(view("d1", **loaded), path)
    assert vllm > 4.0 + 1.0  # 20,000 queued tokens at 0.2 ms each, then its step and load
    d0 = view("d0")
    args = (PathRequest(2000), path.decide(PathRequest(2000), None, [d0], {}), d0)
    _, native = pol.decide(*args, [view("d1", native_engine=True, **loaded)], {"d1": 100}, path)
    _, other = pol.decide(*args, [view("d1", **loaded)], {"d1": 100}, path)
    assert native is not None and other is not None
    assert other.predicted_s - native.predicted_s == pytest.approx(vllm - PIN_CALL_S - 1.0)
