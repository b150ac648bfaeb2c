"""KV reuse across engines (decision 0043), end to end on 2 prefill + 2 decode engines of
pdserve's engine: a prompt whose prefix only a busy decode engine caches is served by the other
decode engine, which pulls that prefix from the holder over UCX and computes the rest —
token-identical to the in-process engine, `peer_fetched_tokens` > 0, nothing leaked. The same
with the holder SIGKILLed while the fetch is under way (recomputed, output unchanged), and a
multi-turn chat through the OpenAI client whose second turn pulls the first turn's KV (prompt
and generated tokens) from the decode engine that generated it.

And a prefill engine fetching (decision 0046): a long prompt goes remote, its decode engine
already holds the prefix, so its prefill engine pulls the prefix from that decode engine first
and prefills only the rest — token-identical, `peer_fetched_tokens` > 0, nothing leaked.

The holder is made busy, not absent: `--max-queue-per-engine 1` and a long request running on
it, so the router must send the next prompt elsewhere (the issue's "the holder is busy").
Prompts are decode-local below 300 uncached tokens and remote above (`--path-policy
threshold`: only the prefill-fetch test's prompt is that long) and every fetch is made
(`--peer-fetch always`), so the scenario does not depend on this machine's speed; the cost
choice is covered by tests/unit/scheduler/test_peer_fetch_policy.py.
Cost: one cluster, about 60-90 s on the shared 2-core machine."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_cluster import start_cluster, wait_for_block

from connectors.hashing import DEFAULT_HASH_SEED, BlockHasher
from services.client import AsyncClient, GenerationResult
from services.local_cluster import LocalCluster

pytestmark = pytest.mark.timeout(900)

BLOCK = 16
MAX_TOKENS = 8
BUSY_TOKENS = 400  # the holder's own request runs long enough for the others to be routed
PREFIX_LEN = 12 * BLOCK
THRESHOLD = 300  # uncached tokens: decode-local below, remote from here
SCHEDULER_ARGS = ["--path-policy", "threshold", "--path-threshold-tokens", str(THRESHOLD), "--peer-fetch", "always",
                  "--max-queue-per-engine", "1"]


def _reference(demo_model: Path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    from engine.llm_engine import LLMEngine
    from engine.request import SamplingParams

    with LLMEngine(demo_model, torch_threads=1, dtype="float32") as engine:
        return engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory, "peer-fetch", num_prefill=2, num_decode=2,
                      engine_args=["--kv-cache-memory", "128MiB"], scheduler_args=SCHEDULER_ARGS, metrics=True)
    yield c
    c.stop()


async def _one(target: str, prompt: list[int], max_tokens: int) -> GenerationResult:
    async with AsyncClient(target) as client:
        return await client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=300)


class _Busy:
    """Runs `prompt` with many output tokens in a thread: its decode engine holds the prefix and
    has no room for another request while it runs."""

    def __init__(self, target: str, prompt: list[int]) -> None:
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(target, prompt), daemon=True)
        self._thread.start()

    def _run(self, target: str, prompt: list[int]) -> None:
        try:
            self.result = asyncio.run(_one(target, prompt, BUSY_TOKENS))
        except BaseException as e:  # noqa: BLE001 - reported by join()
            self.error = e

    def join(self) -> GenerationResult | None:
        self._thread.join(300)
        return self.result


def _holder_of(c: LocalCluster, prompt: list[int]) -> str:
    """The decode engine whose KV events report the prompt's last full prefix block."""
    block = BlockHasher(BLOCK, DEFAULT_HASH_SEED).external_hashes(prompt)[PREFIX_LEN // BLOCK - 1]
    found: list[str] = []
    done = threading.Event()

    def watch(name: str) -> None:
        try:
            wait_for_block(c, name, block, timeout=30.0)
            found.append(name)
            done.set()
        except Exception:  # noqa: BLE001 - not this engine (its stream times out, a daemon thread)
            pass

    for n in ("decode-0", "decode-1"):
        threading.Thread(target=watch, args=(n,), daemon=True).start()
    assert done.wait(35), "no decode engine reported the prefix"
    return found[0]


def _prompts(seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(100, 49000) for _ in range(PREFIX_LEN)]
    busy = prefix + [rng.randrange(100, 49000) for _ in range(5)]
    follow = prefix + [rng.randrange(100, 49000) for _ in range(37)]
    return busy, follow


def test_prefix_held_only_by_a_busy_decode_engine_is_pulled_from_it(cluster: LocalCluster, demo_model: Path) -> None:
    busy, follow = _prompts(37)
    [expected] = _reference(demo_model, [follow])
    running = _Busy(cluster.target, busy)
    holder = _holder_of(cluster, busy)
    result = asyncio.run(_one(cluster.target, follow, MAX_TOKENS))
    assert running.join() is not None, running.error
    assert result.token_ids == expected
    assert result.decode_engine_id != holder, (result.decode_engine_id, holder)
    assert result.path_reason == "decode_local:peer_fetch", result.path_reason
    assert result.peer_fetch_engine_id == holder
    assert result.peer_fetched_tokens >= PREFIX_LEN - BLOCK, result
    assert result.prefill_engine_id == "" and result.transferred_tokens == 0
    assert cluster.wait_no_leaks() == {}
    port = cluster.components["scheduler"].metrics_port or 0
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    blocks = [line for line in text.splitlines() if line.startswith("pdserve_kv_peer_fetch_blocks_total{")
              and f'source="{holder}"' in line]
    assert blocks and float(blocks[0].rsplit(" ", 1)[1]) >= (PREFIX_LEN - BLOCK) // BLOCK, blocks
    assert 'pdserve_kv_prompt_tokens_by_tier_total{tier="peer"}' in text


SYSTEM = ("You are a careful assistant for a team that runs a disaggregated inference service. "
          "Answer in short, plain sentences, name the component you mean, and say when you are unsure. ") * 3


def _running_decode_engine(c: LocalCluster, timeout: float = 60.0) -> str:
    """The decode engine with a request running (the busy chat turn)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name in ("decode-0", "decode-1"):
            if c.inspect(name).num_running:
                return name
        time.sleep(0.05)
    raise AssertionError("no decode engine is running the busy request")


def test_multi_turn_chat_reuses_the_previous_turns_kv_from_the_engine_that_generated_it(
        cluster: LocalCluster, demo_model: Path) -> None:
    import openai

    from services.scheduler.tokenization import PromptTokenizer

    client = openai.OpenAI(base_url=cluster.http_url, api_key="unused-without-auth", max_retries=0, timeout=300)
    [card] = client.models.list().data
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What does a decode engine do?"}]
    first = client.chat.completions.create(model=card.id, messages=turn1, max_tokens=24,  # type: ignore[arg-type]
                                           temperature=0, extra_body={"ignore_eos": True})
    answer = first.choices[0].message.content or ""
    # The same turn again, long: its engine (the holder of turn 1's blocks, by prefix) is busy.
    busy = threading.Thread(target=lambda: client.chat.completions.create(
        model=card.id, messages=turn1, max_tokens=BUSY_TOKENS, temperature=0,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True}), daemon=True)
    busy.start()
    holder = _running_decode_engine(cluster)
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "And a prefill engine?"}]
    second = client.chat.completions.create(model=card.id, messages=turn2, max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
                                            temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    busy.join(300)
    tokenizer = PromptTokenizer(demo_model)
    prompt = tokenizer.encode(tokenizer.render_messages(turn2))
    [expected] = _reference(demo_model, [prompt])
    assert (second.choices[0].model_extra or {})["token_ids"] == expected
    usage = second.usage
    assert usage is not None
    fetched = (usage.model_extra or {}).get("peer_fetched_tokens", 0)
    # Turn 1's prompt at least (the system text and the first question) came from the holder.
    assert fetched >= len(tokenizer.encode(tokenizer.render_messages(turn1))) // BLOCK * BLOCK - 2 * BLOCK, usage
    assert holder in ("decode-0", "decode-1")
    assert cluster.wait_no_leaks() == {}


def _peer_fetch_blocks(c: LocalCluster, source: str, target: str) -> float:
    port = c.components["scheduler"].metrics_port or 0
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    lines = [line for line in text.splitlines() if line.startswith("pdserve_kv_peer_fetch_blocks_total{")
             and f'source="{source}"' in line and f'target="{target}"' in line]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def test_a_remote_prompt_is_prefilled_on_a_prefill_engine_that_pulls_the_prefix_first(
        cluster: LocalCluster, demo_model: Path) -> None:
    short, _ = _prompts(43)  # decode-local: its decode engine then holds the prefix
    rng = random.Random(44)
    long = short[:PREFIX_LEN] + [rng.randrange(100, 49000) for _ in range(THRESHOLD + 20)]
    expected_short, expected_long = _reference(demo_model, [short, long])
    first = asyncio.run(_one(cluster.target, short, MAX_TOKENS))
    assert first.token_ids == expected_short and first.prefill_engine_id == ""
    holder = _holder_of(cluster, short)
    result = asyncio.run(_one(cluster.target, long, MAX_TOKENS))
    assert result.token_ids == expected_long
    assert result.path_reason == "remote:peer_fetch", result.path_reason
    assert result.prefill_engine_id.startswith("prefill-") and result.peer_fetch_engine_id == holder, result
    assert result.peer_fetched_tokens == PREFIX_LEN, result
    # The holder decodes (it holds the most of the prompt) and pulls only what follows its prefix.
    assert result.decode_engine_id == holder and result.transferred_tokens == len(long) - PREFIX_LEN, result
    assert _peer_fetch_blocks(cluster, holder, result.prefill_engine_id) >= PREFIX_LEN // BLOCK
    assert cluster.wait_no_leaks() == {}


def test_holder_killed_mid_fetch_recomputes_and_output_is_unchanged(cluster: LocalCluster, demo_model: Path) -> None:
    busy, follow = _prompts(41)
    [expected] = _reference(demo_model, [follow])
    running = _Busy(cluster.target, busy)
    holder = _holder_of(cluster, busy)

    async def follow_and_kill() -> GenerationResult:
        task = asyncio.create_task(_one(cluster.target, follow, MAX_TOKENS))
        await asyncio.sleep(0.05)  # the decision is made; the holder dies before or during the pull
        await asyncio.get_running_loop().run_in_executor(None, cluster.kill, holder)
        return await task

    result = asyncio.run(follow_and_kill())
    running.join()  # the busy request migrates to the surviving decode engine
    assert result.token_ids == expected
    assert result.decode_engine_id != holder
    survivors = [n for n in cluster.engine_names if n != holder and cluster.components[n].alive]
    assert cluster.wait_no_leaks(survivors) == {}
