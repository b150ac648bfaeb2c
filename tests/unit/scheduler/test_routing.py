import pytest

from services.scheduler.routing import (
    REASON_LOAD,
    REASON_NO_DECODE,
    REASON_NO_PREFILL,
    REASON_ROUND_ROBIN,
    REASON_SHORT_PROMPT,
    REASON_UNMAPPABLE_TP,
    EngineView,
    LoadBasedPolicy,
    RoundRobinPolicy,
    Router,
    RoutingPolicy,
    RoutingRequest,
    make_policy,
    pair_problem,
)

REQ = RoutingRequest(block_hashes=[1, 2, 3], num_tokens=50)


def view(engine_id: str, role: str = "prefill", **kw: float) -> EngineView:
    return EngineView(engine_id=engine_id, epoch=1, role=role, **kw)  # type: ignore[arg-type]


def test_load_policy_picks_least_loaded_with_stable_ties() -> None:
    p = LoadBasedPolicy()
    assert p.choose_prefill(REQ, [view("a", num_inflight=3), view("b", num_inflight=1)]).engine_id == "b"
    d = p.choose_prefill(REQ, [view("b"), view("a")])
    assert (d.engine_id, d.reason) == ("a", REASON_LOAD)
    # KV usage breaks ties between equally queued engines.
    assert p.choose_prefill(REQ, [view("a", kv_usage=0.9), view("b", kv_usage=0.1)]).engine_id == "b"


def test_round_robin_cycles_in_id_order() -> None:
    p = RoundRobinPolicy()
    engines = [view("c"), view("a", num_inflight=9), view("b")]
    picks = [p.choose_prefill(REQ, engines) for _ in range(4)]
    assert [d.engine_id for d in picks] == ["a", "b", "c", "a"]
    assert {d.reason for d in picks} == {REASON_ROUND_ROBIN}


def test_router_decode_only_reasons_and_counts() -> None:
    router = Router(LoadBasedPolicy(), decode_only_threshold=16)
    decodes = [view("d1", "decode", num_running=4), view("d2", "decode")]
    short = router.route(RoutingRequest([], 15), [view("p")], decodes)
    assert short.decode_only and short.prefill.reason == REASON_SHORT_PROMPT
    assert short.decode.engine_id == "d2"
    none = router.route(REQ, [], decodes)
    assert none.decode_only and none.prefill.reason == REASON_NO_PREFILL
    full = router.route(REQ, [view("p")], decodes)
    assert not full.decode_only and full.prefill.engine_id == "p"
    assert router.decisions == {REASON_SHORT_PROMPT: 1, REASON_NO_PREFILL: 1, REASON_LOAD: 1}


def test_router_excludes_failed_decode_engines() -> None:
    router = Router(LoadBasedPolicy())
    decodes = [view("d1", "decode"), view("d2", "decode", num_inflight=5)]
    assert router.route(REQ, [], decodes, exclude_decode=frozenset({"d1"})).decode.engine_id == "d2"
    gone = router.route(REQ, [], decodes, exclude_decode=frozenset({"d1", "d2"}))
    assert gone.decode.engine_id is None and gone.decode.reason == REASON_NO_DECODE


def test_policies_implement_the_protocol_and_names_resolve() -> None:
    assert isinstance(LoadBasedPolicy(), RoutingPolicy) and isinstance(RoundRobinPolicy(), RoutingPolicy)
    assert make_policy("round_robin").name == "round_robin"
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random")


def test_router_pairs_only_mappable_tp_layouts_and_counts_the_rest_as_decode_only() -> None:
    router = Router(LoadBasedPolicy())
    decode = [view("d", "decode", tp_size=2, num_kv_heads=2)]
    # 2 KV heads replicate over tp 4; over tp 3 they neither split nor replicate evenly.
    wide = view("p4", tp_size=4, num_kv_heads=2)
    odd = view("p3", tp_size=3, num_kv_heads=2, num_inflight=0)
    busy = view("p1", tp_size=1, num_kv_heads=2, num_inflight=7)
    assert pair_problem(odd, decode[0]) == "prefill num_key_value_heads=2 does not divide tp=3 (heads cannot be " \
                                           "replicated evenly)"
    assert pair_problem(wide, decode[0]) is None and pair_problem(busy, decode[0]) is None
    # The least loaded prefill engine cannot be read by the decode engine: the next one serves.
    assert router.route(REQ, [odd, busy], decode).prefill.engine_id == "p1"
    only_odd = router.route(REQ, [odd], decode)
    assert only_odd.decode_only and only_odd.prefill.reason == REASON_UNMAPPABLE_TP
    assert router.decisions[REASON_UNMAPPABLE_TP] == 1
    # Engines whose KV heads are unknown (no handshake metadata) are assumed to map.
    assert pair_problem(view("p", tp_size=3), view("d", "decode", tp_size=2)) is None


def test_a_mixed_decode_engine_computes_its_own_prompts() -> None:
    from services.scheduler.path_policy import LOCAL_MIXED_ENGINE

    router = Router(LoadBasedPolicy())
    prefill = EngineView("p0", 1, "prefill")
    mixed = EngineView("m0", 1, "mixed")
    route = router.route(RoutingRequest([1, 2, 3], 48), [prefill], [mixed])
    assert route.decode_only and route.decode.engine_id == "m0"
    assert route.path is not None and route.path.reason == LOCAL_MIXED_ENGINE
    plain = router.route(RoutingRequest([1, 2, 3], 48), [prefill], [EngineView("d0", 1, "decode")])
    assert plain.prefill.engine_id == "p0"
