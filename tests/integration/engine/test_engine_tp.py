"""Tensor parallelism: tp=2 (a spawned rank process, gloo) gives the same greedy output as tp=1,
each rank holds its half of the KV heads, and the rank_init hook runs on every rank."""

from __future__ import annotations

from typing import Any

from engine.request import RequestMode, SamplingParams


class RecordingConnector:
    """A worker-side connector that records what the engine calls (module-level: picklable)."""

    def __init__(self, rank: int, heads: int) -> None:
        self.rank, self.heads = rank, heads
        self.calls: list[str] = []

    def register_kv_caches(self, kv_cache: Any, spec: Any) -> None:
        self.calls.append("register")

    def start_load_kv(self, meta: Any) -> None:
        self.calls.append("load")

    def wait_for_save(self) -> None:
        self.calls.append("save")

    def get_transfer_results(self, finished_req_ids: frozenset[str] = frozenset()) -> Any:
        from connectors.outputs import TransferResults

        return TransferResults(finished_sending=finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def get_kv_connector_stats(self) -> None:
        return None

    def get_kv_connector_kv_cache_events(self) -> list[Any]:
        return []

    def build_connector_worker_meta(self) -> None:
        return None

    def shutdown(self) -> None:
        self.calls.append("shutdown")


def rank_init(rank: int, tp_size: int, kv_cache: Any, spec: Any) -> RecordingConnector:
    assert tuple(kv_cache.shape) == spec.shape and spec.tp_size == tp_size
    return RecordingConnector(rank, kv_cache.shape[1])  # NHL2BD: heads are dim 1


def test_tp2_matches_tp1(tiny_model, make_engine, prompts_of) -> None:
    model = tiny_model("llama_gqa_llama3")
    prompts = prompts_of([5, 29, 12], seed=21)
    params = SamplingParams(max_tokens=24)
    tp1 = make_engine(model.path, block_size=8)
    tp2 = make_engine(model.path, block_size=8, tp=2, torch_threads=1, rank_init=rank_init)
    assert tp2.kv_cache_spec.num_kv_heads_local == 1 and tp2.kv_cache_spec.kv_head_ranges == ((0, 1), (1, 2))
    assert tp2.kv_cache.shape[1] == 1
    assert tp2.generate(prompts, params) == tp1.generate(prompts, params)

    # A prefill-only request on tp=2: rank 0's KV for head 0 equals tp=1's head 0.
    tp1.add_request("p", prompts[1], params, mode=RequestMode.PREFILL_ONLY)
    tp2.add_request("p", prompts[1], params, mode=RequestMode.PREFILL_ONLY)
    for eng in (tp1, tp2):
        while eng.has_unfinished_requests():
            eng.step()
    b1, b2 = tp1.get_block_ids("p"), tp2.get_block_ids("p")
    assert (tp1.kv_cache[b1][:, 0:1] - tp2.kv_cache[b2]).abs().max() < 1e-5
    assert tp1.release("p") and tp2.release("p")
    connector = tp2.workers.rank0.connector
    assert connector.calls[0] == "register" and connector.calls[1:3] == ["load", "save"]
    finished = [o for o in tp2.take_connector_outputs() if o.finished_sending]
    assert any("p" in o.finished_sending for o in finished)


def test_tp2_idle_past_collective_timeout_then_serves(tiny_model, make_engine, prompts_of) -> None:
    """Idle far longer than the ranks' collective timeout: the keepalive keeps rank 1 waiting,
    and the engine still serves (without it rank 1 times out in its plan wait and exits)."""
    import time

    model = tiny_model("llama_gqa_llama3")
    prompts = prompts_of([7], seed=3)
    params = SamplingParams(max_tokens=8)
    engine = make_engine(model.path, block_size=8, tp=2, torch_threads=1, tp_timeout_s=2.0)
    before = engine.generate(prompts, params)
    time.sleep(5.0)  # 2.5x the timeout, nothing to do
    assert all(p.is_alive() for p in engine.workers.procs)
    assert engine.generate(prompts, params) == before
