"""The proxy in front of vLLM's own 1P1D (`bench serve --compare vllm`, system `vllm_pd_nixl`).

It speaks the protocol of the toy proxy vLLM's NixlConnector documentation runs in front of a
prefill and a decode server: for each `/v1/completions` request it first sends the request to
the prefill server with `max_tokens` 1, no streaming and
`kv_transfer_params {"do_remote_decode": true, ...}`, then sends the original request to the
decode server with the `kv_transfer_params` the prefill server returned and streams the decode
server's answer back unchanged. So the benchmark's one HTTP client drives vLLM's 1P1D exactly
as it drives every other system.

Beside that, `GET /proxy_stats` returns each request's prefill leg and the decode leg's first
streamed byte (ms, from the request's arrival), which locate where a slow 1P1D spends its time.

Run: `python -m bench.vllm_pd_proxy --port P --prefill URL --decode URL` (an environment with
starlette, uvicorn and httpx: vLLM's or pdserve's).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import AsyncIterator
from typing import Any

REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's request: one token, not streamed, asking for remote decode."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out.update(max_tokens=1, stream=False, kv_transfer_params=dict(REMOTE_DECODE))
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def make_app(prefill: str, decode: str) -> Any:
    import httpx
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    clients = {"p": httpx.AsyncClient(base_url=prefill, timeout=None, limits=limits),
               "d": httpx.AsyncClient(base_url=decode, timeout=None, limits=limits)}
    stats: list[dict[str, float]] = []

    async def completions(request: Any) -> Any:
        t0 = time.perf_counter()
        body = await request.json()
        first = await clients["p"].post("/v1/completions", json=prefill_body(body))
        first.raise_for_status()
        entry = {"prefill_ms": (time.perf_counter() - t0) * 1e3}
        decode_body = dict(body, kv_transfer_params=first.json().get("kv_transfer_params"))

        async def relay() -> AsyncIterator[bytes]:
            async with clients["d"].stream("POST", "/v1/completions", json=decode_body) as resp:
                async for chunk in resp.aiter_raw():
                    if "decode_first_byte_ms" not in entry:
                        entry["decode_first_byte_ms"] = (time.perf_counter() - t0) * 1e3
                    yield chunk
            entry["done_ms"] = (time.perf_counter() - t0) * 1e3
            stats.append(entry)

        return StreamingResponse(relay(), media_type="text/event-stream")

    async def proxy_stats(request: Any) -> Any:
        return JSONResponse(stats)

    async def health(request: Any) -> Any:
        return JSONResponse({"ok": True})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/proxy_stats", proxy_stats), Route("/health", health)])


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", required=True)
    p.add_argument("--decode", required=True)
    a = p.parse_args()
    uvicorn.run(make_app(a.prefill, a.decode), host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
