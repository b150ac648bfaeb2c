"""Role changes under streaming load, shared by tests/e2e/test_role_change.py (pdserve's engines)
and tests/vllm/test_vllm_serving.py (vLLM's): the scheduler's admin endpoint (`POST
/admin/roles`, docs/decisions/0044) and two clients sending prompts round and round."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from typing import Any

from services.client import AsyncClient, GenerationResult
from services.local_cluster import LocalCluster


def admin(c: LocalCluster, body: dict[str, str] | None = None) -> Any:
    """GET (no body: roles and the change log) or POST (a change) /admin/roles on replica 0."""
    url = c.replica_http_url(c.replicas[0]).removesuffix("/v1") + "/admin/roles"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET",
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def engine_role(c: LocalCluster, engine_id: str) -> dict[str, Any]:
    """The scheduler's entry for the engine: role, role_epoch, epoch."""
    return next(e for e in admin(c)["engines"] if e["engine_id"] == engine_id)


async def set_role(c: LocalCluster, engine_id: str, role: str, timeout: float = 30.0) -> None:
    """Asks for the change and waits until the scheduler routes by it (the engine said so)."""
    await asyncio.to_thread(admin, c, {"engine_id": engine_id, "role": role, "reason": f"test: to {role}"})
    deadline = time.monotonic() + timeout
    while (await asyncio.to_thread(engine_role, c, engine_id))["role"] != role:
        assert time.monotonic() < deadline, f"{engine_id} never reported role {role}"
        await asyncio.sleep(0.2)


async def generate(client: AsyncClient, prompt: list[int], max_tokens: int) -> GenerationResult:
    return await client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=300)


async def stream(target: str, prompts: list[list[int]], max_tokens: int, stop: asyncio.Event,
                 out: list[tuple[int, GenerationResult]]) -> None:
    """Two clients send the prompts round and round until `stop`, then once more around;
    `out` gets (prompt index, result) as each completes."""
    async with AsyncClient(target) as client:
        async def worker(offset: int) -> None:
            i, rounds_after_stop = offset, 0
            while rounds_after_stop < len(prompts) // 2:
                if stop.is_set():
                    rounds_after_stop += 1
                k = i % len(prompts)
                out.append((k, await generate(client, prompts[k], max_tokens)))
                i += 2

        await asyncio.gather(worker(0), worker(1))
