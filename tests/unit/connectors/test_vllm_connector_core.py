"""The vLLM connector's torch-free scheduler half and its parameters, with hand-built vLLM-shaped
objects (no vLLM needed): pins, holds, pulls, cancels, bad descriptors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import pytest

from connectors.ucx.handshake import KVTransferDescriptor
from connectors.vllm.params import (
    PdserveConnectorConfig,
    descriptor_from_params,
    descriptor_to_params,
)
from connectors.vllm.scheduler import VllmSchedulerHalf

BS = 4


class Status(enum.Enum):
    RUNNING = 0
    FINISHED_LENGTH_CAPPED = 1
    FINISHED_ABORTED = 2


@dataclass
class Req:
    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    status: Status = Status.RUNNING


@dataclass
class NewReq:
    req_id: str
    num_computed_tokens: int


@dataclass
class Cached:
    req_ids: list[str] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class Step:
    num_scheduled_tokens: dict[str, int]
    scheduled_new_reqs: list[NewReq] = field(default_factory=list)
    scheduled_cached_reqs: Cached = field(default_factory=Cached)


class Manager:
    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return (self.blocks[request_id],)


def half(role: str = "prefill") -> tuple[VllmSchedulerHalf, Manager]:
    config = PdserveConnectorConfig(engine_id=f"{role}-0", role=role, epoch=7)
    h = VllmSchedulerHalf(config, block_size=BS, tp_size=1, num_kv_heads=3)
    m = Manager()
    h.bind_kv_cache_manager(m)
    return h, m


def test_prefill_pins_in_the_step_that_completes_the_prompt_and_holds_until_finished() -> None:
    h, m = half()
    r = Req("p1-x", 10, {"do_remote_decode": True, "pdserve_request_id": "p1"})
    h.on_new_request(r)
    m.blocks["p1-x"] = [5, 6, 9]
    # first chunk: 8 of 10 tokens, no pin yet
    assert not h.build_connector_meta(Step({"p1-x": 8}, [NewReq("p1-x", 0)])).sends
    plan = h.build_connector_meta(Step({"p1-x": 2}, scheduled_cached_reqs=Cached(["p1-x"], [8])))
    assert [(s.vllm_id, s.request_id, s.block_ids) for s in plan.sends] == [("p1-x", "p1", (5, 6, 9))]
    r.status = Status.FINISHED_LENGTH_CAPPED
    hold, params = h.request_finished(r)
    assert hold is True and params is not None
    d = descriptor_from_params(params)
    assert (d.engine_id, d.epoch, d.request_id, d.block_ids, d.num_tokens, d.block_size) == (
        "prefill-0", 7, "p1", (5, 6, 9), 10, BS)
    assert h.num_tracked() == 0


def test_prefill_pins_for_the_readers_tp() -> None:
    """A holder's pin names the reading engine's TP (a peer fetch tp 2 -> tp 1, decision 0032):
    each worker rank pins for the decode ranks reading its heads; none named is this engine's."""
    h, m = half()
    for rid, params in (("a", {"pdserve_reader_tp": 2}), ("b", {})):
        h.on_new_request(Req(rid, 4, {"do_remote_decode": True, "pdserve_request_id": rid, **params}))
        m.blocks[rid] = [1]
    plan = h.build_connector_meta(Step({"a": 4, "b": 4}, [NewReq("a", 0), NewReq("b", 0)]))
    assert sorted((s.request_id, s.reader_tp_size) for s in plan.sends) == [("a", 2), ("b", 0)]


def test_prefill_aborted_before_its_prompt_completes_is_not_held() -> None:
    h, m = half()
    r = Req("p2", 10, {"do_remote_decode": True, "pdserve_request_id": "p2"}, Status.FINISHED_ABORTED)
    h.on_new_request(r)
    assert h.request_finished(r) == (False, None)
    assert h.num_tracked() == 0


def test_pinned_prefill_aborted_is_held_and_cancelled() -> None:
    h, m = half()
    r = Req("p3", 4, {"do_remote_decode": True, "pdserve_request_id": "p3"})
    h.on_new_request(r)
    m.blocks["p3"] = [1]
    assert h.build_connector_meta(Step({"p3": 4}, [NewReq("p3", 0)])).sends
    r.status = Status.FINISHED_ABORTED
    assert h.request_finished(r) == (True, None)
    assert [(c.vllm_id, c.request_id) for c in h.build_connector_meta(Step({})).cancels] == [("p3", "p3")]


def remote(request_id: str, num_tokens: int, block_ids: tuple[int, ...]) -> dict[str, Any]:
    d = KVTransferDescriptor("prefill-0", 7, request_id, block_ids, num_tokens, 1, BS, 3, 0)
    return {"do_remote_prefill": True, **descriptor_to_params(d)}


def test_decode_pulls_the_blocks_after_the_local_hit_once() -> None:
    h, m = half("decode")
    r = Req("d1-x", 11, remote("d1", 10, (5, 6, 9)))  # prompt 10 + first token
    m.blocks["d1-x"] = [20, 21, 22]
    assert h.get_num_new_matched_tokens(r, 4) == (6, True)
    assert h.get_num_new_matched_tokens(r, 4) == (6, True)  # side-effect free
    h.update_state_after_alloc(r, 6)
    h.update_state_after_alloc(r, 0)  # the second call after the load: nothing new
    (pull,) = h.build_connector_meta(Step({})).pulls
    assert (pull.vllm_id, pull.request_id, pull.local_block_ids, pull.vllm_waits) == ("d1-x", "d1", (21, 22), True)
    assert h.get_num_new_matched_tokens(r, 0) == (0, False)  # planned: never twice
    h.update_connector_output({"d1-x"})
    r.status = Status.FINISHED_LENGTH_CAPPED
    assert h.request_finished(r) == (False, None)
    assert h.num_tracked() == 0


def test_peer_fetch_pulls_a_prefix_and_leaves_the_rest_of_the_prompt_to_vllm() -> None:
    """Decision 0043: the descriptor covers the holder's whole blocks of a longer prompt. The
    tokens offered are the descriptor's beyond the local hit; the pull fills the blocks between
    the two, and the prompt's tail (its last block) is vLLM's to compute."""
    h, m = half("decode")
    r = Req("f1-x", 14, remote("f1", 12, (5, 6, 9)))  # a 14-token prompt, 3 blocks held elsewhere
    m.blocks["f1-x"] = [30, 31, 32, 33]
    assert h.get_num_new_matched_tokens(r, 4) == (8, True)
    h.update_state_after_alloc(r, 8)
    (pull,) = h.build_connector_meta(Step({})).pulls
    assert (pull.request_id, pull.local_block_ids, pull.vllm_waits) == ("f1", (31, 32), True)
    assert pull.descriptor.num_tokens == 12
    h.update_connector_output({"f1-x"})
    r.status = Status.FINISHED_LENGTH_CAPPED
    assert h.request_finished(r) == (False, None) and h.num_tracked() == 0


def test_decode_with_a_full_local_hit_still_tells_the_scheduler() -> None:
    h, m = half("decode")
    r = Req("d2", 9, remote("d2", 8, (5, 6)))
    m.blocks["d2"] = [1, 2, 3]
    assert h.get_num_new_matched_tokens(r, 8) == (0, False)
    h.update_state_after_alloc(r, 0)
    (pull,) = h.build_connector_meta(Step({})).pulls
    assert (pull.local_block_ids, pull.vllm_waits) == ((), False)


@pytest.mark.parametrize("params, why", [
    ({"do_remote_prefill": True, "pdserve_request_id": "d3"}, "lacks"),
    (remote("d3", 8, (5,)), "block ids"),
    (remote("d3", 50, tuple(range(13))), "num_tokens"),
])
def test_decode_with_an_unreadable_descriptor_computes_locally(params: dict[str, Any], why: str,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    h, m = half("decode")
    r = Req("d3", 12, params)
    m.blocks["d3"] = [1, 2, 3]
    assert h.get_num_new_matched_tokens(r, 0) == (0, False)
    assert why in caplog.text
    h.update_state_after_alloc(r, 0)
    (pull,) = h.build_connector_meta(Step({})).pulls
    assert (pull.request_id, pull.local_block_ids, pull.vllm_waits) == ("d3", (), False)


def test_decode_aborted_while_pulling_is_cancelled_not_held() -> None:
    h, m = half("decode")
    r = Req("d4", 9, remote("d4", 8, (5, 6)))
    m.blocks["d4"] = [1, 2, 3]
    h.update_state_after_alloc(r, 8)
    h.build_connector_meta(Step({}))
    r.status = Status.FINISHED_ABORTED
    assert h.request_finished(r) == (False, None)
    assert [c.request_id for c in h.build_connector_meta(Step({})).cancels] == ["d4"]


def test_config_rejects_unknown_keys_and_bad_values() -> None:
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config keys \['bogus'\]"):
        PdserveConnectorConfig.from_extra({"engine_id": "e", "epoch": 1, "bogus": 1})
    with pytest.raises(ValueError, match="role must be prefill or decode"):
        PdserveConnectorConfig.from_extra({"engine_id": "e", "epoch": 1, "role": "both"})
    with pytest.raises(ValueError, match="epoch must be a non-zero 64-bit id"):
        PdserveConnectorConfig.from_extra({"engine_id": "e"})
