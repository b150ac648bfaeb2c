"""`HttpApi`: the scheduler's OpenAI-compatible HTTP API (Starlette on uvicorn, in the
scheduler's own asyncio loop).

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (bearer token with the
`generate` scope when tokens are configured), GET /health (200 while serving, 503 before start
and while draining; never guarded: probes; the liveness probe), GET /ready (as /health, and 503
while a restarted replica's prefix index converges: the readiness probe), GET /metrics (the scheduler's registry, as on its
metrics port; never guarded, like that port).

Contracts:
- Every generation runs `GenerationServicer.generate`, the lifecycle behind the gRPC Generate
  RPC (validation, routing, admission, one deadline, migration, cancellation): nothing is a
  gRPC call to itself. Body parsing is services/scheduler/openai_protocol.py.
- A refusal before the first token is an HTTP status with OpenAI's error JSON (400 bad input
  with the gRPC API's message, 401 / 403 token, 404 model, 429 limits, 503 no engine or
  draining, 504 deadline). The status line of a stream waits for its first token, so every
  refusal of admission is a status; a failure after it is an in-band `data: {"error": ...}`
  event (OpenAI's clients raise it) followed by `data: [DONE]`.
- A client that disconnects (before or during the answer) cancels its request at once: both
  engine legs are aborted and the prefill blocks released, as for a cancelled gRPC stream.
- Auth, per-client rate and stream limits are the gRPC client API's (`ServerGuard.admit` /
  `open_stream`): one budget per client across both APIs. TLS uses the client API's
  certificate files and, like the gRPC ports, serves rotated files from the next handshake
  (`ServerSecurity.ssl_context`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any

import grpc
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pdserve.v1 import generation_pb2 as gen_pb
from services.common.security import SCOPE_ADMIN, SCOPE_GENERATE, ServerGuard, ServerSecurity, bearer_token
from services.scheduler.generation import GenerationServicer
from services.scheduler.openai_protocol import (
    SSE_DONE,
    ApiRequest,
    ResponseWriter,
    error_json,
    parse_chat,
    parse_completion,
    sse,
)
from services.scheduler.roles import RoleAdmin
from services.scheduler.validation import RequestError, invalid

logger = logging.getLogger(__name__)

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
JSON_HEADERS = [(b"content-type", b"application/json")]
REQUEST_ID_HEADER = "x-request-id"


def error_response(code: grpc.StatusCode, message: str) -> JSONResponse:
    status, body = error_json(code, message)
    return JSONResponse(body, status_code=status)


Responses = AsyncGenerator[tuple[int, gen_pb.GenerateResponse], None]


async def merged_responses(generate: Callable[[gen_pb.GenerateRequest], AsyncGenerator[gen_pb.GenerateResponse, None]],
                           requests: list[gen_pb.GenerateRequest]) -> Responses:
    """(prompt index, response) of every request as they arrive; the first RequestError of any
    ends them all. Closing the iterator (or cancelling its consumer) cancels every request."""
    if len(requests) == 1:
        async with contextlib.aclosing(generate(requests[0])) as responses:
            async for response in responses:
                yield 0, response
        return
    queue: asyncio.Queue[tuple[int, gen_pb.GenerateResponse | None, RequestError | None]] = asyncio.Queue()

    async def pump(index: int, request: gen_pb.GenerateRequest) -> None:
        try:
            async with contextlib.aclosing(generate(request)) as responses:
                async for response in responses:
                    queue.put_nowait((index, response, None))
        except RequestError as e:
            queue.put_nowait((index, None, e))
            return
        queue.put_nowait((index, None, None))

    tasks = [asyncio.get_running_loop().create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        running = len(tasks)
        while running:
            index, response, error = await queue.get()
            if error is not None:
                raise error
            if response is None:
                running -= 1
            else:
                yield index, response
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class GenerationAnswer(Response):
    """The ASGI answer of one generation call: streams SSE or sends the whole JSON, watching
    for the client's disconnect the whole time (which cancels the request)."""

    def __init__(self, api: ApiRequest, writer: ResponseWriter,
                 responses: Responses,
                 on_done: Callable[[int], None]) -> None:
        self.api, self.writer, self.responses, self.on_done = api, writer, responses, on_done
        self.status_code = 0
        self.background = None
        self._finishing = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            if not self._finishing:
                gone = True
                task.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            async with contextlib.aclosing(self.responses):
                await (self._stream(send) if self.api.stream else self._whole(send))
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()
            self.status_code = 499  # nginx's "client closed request": counted, never sent
        finally:
            watcher.cancel()
            self.on_done(self.status_code)

    async def _start(self, send: Send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status_code = status
        await send({"type": "http.response.start", "status": status, "headers": headers})

    async def _finish(self, send: Send, body: bytes) -> None:
        self._finishing = True
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _error(self, send: Send, e: RequestError) -> None:
        status, body = error_json(e.code, e.message)
        await self._start(send, status, JSON_HEADERS)
        await self._finish(send, json.dumps(body).encode())

    async def _whole(self, send: Send) -> None:
        try:
            async for index, response in self.responses:
                self.writer.add(index, response)
        except RequestError as e:
            await self._error(send, e)
            return
        await self._start(send, 200, JSON_HEADERS)
        await self._finish(send, json.dumps(self.writer.whole(), separators=(",", ":")).encode())

    async def _stream(self, send: Send) -> None:
        try:
            index, response = await anext(self.responses)
        except RequestError as e:
            await self._error(send, e)
            return
        await self._start(send, 200, SSE_HEADERS)
        tail = SSE_DONE
        try:
            while True:
                self.writer.add(index, response)
                await send({"type": "http.response.body", "body": self.writer.chunk(index, response),
                            "more_body": True})
                try:
                    index, response = await anext(self.responses)
                except StopAsyncIteration:
                    break
            if self.api.include_usage:
                tail = self.writer.usage_chunk() + SSE_DONE
        except RequestError as e:
            tail = sse(error_json(e.code, e.message)[1]) + SSE_DONE
        await self._finish(send, tail)


class HttpApi:
    """See the module docstring. `start` binds (port 0 picks one) and serves; `stop` ends it."""

    def __init__(self, generation: GenerationServicer, guard: ServerGuard,
                 prometheus: CollectorRegistry | None = None) -> None:
        self.generation = generation
        self.guard = guard
        self.metrics = generation.metrics
        self.prometheus = prometheus
        self.serving = False
        # Whether the replica's prefix index has converged (set by the scheduler service).
        self.ready: Callable[[], bool] = lambda: True
        self.port = 0
        # Engine roles by hand (services/scheduler/roles.py); None: no admin endpoint.
        self.roles: RoleAdmin | None = None
        self.app = Starlette(routes=[
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/ready", self._ready, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
            Route("/admin/roles", self._roles, methods=["GET", "POST"]),
        ], exception_handlers={HTTPException: self._http_error})
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    # -- routes -------------------------------------------------------------------------------

    async def _completions(self, request: Request) -> Response:
        return await self._generation(request, "/v1/completions", lambda body, rid: parse_completion(body, rid))

    async def _chat(self, request: Request) -> Response:
        return await self._generation(request, "/v1/chat/completions", self._parse_chat)

    def _parse_chat(self, body: Any, request_id: str) -> ApiRequest:
        tokenizer = self.generation.tokenizer
        if tokenizer is None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               "this scheduler has no tokenizer; use /v1/completions with token ids")
        return parse_chat(body, request_id, tokenizer.render_messages)

    async def _generation(self, request: Request, endpoint: str,
                          parse: Callable[[Any, str], ApiRequest]) -> Response:
        client, refused = self._authorize(request)
        if refused is not None:
            return self._counted(endpoint, refused)
        refusal = self.guard.open_stream(client)
        if refusal is not None:
            return self._counted(endpoint, error_response(refusal.code, refusal.message))
        try:
            request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
            api = parse(await self._json(request), request_id)
        except RequestError as e:
            self.guard.close_stream(client)
            self.metrics.request_rejected()
            return self._counted(endpoint, error_response(e.code, e.message))

        def done(status: int) -> None:
            self.guard.close_stream(client)
            self.metrics.count_http_request(endpoint, status)

        writer = ResponseWriter(api, request_id, self.generation.facts.name)
        responses = merged_responses(lambda r: self.generation.generate(r, None), api.requests)
        return GenerationAnswer(api, writer, responses, done)

    async def _models(self, request: Request) -> Response:
        _, refused = self._authorize(request)
        if refused is not None:
            return self._counted("/v1/models", refused)
        facts = self.generation.facts
        card = {"id": facts.name, "object": "model", "created": 0, "owned_by": "pdserve",
                "max_model_len": facts.max_model_len}
        return self._counted("/v1/models", JSONResponse({"object": "list", "data": [card]}))

    async def _health(self, request: Request) -> Response:
        if self.serving and not self.generation.draining:
            return self._counted("/health", JSONResponse({"status": "ok"}))
        return self._counted("/health", error_response(grpc.StatusCode.UNAVAILABLE, "the scheduler is not serving"))

    async def _ready(self, request: Request) -> Response:
        if not (self.serving and not self.generation.draining):
            return self._counted("/ready", error_response(grpc.StatusCode.UNAVAILABLE, "the scheduler is not serving"))
        if not self.ready():
            return self._counted("/ready", error_response(grpc.StatusCode.UNAVAILABLE,
                                                          "the prefix index is converging (replica restarted)"))
        return self._counted("/ready", JSONResponse({"status": "ok"}))

    async def _metrics(self, request: Request) -> Response:
        if self.prometheus is None:
            return self._counted("/metrics", error_response(grpc.StatusCode.NOT_FOUND, "no metrics registry"))
        data = await asyncio.to_thread(generate_latest, self.prometheus)
        return self._counted("/metrics", Response(data, media_type=CONTENT_TYPE_LATEST))

    async def _roles(self, request: Request) -> Response:
        """GET: every engine's role and the changes made; POST {"engine_id", "role", "reason"}:
        asks that engine to serve the role (202 with the role generation asked for). Needs a
        token with the admin scope when tokens are configured."""
        _, refused = self._authorize(request, SCOPE_ADMIN)
        if refused is not None:
            return self._counted("/admin/roles", refused)
        if self.roles is None:
            return self._counted("/admin/roles", error_response(grpc.StatusCode.UNIMPLEMENTED, "no role admin"))
        if request.method == "GET":
            return self._counted("/admin/roles", JSONResponse({"engines": self.roles.engines(),
                                                               "changes": self.roles.changes()}))
        try:
            body = await self._json(request)
            if not isinstance(body, dict) or not isinstance(body.get("engine_id"), str) \
                    or not isinstance(body.get("role"), str):
                raise invalid("body must be {\"engine_id\": str, \"role\": prefill|decode|mixed, \"reason\": str}")
            reason = str(body.get("reason") or "set by an operator")
            role_epoch = self.roles.set_role(body["engine_id"], body["role"], reason)
        except RequestError as e:
            return self._counted("/admin/roles", error_response(e.code, e.message))
        except KeyError:
            return self._counted("/admin/roles", error_response(grpc.StatusCode.NOT_FOUND,
                                                                f"no engine {body['engine_id']!r}"))
        except ValueError as e:
            return self._counted("/admin/roles", error_response(grpc.StatusCode.FAILED_PRECONDITION, str(e)))
        return self._counted("/admin/roles", JSONResponse({"engine_id": body["engine_id"], "role": body["role"],
                                                           "role_epoch": role_epoch}, status_code=202))

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        """Starlette's own refusals (a wrong method) in OpenAI's error JSON."""
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        body = {"error": {"message": f"{request.method} {request.url.path}: {exc}", "type": "invalid_request_error",
                          "param": None, "code": str(status)}}
        return self._counted(request.url.path, JSONResponse(body, status_code=status))

    # -- helpers ------------------------------------------------------------------------------

    def _authorize(self, request: Request, scope: str = SCOPE_GENERATE) -> tuple[str, Response | None]:
        presented = bearer_token(request.headers.items()) if self.guard.tokens is not None else None
        peer = request.client.host if request.client is not None else "unknown"
        client, refusal = self.guard.admit(presented, peer, scope)
        if refusal is None:
            return client, None
        logger.info("refused %s from %s over HTTP: %s", refusal.reason, peer, refusal.message)
        response = error_response(refusal.code, refusal.message)
        if refusal.code == grpc.StatusCode.UNAUTHENTICATED:
            response.headers["www-authenticate"] = "Bearer"
        return client, response

    @staticmethod
    async def _json(request: Request) -> Any:
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise invalid(f"the request body is not valid JSON: {e}") from None

    def _counted(self, endpoint: str, response: Response) -> Response:
        self.metrics.count_http_request(endpoint, response.status_code)
        return response

    # -- serving ------------------------------------------------------------------------------

    async def start(self, host: str, port: int, security: ServerSecurity | None = None) -> int:
        """Binds `host:port` (0 picks a free port), serves, returns the bound port."""
        config = uvicorn.Config(self._guarded_app, host=host, port=port, log_level="warning", access_log=False,
                                lifespan="off", server_header=False, interface="asgi3",
                                # The peer address is the client key of the rate limits: never
                                # taken from X-Forwarded-For.
                                proxy_headers=False)
        config.load()
        if security is not None:
            # Our context, not uvicorn's: it serves rotated certificate files without a restart.
            config.ssl = security.ssl_context()
        server = _Server(config)
        self._server = server
        # uvicorn binds itself: asyncio sets TCP_NODELAY only on sockets it created for TCP (a
        # socket handed in with proto 0 would get Nagle's algorithm and 40 ms delayed-ACK stalls).
        self._task = asyncio.get_running_loop().create_task(self._serve(server))
        while not server.started:
            if self._task.done():
                task, self._task, self._server = self._task, None, None
                task.result()  # raises the failure
                raise RuntimeError(f"the HTTP API could not start on {host}:{port}")
            await asyncio.sleep(0.01)
        self.port = int(server.servers[0].sockets[0].getsockname()[1])
        self.serving = True
        logger.info("HTTP API serving on %s://%s:%d/v1", "https" if security else "http", host, self.port)
        return self.port

    @staticmethod
    async def _serve(server: uvicorn.Server) -> None:
        try:
            await server.serve()
        except SystemExit:  # uvicorn exits the process when it cannot bind; the caller decides
            raise RuntimeError("the HTTP API could not bind its port (see the log)") from None

    async def _guarded_app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Unknown paths and methods are counted under `other` (bounded label values)."""
        if scope["type"] == "http" and scope["path"] not in _ROUTES:
            await self._counted("other", error_response(grpc.StatusCode.NOT_FOUND, f"no route {scope['path']}"))(
                scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def stop(self, grace: float = 1.0) -> None:
        """Stops accepting, gives open connections `grace` seconds, then ends them."""
        self.serving = False
        if self._server is None or self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = max(1, round(grace))
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._server = self._task = None


_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ready", "/metrics", "/admin/roles"}


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the scheduler's drain handler owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield



