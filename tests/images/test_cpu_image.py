"""The CPU image end to end: the scheduler, one prefill and one decode engine as three containers
of it on a user-defined Docker network (KV crosses between containers over UCX's TCP transport);
gRPC Generate and the OpenAI HTTP API answer what the in-process engine answers; a killed decode
container is marked down and a new one joins and serves; every container drains and exits 0 on
`docker stop`. The image's HEALTHCHECK (`pdserve health`) gates each start."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Iterator

import pytest
from docker_cluster import SCHEDULER_PORTS, DockerCluster, docker
from prometheus_client.parser import text_string_to_metric_families

from services.client import Client, GenerationResult

pytestmark = pytest.mark.timeout(900)
PROMPT = "The capital of France is"
MAX_TOKENS = 12


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` in a /metrics page."""
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def cluster() -> Iterator[DockerCluster]:
    c = DockerCluster(os.environ["PDSERVE_TEST_IMAGE"])
    print(f"\n{c.image}: {c.image_size_mib():.0f} MiB")
    try:
        c.create_network()
        scheduler = c.scheduler()
        c.engine("prefill", "prefill-0", scheduler)
        c.engine("decode", "decode-0", scheduler)
        c.wait_healthy(c.containers)
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def reference() -> list[int]:
    """Greedy tokens of the in-process engine (float32, as the containers run)."""
    from tokenizers import Tokenizer

    from engine.demo_model import demo_model_dir
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    model = demo_model_dir()
    ids = Tokenizer.from_file(str(model / "tokenizer.json")).encode(PROMPT).ids
    with LLMEngine(model, torch_threads=1, dtype="float32") as engine:
        [out] = engine.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return list(out)


def scheduler_of(c: DockerCluster) -> str:
    return c.containers[0]


def generate(c: DockerCluster, timeout: float = 120.0) -> GenerationResult:
    """A greedy Generate through the published client port, retried while the cluster forms."""
    target = f"127.0.0.1:{c.host_port(scheduler_of(c), SCHEDULER_PORTS['port'])}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            with Client(target) as client:
                return client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def test_generate_and_openai_http_across_containers(cluster: DockerCluster, reference: list[int]) -> None:
    result = generate(cluster)
    assert result.token_ids == reference and "Paris" in result.text
    assert result.prefill_engine_id == "prefill-0" and result.decode_engine_id == "decode-0"
    assert result.transferred_tokens > 0, "the decode container pulled the prompt's KV"
    decode_metrics = cluster.metrics(f"{cluster.prefix}-decode-0")
    assert metric_sum(decode_metrics, "pdserve_transfer_bytes_total", transport="tcp") > 0, \
        "KV crossed between the containers over TCP"
    http = cluster.host_port(scheduler_of(cluster), SCHEDULER_PORTS["http"])
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=30) as reply:
        [card] = json.loads(reply.read())["data"]
    body = json.dumps({"model": card["id"], "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        completion = json.loads(reply.read())
    assert completion["choices"][0]["text"] == result.text
    assert completion["usage"]["completion_tokens"] == MAX_TOKENS


def test_killed_decode_is_marked_down_and_a_new_one_serves(cluster: DockerCluster, reference: list[int]) -> None:
    scheduler = scheduler_of(cluster)
    docker("kill", f"{cluster.prefix}-decode-0")
    deadline = time.monotonic() + 60
    while metric_sum(cluster.metrics(scheduler, SCHEDULER_PORTS["metrics"]), "pdserve_scheduler_registered_engines",
                     role="decode", state="routable") > 0:
        assert time.monotonic() < deadline, "the scheduler still routes to the killed decode engine"
        time.sleep(0.5)
    replacement = cluster.engine("decode", "decode-1", scheduler)
    cluster.wait_healthy([replacement])
    result = generate(cluster)
    assert result.token_ids == reference and result.decode_engine_id == "decode-1"
    assert result.transferred_tokens > 0


def test_every_container_drains_on_docker_stop(cluster: DockerCluster) -> None:
    running = [c for c in cluster.containers if cluster.state(c).get("Running")]
    assert len(running) == 3, running
    for container in reversed(running):  # engines first, the scheduler last
        started = time.monotonic()
        docker("stop", "-t", "60", container, timeout=90)
        state = cluster.state(container)
        assert state["ExitCode"] == 0 and not state["OOMKilled"], \
            f"{container} exited {state['ExitCode']}:\n{cluster.logs(container)}"
        assert time.monotonic() - started < 60, f"{container} did not stop before docker's SIGKILL"
