"""Two active scheduler replicas end to end: real processes, KV over UCX, the demo model.

Both replicas serve (gRPC and the OpenAI API) with the same outputs; a replica killed with
SIGKILL mid-stream loses no request: the client library goes on at the other replica from the
tokens it had (no token twice, none missing), the engines release the blocks they held for the
dead replica's requests within the loss timeout, and nothing leaks. A replica restarted while
the engines run takes the blocks stored before from its peer's snapshot, reports ready once its
index has converged, and routes like the survivor. A KV-event consumer reading the replica that died resumes at the
other from a snapshot and ends with the same block state as one that never lost its replica:
over gRPC and over ZMQ (vLLM's wire format, the snapshot from the replay socket)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from e2e_cluster import MAX_TOKENS, start_cluster

from pdserve.v1 import engine_pb2, engine_pb2_grpc, kv_events_pb2, kv_events_pb2_grpc
from services.client import Client, GenerationResult
from services.common.grpc_server import CHANNEL_OPTIONS
from services.event_subscriber import EventSubscriber
from services.local_cluster import LocalCluster, ReplicaPorts
from services.scheduler.peer_snapshots import SnapshotReader
from services.scheduler.tokenization import PromptTokenizer
from services.zmq_event_subscriber import ZmqEventSubscriber

pytestmark = pytest.mark.timeout(300)

LONG_TOKENS = 40
LOSS_TIMEOUT_S = 5.0  # services.engine.control_fanout.DEFAULT_LOSS_TIMEOUT_S


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory, "replicas", num_schedulers=2, zmq=True)
    yield c
    c.stop()


def _greedy(target: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> GenerationResult:
    with Client(target) as client:
        return client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=60)


def _pin(cluster: LocalCluster, request_id: str, prompt: list[int]) -> None:
    """A prefill straight on the engine: its blocks stay pinned for a reader (2 leases: 60 s)."""
    with grpc.insecure_channel(cluster.components["prefill-0"].address, CHANNEL_OPTIONS) as channel:
        engine_pb2_grpc.EngineStub(channel).Prefill(
            engine_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt), timeout=30)


def _wait_pinned(cluster: LocalCluster, expected: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while (pinned := cluster.inspect("prefill-0").num_pinned) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return pinned


def test_replica_killed_mid_stream_loses_nothing(replicas: LocalCluster, prompts: list[list[int]],
                                                  reference: list[list[int]]) -> None:
    a, b = replicas.replicas
    target_a, target_b = replicas.replica_target(a), replicas.replica_target(b)
    id_a = replicas.server_info(target=target_a).scheduler_id
    id_b = replicas.server_info(target=target_b).scheduler_id
    assert id_a and id_b and id_a != id_b

    # KV-event consumers: one reads replica b throughout, one reads a and moves to b when a dies.
    events_a, events_b = (f"{replicas.spec.host}:{r.events_port}" for r in (a, b))
    steady, moving = EventSubscriber(events_b), EventSubscriber(f"{events_a},{events_b}")
    steady.start()
    moving.start()
    zmq_a, zmq_b = ((r.zmq_endpoint, r.zmq_replay_endpoint)
                    for r in (a, b))
    zmq_steady, zmq_moving = ZmqEventSubscriber([zmq_b]), ZmqEventSubscriber([zmq_a, zmq_b])
    zmq_steady.start()
    zmq_moving.start()

    # Both replicas route and serve, with the in-process engine's outputs.
    for i, target in enumerate([target_a, target_b, target_a, target_b]):
        assert _greedy(target, prompts[i]).token_ids == reference[i], f"prompt {i} via {target}"
    expected = [_greedy(target_b, prompts[i], LONG_TOKENS).token_ids for i in range(3)]
    assert all(e[:MAX_TOKENS] == reference[i] for i, e in enumerate(expected))

    # Blocks held for each replica's requests.
    _pin(replicas, f"pinned.1@{id_a}", prompts[5])
    _pin(replicas, f"pinned.2@{id_b}", prompts[6])
    assert replicas.inspect("prefill-0").num_pinned == 2

    # Streams through replica a (listed first); a dies once each has tokens.
    results: list[GenerationResult | BaseException | None] = [None] * 3
    received = [0] * 3
    started = [threading.Event() for _ in range(3)]

    def on_chunk(i: int, n: int) -> None:
        received[i] += n
        started[i].set()

    def stream(i: int) -> None:
        try:
            with Client(f"{target_a},{target_b}") as client:
                results[i] = client.generate(prompts[i], max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True,
                                             timeout=60, on_chunk=lambda c: on_chunk(i, len(c.token_ids)))
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            results[i] = e

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    assert all(e.wait(30) for e in started)
    killed_at = time.monotonic()
    replicas.kill("scheduler")
    mid_stream = [i for i, t in enumerate(threads) if t.is_alive() and 0 < received[i] < LONG_TOKENS]
    for t in threads:
        t.join(60)
    for i, r in enumerate(results):
        assert isinstance(r, GenerationResult), f"stream {i}: {r!r}"
        assert r.token_ids == expected[i], f"stream {i}: {r.token_ids} != {expected[i]}"
        assert r.generated_tokens == LONG_TOKENS
    assert mid_stream, "no stream was in flight when the replica died"
    for i in mid_stream:  # went on at replica b from the tokens it had: decode-only, no prefill again
        r = results[i]
        assert isinstance(r, GenerationResult) and r.num_retries == 1 and r.prefill_engine_id == "", r

    # The engines release what they held for the dead replica's requests, and only that.
    assert _wait_pinned(replicas, 1, LOSS_TIMEOUT_S + 5.0) == 1, "replica a's pinned prefill was not released"
    assert time.monotonic() - killed_at < LOSS_TIMEOUT_S + 5.0

    # The survivor serves on: gRPC (a client listing the dead replica first retries before the
    # first token, the library and `pdserve generate --target a,b` alike) and the OpenAI API.
    for i in range(6, 8):
        assert _greedy(target_b, prompts[i]).token_ids == reference[i]
    retried = _greedy(f"{target_a},{target_b}", prompts[8])
    assert retried.token_ids == reference[8] and retried.num_retries == 1
    cli = subprocess.run([sys.executable, "-m", "services.common.cli", "generate", "--target", f"{target_a},{target_b}",
                          "--prompt-ids", ",".join(map(str, prompts[9])), "--max-tokens", str(MAX_TOKENS),
                          "--temperature", "0", "--ignore-eos", "--json"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["token_ids"] == reference[9]
    completion = openai.OpenAI(base_url=replicas.replica_http_url(b), api_key="none").completions.create(
        model=replicas.server_info(target=target_b).model, prompt=prompts[9], max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
    assert completion.choices[0].text

    with grpc.insecure_channel(replicas.components["prefill-0"].address, CHANNEL_OPTIONS) as channel:
        engine_pb2_grpc.EngineStub(channel).Release(engine_pb2.ReleaseRequest(request_id=f"pinned.2@{id_b}"))
    assert replicas.wait_no_leaks() == {}

    # The consumer that lost its replica resumed at b from a snapshot: the same block state as
    # the one that never lost its replica (nothing missed, nothing twice).
    deadline = time.monotonic() + 10
    while (moving.target != events_b or moving.blocks() != steady.blocks()) and time.monotonic() < deadline:
        time.sleep(0.1)
    moving.close()
    steady.close()
    assert moving.target == events_b and moving.state.num_snapshots == 2 and steady.state.num_snapshots == 1
    assert moving.blocks() == steady.blocks() and sum(map(len, steady.blocks().values())) > 0
    # The same over ZMQ: the consumer of a moved to b (b's snapshot, then b's seqs).
    while (zmq_moving.endpoint != zmq_b[0] or zmq_moving.blocks() != zmq_steady.blocks()) and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    zmq_moving.close()
    zmq_steady.close()
    assert zmq_moving.endpoint == zmq_b[0] and zmq_moving.num_snapshots == 2 and zmq_steady.num_snapshots == 1
    assert zmq_moving.blocks() == zmq_steady.blocks()
    by_engine = {topic.decode().split("@")[1]: {(m, h) for m, h in blocks}
                 for topic, blocks in zmq_steady.blocks().items()}
    assert by_engine == {e: {(m, h) for m, h in blocks} for e, blocks in steady.blocks().items()}


def _index(cluster: LocalCluster, replica: ReplicaPorts) -> dict[str, set[tuple[str | None, object]]]:
    """The replica's prefix index as a snapshot shows it: engine -> {(medium, block hash)}."""
    reader = SnapshotReader()
    with grpc.insecure_channel(f"{cluster.spec.host}:{replica.events_port}", CHANNEL_OPTIONS) as channel:
        call = kv_events_pb2_grpc.KVEventsStub(channel).Subscribe(kv_events_pb2.SubscribeRequest(snapshot=True),
                                                                   timeout=30)
        for msg in call:
            reader.feed(msg)
            if reader.done:
                call.cancel()
                break
    assert reader.snapshot is not None
    return {e: {(m, h) for m, hashes in s.blocks.items() for h in hashes} for e, s in reader.snapshot.engines.items()}


def test_restarted_replica_converges_and_routes_like_the_survivor(replicas: LocalCluster,
                                                                   demo_model: Path) -> None:
    a, b = replicas.replicas
    target_a, target_b = replicas.replica_target(a), replicas.replica_target(b)
    if not replicas.components[a.name].alive:
        replicas.restart(a.name)
    deadline = time.monotonic() + 60
    while not replicas.replica_ready(a.name) and time.monotonic() < deadline:
        time.sleep(0.2)
    # A prefix-heavy workload: four long documents, each prefilled once (on one prefill engine)
    # through either replica, then acknowledged (no report left for the engines to resend).
    tokenizer = PromptTokenizer(demo_model)
    docs = [tokenizer.encode(f"Document {k}: " + " ".join(f"word{k}x{j}" for j in range(40))) for k in range(4)]
    seeded = [_greedy(target_a if k % 2 else target_b, doc + tokenizer.encode(" Summary:"), 2) for k, doc in enumerate(docs)]
    time.sleep(1.5)

    replicas.restart(a.name)  # SIGKILL, then the same command: a new scheduler id, an empty index
    restarted_at = time.monotonic()
    while not replicas.replica_ready(a.name):
        assert time.monotonic() - restarted_at < 60, "the restarted replica never reported ready"
        time.sleep(0.1)
    assert replicas.server_info(target=target_a).scheduler_id not in ("", replicas.server_info(target=target_b).scheduler_id)

    # Converged: the same index as the survivor (the blocks stored before the restart came from
    # b's snapshot), so the same routing decisions.
    index_a, index_b = _index(replicas, a), _index(replicas, b)
    assert index_a == index_b and sum(map(len, index_b.values())) > 0
    for k, doc in enumerate(docs):
        via_a = _greedy(target_a, doc + tokenizer.encode(" Question:"), 2)
        via_b = _greedy(target_b, doc + tokenizer.encode(" Answer:"), 2)
        assert via_a.prefill_engine_id == via_b.prefill_engine_id == seeded[k].prefill_engine_id, (k, via_a, via_b)

    # The OpenAI API's retry path: a stream cut after a few tokens goes on at the other replica
    # from the token ids it had (return_token_ids, then output_token_ids): none twice, none missing.
    prompt = docs[0] + tokenizer.encode(" Continue:")
    full = _greedy(target_b, prompt, LONG_TOKENS).token_ids
    got = _openai_stream(replicas.replica_http_url(a), prompt, [], stop_after=5)
    assert 5 <= len(got) < LONG_TOKENS
    assert got + _openai_stream(replicas.replica_http_url(b), prompt, got) == full
    assert replicas.wait_no_leaks() == {}


def _openai_stream(base_url: str, prompt: list[int], had: list[int], stop_after: int = 0) -> list[int]:
    """The token ids a streamed completion sends (continuing after `had`), cut after
    `stop_after` of them when that is set (the client closes the stream)."""
    client = openai.OpenAI(base_url=base_url, api_key="none")
    stream = client.completions.create(model="", prompt=prompt, max_tokens=LONG_TOKENS, temperature=0.0, stream=True,
                                       extra_body={"ignore_eos": True, "return_token_ids": True,
                                                   "output_token_ids": had})
    got: list[int] = []
    for chunk in stream:
        for choice in chunk.choices:
            got += (choice.model_extra or {}).get("token_ids") or []
        if stop_after and len(got) >= stop_after:
            stream.close()
            break
    return got
