"""Python client for the pdserve Generation API (async and sync), over the generated stubs.

    async with AsyncClient("127.0.0.1:50051") as client:
        async for chunk in client.stream("Hello", max_tokens=16):
            print(chunk.text, end="")

    with Client("127.0.0.1:50051") as client:
        result = client.generate("Hello", max_tokens=16)

With scheduler replicas, give every one: `Client("10.0.0.1:50051,10.0.0.2:50051")`. Requests go
to the replicas in turn; a request whose replica is unreachable or dies (UNAVAILABLE) is sent to
the next one, and a stream that had already produced tokens resumes there from them
(`GenerateRequest.output_token_ids`): the caller sees one stream, no token twice, none missing
(token-identical under greedy sampling; a sampled continuation is a valid sample, not the same
one). Each request tries every replica at most `max_attempts_per_replica` times.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.security import ChannelSecurity

RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
RETRY_PAUSE_S = 0.1
FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}


@dataclass(slots=True)
class StreamChunk:
    """One streamed piece of the answer; `index` is the position of token_ids[0]."""

    token_ids: list[int]
    text: str
    index: int


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    transferred_tokens: int = 0
    generated_tokens: int = 0
    # Prompt tokens pulled from another engine's cache (a peer fetch), and that engine.
    peer_fetched_tokens: int = 0
    peer_fetch_engine_id: str = ""
    prefill_engine_id: str = ""
    decode_engine_id: str = ""
    num_migrations: int = 0
    scheduler_overhead_ms: float = 0.0
    # The scheduler's path decision: "decode_local:<why>" or "remote:<why>".
    path_reason: str = ""
    # The path policy's predicted TTFT on the chosen path and on the path not chosen (None:
    # none), and the TTFT the scheduler measured (arrival to first token sent), in ms.
    predicted_ttft_ms: float = 0.0
    alternative_ttft_ms: float | None = None
    scheduler_ttft_ms: float = 0.0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)
    # Times the request went on at another scheduler replica (its replica was unreachable or died).
    num_retries: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id, "num_retries": self.num_retries, "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "usage": {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                      "transferred_tokens": self.transferred_tokens,
                      "peer_fetched_tokens": self.peer_fetched_tokens,
                      "generated_tokens": self.generated_tokens},
            "peer_fetch_engine_id": self.peer_fetch_engine_id,
            "prefill_engine_id": self.prefill_engine_id, "decode_engine_id": self.decode_engine_id,
            "num_migrations": self.num_migrations, "path_reason": self.path_reason,
            "predicted_ttft_ms": self.predicted_ttft_ms, "alternative_ttft_ms": self.alternative_ttft_ms,
            "scheduler_ttft_ms": self.scheduler_ttft_ms,
            "ttft_s": self.ttft_s, "e2e_s": self.e2e_s,
        }


def build_request(prompt: str | Sequence[int], *, request_id: str = "", chat: bool = False,
                  max_tokens: int | None = None, temperature: float | None = None,
                  top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                  stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                  ignore_eos: bool | None = None, ttft_target_ms: float | None = None,
                  itl_target_ms: float | None = None) -> pb.GenerateRequest:
    """Builds a GenerateRequest; unset tunables stay unset (server defaults apply)."""
    sampling = pb.SamplingParams(stop=list(stop), stop_token_ids=list(stop_token_ids))
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
                        ("top_k", top_k), ("seed", seed), ("ignore_eos", ignore_eos),
                        ("ttft_target_ms", ttft_target_ms), ("itl_target_ms", itl_target_ms)):
        if value is not None:
            setattr(sampling, name, value)
    req = pb.GenerateRequest(request_id=request_id or uuid.uuid4().hex, sampling=sampling)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(int(t) for t in prompt)
    if chat:
        req.chat = True
    return req


def split_targets(target: str) -> list[str]:
    """The replicas of a `host:port[,host:port...]` target (ValueError when none)."""
    targets = [t.strip() for t in target.split(",") if t.strip()]
    if not targets:
        raise ValueError("target: give host:port (or a comma list of scheduler replicas)")
    return targets


class _ResultBuilder:
    def __init__(self, request_id: str) -> None:
        self.result = GenerationResult(request_id=request_id)
        self.start = time.perf_counter()

    def resumed(self, request: pb.GenerateRequest) -> pb.GenerateRequest:
        """The request to send again elsewhere: the tokens received so far as already generated."""
        again = pb.GenerateRequest()
        again.CopyFrom(request)
        del again.output_token_ids[:]
        again.output_token_ids.extend(self.result.token_ids)
        return again

    def add(self, resp: pb.GenerateResponse) -> StreamChunk | None:
        r = self.result
        now = time.perf_counter() - self.start
        if resp.WhichOneof("payload") == "chunk":
            c = resp.chunk
            skip = len(r.token_ids) - c.index  # a resumed stream never repeats; guard anyway
            if c.index > len(r.token_ids):
                raise RuntimeError(f"stream skipped tokens: chunk at {c.index}, {len(r.token_ids)} received")
            token_ids = list(c.token_ids)[max(0, skip):]
            if not token_ids and c.token_ids:
                return None
            if r.ttft_s is None and token_ids:
                r.ttft_s = now
            r.token_ids.extend(token_ids)
            r.text += c.text
            r.token_times_s.extend([now] * len(token_ids))
            return StreamChunk(token_ids, c.text, len(r.token_ids) - len(token_ids))
        done = resp.complete
        r.finish_reason = FINISH_REASONS.get(done.finish_reason)
        u = done.usage
        r.prompt_tokens, r.cached_tokens = u.prompt_tokens, u.cached_tokens
        r.transferred_tokens, r.generated_tokens = u.transferred_tokens, u.generated_tokens
        r.peer_fetched_tokens, r.peer_fetch_engine_id = u.peer_fetched_tokens, done.peer_fetch_engine_id
        r.prefill_engine_id, r.decode_engine_id = done.prefill_engine_id, done.decode_engine_id
        r.num_migrations = done.num_migrations
        r.scheduler_overhead_ms = done.scheduler_overhead_ms
        r.path_reason = done.path_reason
        r.predicted_ttft_ms, r.scheduler_ttft_ms = done.predicted_ttft_ms, done.ttft_ms
        r.alternative_ttft_ms = done.alternative_ttft_ms if done.HasField("alternative_ttft_ms") else None
        r.e2e_s = now
        return None


def _channel_settings(credentials: grpc.ChannelCredentials | None, metadata: Sequence[tuple[str, str]],
                      security: ChannelSecurity | None) -> tuple[grpc.ChannelCredentials | None,
                                                                 list[tuple[str, Any]], tuple[tuple[str, str], ...]]:
    """(credentials or None for plaintext, channel options, call metadata) for a client channel."""
    if security is None:
        return credentials, list(CHANNEL_OPTIONS), tuple(metadata)
    return (credentials or security.credentials(), list(security.options(CHANNEL_OPTIONS)),
            tuple(metadata) + tuple(security.metadata()))


class _Attempts:
    """One request's turns over the replicas: which stub next, the time left before the
    deadline, and whether a failed attempt may be retried (RETRYABLE, attempts left)."""

    __slots__ = ("_client", "_deadline", "_left")

    def __init__(self, client: AsyncClient | Client, timeout: float | None) -> None:
        self._client = client
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._left = client.max_attempts_per_replica * len(client._stubs)

    def next(self) -> tuple[pb_grpc.GenerationStub, float | None]:
        c = self._client
        stub = c._stubs[c._next % len(c._stubs)]
        c._next += 1
        return stub, None if self._deadline is None else max(0.001, self._deadline - time.monotonic())

    def retry(self, code: grpc.StatusCode, builder: _ResultBuilder) -> bool:
        self._left -= 1
        if code not in RETRYABLE or self._left <= 0:
            return False
        builder.result.num_retries += 1
        return True


class AsyncClient:
    """asyncio client; one channel, many concurrent streams."""

    def __init__(self, target: str, *, credentials: grpc.ChannelCredentials | None = None,
                 metadata: Sequence[tuple[str, str]] = (), security: ChannelSecurity | None = None) -> None:
        """`security` (CA, client certificate, bearer token) or raw `credentials` and `metadata`."""
        credentials, options, self._metadata = _channel_settings(credentials, metadata, security)
        self._channels = [grpc.aio.insecure_channel(t, options=options) if credentials is None
                          else grpc.aio.secure_channel(t, credentials, options=options) for t in split_targets(target)]
        self._stubs = [pb_grpc.GenerationStub(c) for c in self._channels]
        self._stub = self._stubs[0]
        self._next = 0
        # one target: no retry (its UNAVAILABLE is the cluster's answer, e.g. no healthy engine)
        self.max_attempts_per_replica = 2 if len(self._stubs) > 1 else 1

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def stream_raw(self, request: pb.GenerateRequest,
                         timeout: float | None = None) -> AsyncIterator[pb.GenerateResponse]:
        """One attempt, no retry: the raw responses (the replicas take turns per call)."""
        stub = self._stubs[self._next % len(self._stubs)]
        self._next += 1
        call = stub.Generate(request, timeout=timeout, metadata=self._metadata)
        async for resp in call:
            yield resp

    async def _run(self, request: pb.GenerateRequest, builder: _ResultBuilder,
                   timeout: float | None) -> AsyncIterator[StreamChunk]:
        """The request on the replicas in turn, resumed after a replica's UNAVAILABLE."""
        attempts = _Attempts(self, timeout)
        while True:
            stub, remaining = attempts.next()
            try:
                async for resp in stub.Generate(builder.resumed(request), timeout=remaining, metadata=self._metadata):
                    chunk = builder.add(resp)
                    if chunk is not None:
                        yield chunk
                return
            except grpc.aio.AioRpcError as e:
                if not attempts.retry(e.code(), builder):
                    raise
                await asyncio.sleep(RETRY_PAUSE_S)

    async def stream(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                     **kwargs: Any) -> AsyncIterator[StreamChunk]:
        req = build_request(prompt, **kwargs)
        async for chunk in self._run(req, _ResultBuilder(req.request_id), timeout):
            yield chunk

    async def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                       **kwargs: Any) -> GenerationResult:
        req = build_request(prompt, **kwargs)
        builder = _ResultBuilder(req.request_id)
        async for _ in self._run(req, builder, timeout):
            pass
        return builder.result

    async def server_info(self) -> pb.ServerInfo:
        """The first reachable replica's ServerInfo."""
        for i, stub in enumerate(self._stubs):
            try:
                reply: pb.ServerInfo = await stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=self._metadata)
                return reply
            except grpc.aio.AioRpcError as e:
                if e.code() not in RETRYABLE or i == len(self._stubs) - 1:
                    raise
        raise AssertionError("unreachable")


class Client:
    """Blocking client over a synchronous channel."""

    def __init__(self, target: str, *, credentials: grpc.ChannelCredentials | None = None,
                 metadata: Sequence[tuple[str, str]] = (), security: ChannelSecurity | None = None) -> None:
        """`security` (CA, client certificate, bearer token) or raw `credentials` and `metadata`."""
        credentials, options, self._metadata = _channel_settings(credentials, metadata, security)
        self._channels = [grpc.insecure_channel(t, options=options) if credentials is None
                          else grpc.secure_channel(t, credentials, options=options) for t in split_targets(target)]
        self._stubs = [pb_grpc.GenerationStub(c) for c in self._channels]
        self._stub = self._stubs[0]
        self._next = 0
        # one target: no retry (its UNAVAILABLE is the cluster's answer, e.g. no healthy engine)
        self.max_attempts_per_replica = 2 if len(self._stubs) > 1 else 1

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def _run(self, request: pb.GenerateRequest, builder: _ResultBuilder,
             timeout: float | None) -> Iterator[StreamChunk]:
        """The request on the replicas in turn, resumed after a replica's UNAVAILABLE."""
        attempts = _Attempts(self, timeout)
        while True:
            stub, remaining = attempts.next()
            try:
                for resp in stub.Generate(builder.resumed(request), timeout=remaining, metadata=self._metadata):
                    chunk = builder.add(resp)
                    if chunk is not None:
                        yield chunk
                return
            except grpc.RpcError as e:
                if not attempts.retry(e.code(), builder):  # type: ignore[attr-defined]
                    raise
                time.sleep(RETRY_PAUSE_S)

    def stream(self, prompt: str | Sequence[int], *, timeout: float | None = None,
               **kwargs: Any) -> Iterator[StreamChunk]:
        req = build_request(prompt, **kwargs)
        yield from self._run(req, _ResultBuilder(req.request_id), timeout)

    def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                 on_chunk: Callable[[StreamChunk], None] | None = None, **kwargs: Any) -> GenerationResult:
        """Runs one request to completion; `on_chunk` sees every chunk as it streams."""
        req = build_request(prompt, **kwargs)
        builder = _ResultBuilder(req.request_id)
        for chunk in self._run(req, builder, timeout):
            if on_chunk is not None:
                on_chunk(chunk)
        return builder.result

    def server_info(self) -> pb.ServerInfo:
        """The first reachable replica's ServerInfo."""
        for i, stub in enumerate(self._stubs):
            try:
                reply: pb.ServerInfo = stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=self._metadata)
                return reply
            except grpc.RpcError as e:
                if e.code() not in RETRYABLE or i == len(self._stubs) - 1:  # type: ignore[attr-defined]
                    raise
        raise AssertionError("unreachable")
