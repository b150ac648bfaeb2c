"""Transport security, client authentication and per-client limits for every gRPC channel.

Transport (see docs/architecture.md, "Security"):
- A component with `tls_cert`, `tls_key` and `tls_ca` configured serves TLS on every port and
  dials every peer with TLS, presenting its certificate (mTLS). The control port and the Engine
  API always require a client certificate that chains to `tls_ca`; the client API and KVEvents
  port require one only with `tls_require_client_cert`.
- Without certificates a component is plaintext. That is allowed implicitly only on loopback
  addresses (`pdserve up`, tests); any other address needs the explicit `allow_plaintext`
  opt-in (`check_plaintext`), and every plaintext listener logs a warning at start.

Client auth (`ServerGuard`, an aio server interceptor): bearer tokens on the services it is
given (Generation, KVEvents), from a token file and/or a comma-separated list (env
`PDSERVE_AUTH_TOKENS`). Missing or unknown token: UNAUTHENTICATED; a token without the
service's scope: PERMISSION_DENIED. Tokens are compared as SHA-256 digests with
`hmac.compare_digest` against every configured token (no early exit). Health and reflection are
never guarded. The same interceptor enforces per-client limits with RESOURCE_EXHAUSTED:
concurrent streams and a token-bucket request rate. A client is its token's name when it sent a
valid one, else its peer IP address.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import inspect
import ipaddress
import logging
import os
import ssl
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.common.grpc_streams import relay

logger = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16
SCOPE_GENERATE = "generate"
SCOPE_EVENTS = "events"
SCOPE_ADMIN = "admin"  # operator endpoints: engine roles (HTTP /admin/...)
SCOPES = (SCOPE_GENERATE, SCOPE_EVENTS, SCOPE_ADMIN)
# What a token that names no scope may do: admin must be named.
DEFAULT_SCOPES = (SCOPE_GENERATE, SCOPE_EVENTS)
GUARDED_SERVICES = {"pdserve.v1.Generation": SCOPE_GENERATE, "pdserve.v1.KVEvents": SCOPE_EVENTS}


# -- plaintext policy -------------------------------------------------------------------------

def is_loopback(host: str) -> bool:
    """True for localhost and loopback IP addresses (the host part of a target or bind address)."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def target_host(target: str) -> str:
    """The host part of `host:port`, `[v6]:port` or a bare host."""
    if target.startswith("["):
        return target[1:target.index("]")] if "]" in target else target
    return target.rsplit(":", 1)[0] if target.count(":") == 1 else target


def check_plaintext(field_name: str, host: str, *, tls: bool, allow_plaintext: bool) -> None:
    """Raises ValueError when `host` would be served or dialed in plaintext off loopback without
    the explicit `allow_plaintext` opt-in."""
    if not tls and not allow_plaintext and not is_loopback(host):
        raise ValueError(f"{field_name}: {host!r} is not a loopback address, so plaintext gRPC needs the explicit "
                         "allow_plaintext opt-in; configure tls_cert, tls_key and tls_ca instead")


def check_tls_files(cert: str, key: str, ca: str) -> None:
    """All three files or none (they are read when a port is bound or a channel opened, so a
    config can be checked where the files are not mounted)."""
    given = {"tls_cert": cert, "tls_key": key, "tls_ca": ca}
    if any(given.values()) and not all(given.values()):
        missing = ", ".join(k for k, v in given.items() if not v)
        raise ValueError(f"{missing}: TLS needs tls_cert, tls_key and tls_ca together")


def read_pem(path: str, what: str) -> bytes:
    """The file's bytes; ValueError naming the setting when it cannot be read."""
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror}") from None


# -- credentials ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ServerSecurity:
    """TLS settings of one listening port (file paths; read when the port is bound)."""

    cert: str
    key: str
    ca: str
    require_client_cert: bool

    def credentials(self) -> grpc.ServerCredentials:
        """Credentials that re-read the files when they change (checked at every new TLS
        handshake), so a rotated certificate (cert-manager renewal, a Secret update) is served
        without a restart; a half-written rotation keeps the previous files in use."""
        stamp = [self._stamp()]

        def fetch() -> Any:
            now = self._stamp()
            if now == stamp[0]:
                return None
            try:
                config = self._configuration()
            except ValueError as e:
                logger.warning("TLS files changed but cannot be loaded (keeping the old ones): %s", e)
                return None
            stamp[0] = now
            logger.info("TLS certificate files changed: serving the new ones")
            return config

        return grpc.dynamic_ssl_server_credentials(self._configuration(), fetch,
                                                   require_client_authentication=self.require_client_cert)

    def ssl_context(self) -> ssl.SSLContext:
        """An `ssl.SSLContext` for a port that is not gRPC's (the HTTP API), with the rotation
        contract of `credentials()`: at every new TLS handshake the files' modification times
        are compared, and a changed set that loads is served from then on (a half-written
        rotation keeps the previous files in use). OpenSSL calls the server-name callback for
        every ClientHello, with or without SNI, so that is where a connection is handed the
        current context. ValueError naming the setting when the files cannot be loaded now."""
        stamp = [self._stamp()]
        current = [self._ssl_context()]

        def pick(conn: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, context: ssl.SSLContext) -> None:
            now = self._stamp()
            if now != stamp[0]:
                try:
                    fresh = self._ssl_context()
                except ValueError as e:
                    logger.warning("TLS files changed but cannot be loaded (keeping the old ones): %s", e)
                else:
                    fresh.sni_callback = pick
                    current[0], stamp[0] = fresh, now
                    logger.info("TLS certificate files changed: serving the new ones")
            if context is not current[0]:
                conn.context = current[0]

        current[0].sni_callback = pick
        return current[0]

    def _ssl_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"tls_cert, tls_key: cannot load {self.cert} with {self.key}: {e}") from None
        if self.ca:
            try:
                context.load_verify_locations(self.ca)
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"tls_ca: cannot load {self.ca}: {e}") from None
        context.verify_mode = ssl.CERT_REQUIRED if self.require_client_cert else ssl.CERT_NONE
        context.set_alpn_protocols(["http/1.1"])
        return context

    def _configuration(self) -> Any:
        ca = read_pem(self.ca, "tls_ca") if self.ca else None
        pair = (read_pem(self.key, "tls_key"), read_pem(self.cert, "tls_cert"))
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=ca)

    def _stamp(self) -> tuple[int, ...] | None:
        try:
            return tuple(os.stat(p).st_mtime_ns for p in (self.cert, self.key, self.ca) if p)
        except OSError:
            return None


@dataclass(frozen=True, slots=True)
class ChannelSecurity:
    """How to dial a pdserve endpoint. Picklable (it travels to engine rank processes).

    `ca` empty means plaintext. `cert`/`key` present a client certificate (mTLS).
    `server_name` overrides the name checked in the server's certificate (default: the host
    dialed). `token` is sent as `authorization: Bearer <token>` metadata by the clients that
    use `metadata()` (client API, KVEvents)."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    server_name: str = ""
    token: str = ""

    @property
    def tls(self) -> bool:
        return bool(self.ca)

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not self.ca:
            return None
        chain = read_pem(self.cert, "tls_cert") if self.cert else None
        key = read_pem(self.key, "tls_key") if self.key else None
        return grpc.ssl_channel_credentials(read_pem(self.ca, "tls_ca"), key, chain)

    def options(self, base: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
        options = list(base)
        if self.tls and self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return options

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def stamp(self) -> tuple[int, ...] | None:
        """Modification times of the files: a long-lived channel compares them to notice a
        rotation (channel credentials are fixed at creation)."""
        try:
            return tuple(os.stat(p).st_mtime_ns for p in (self.ca, self.cert, self.key) if p)
        except OSError:
            return None


def open_channel(target: str, security: ChannelSecurity | None, options: Sequence[tuple[str, Any]],
                 interceptors: Sequence[Any] | None = None) -> grpc.aio.Channel:
    """An aio channel to `target`: TLS when `security` carries a CA, plaintext otherwise."""
    creds = security.credentials() if security is not None else None
    opts = security.options(options) if security is not None else list(options)
    if creds is None:
        return grpc.aio.insecure_channel(target, options=opts, interceptors=interceptors)
    return grpc.aio.secure_channel(target, creds, options=opts, interceptors=interceptors)


def open_sync_channel(target: str, security: ChannelSecurity | None,
                      options: Sequence[tuple[str, Any]]) -> grpc.Channel:
    """The blocking-channel twin of `open_channel`."""
    creds = security.credentials() if security is not None else None
    opts = security.options(options) if security is not None else list(options)
    if creds is None:
        return grpc.insecure_channel(target, options=opts)
    return grpc.secure_channel(target, creds, options=opts)


def component_server_security(config: Any, *, require_client_cert: bool) -> ServerSecurity | None:
    """The listening side of a component config (`tls_cert`, `tls_key`, `tls_ca`); None: plaintext."""
    if not config.tls_cert:
        return None
    return ServerSecurity(config.tls_cert, config.tls_key, config.tls_ca, require_client_cert)


def component_channel_security(config: Any) -> ChannelSecurity | None:
    """The dialing side of a component config: its certificate as client identity (mTLS)."""
    if not config.tls_cert:
        return None
    return ChannelSecurity(ca=config.tls_ca, cert=config.tls_cert, key=config.tls_key,
                           server_name=config.tls_server_name)


# -- bearer tokens ----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ApiToken:
    """A configured token: `name` (source and line, safe to log), SHA-256 of the secret, scopes."""

    name: str
    digest: bytes
    scopes: frozenset[str]


def _token(name: str, secret: str, scopes: Iterable[str]) -> ApiToken:
    if len(secret) < MIN_TOKEN_CHARS:
        raise ValueError(f"{name}: tokens must be at least {MIN_TOKEN_CHARS} characters")
    scope_set = frozenset(scopes) or frozenset(DEFAULT_SCOPES)
    unknown = scope_set - set(SCOPES)
    if unknown:
        raise ValueError(f"{name}: unknown scope(s) {sorted(unknown)}; known: {', '.join(SCOPES)}")
    return ApiToken(name, hashlib.sha256(secret.encode()).digest(), scope_set)


def token_entries(text: str, source: str = "auth_tokens_file") -> list[tuple[str, str, list[str]]]:
    """(name, secret, scopes) of each token line: one token per line, optionally followed by
    comma-separated scopes (`generate`, `events`, `admin`; none means generate and events). Blank lines and lines
    starting with # are skipped."""
    entries = []
    for lineno, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts or parts[0].startswith("#"):
            continue
        if len(parts) > 2:
            raise ValueError(f"{source}:{lineno}: expected `<token> [scope,scope]`")
        scopes = [s for s in parts[1].split(",") if s] if len(parts) == 2 else []
        entries.append((f"{source}:{lineno}", parts[0], scopes))
    return entries


def configured_token_entries(tokens_file: str, inline: str) -> list[tuple[str, str, list[str]]]:
    """(name, secret, scopes) of the tokens in `auth_tokens_file` and the comma-separated
    `auth_tokens` (those have the default scopes: generate and events), in that order."""
    entries = []
    if tokens_file:
        try:
            text = Path(tokens_file).read_text()
        except OSError as e:
            raise ValueError(f"auth_tokens_file: cannot read {tokens_file}: {e.strerror}") from None
        entries += token_entries(text, tokens_file)
    for i, secret in enumerate(s.strip() for s in inline.split(",")):
        if secret:
            entries.append((f"auth_tokens[{i}]", secret, []))
    return entries


def parse_token_file(text: str, source: str = "auth_tokens_file") -> list[ApiToken]:
    """The tokens of a tokens file (grammar: `token_entries`)."""
    return [_token(name, secret, scopes) for name, secret, scopes in token_entries(text, source)]


class TokenStore:
    """The configured tokens; `check` is constant-time in the presented token's content."""

    def __init__(self, tokens: Iterable[ApiToken]) -> None:
        self.tokens = list(tokens)
        if not self.tokens:
            raise ValueError("a TokenStore needs at least one token")

    @staticmethod
    def from_config(tokens_file: str, inline: str) -> TokenStore | None:
        """Tokens from `auth_tokens_file` and the comma-separated `auth_tokens`; None when neither
        is set (no client auth)."""
        tokens = [_token(name, secret, scopes) for name, secret, scopes in configured_token_entries(tokens_file, inline)]
        if (tokens_file or inline) and not tokens:
            raise ValueError("auth_tokens_file / auth_tokens: no tokens found")
        return TokenStore(tokens) if tokens else None

    def check(self, presented: str) -> ApiToken | None:
        digest = hashlib.sha256(presented.encode()).digest()
        found = None
        for token in self.tokens:
            if hmac.compare_digest(token.digest, digest):
                found = token
        return found


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an `authorization: Bearer <token>` header, or None."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            scheme, _, token = text.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


# -- per-client limits ------------------------------------------------------------------------

class RateLimiter:
    """Token bucket per client: `rate` requests per second, bursts of `burst`. Pure (injected
    clock). At most `max_clients` buckets are kept (memory bound): beyond it the fullest tenth
    is forgotten, so at worst a nearly refilled client gets its full burst back a little early."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic,
                 max_clients: int = 100_000) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"rate must be > 0 and burst >= 1, got {rate} and {burst}")
        self.rate, self.burst, self.clock, self.max_clients = rate, burst, clock, max_clients
        self._buckets: dict[str, tuple[float, float]] = {}

    def allow(self, client: str) -> bool:
        now = self.clock()
        level, last = self._buckets.get(client, (float(self.burst), now))
        level = min(float(self.burst), level + (now - last) * self.rate)
        ok = level >= 1.0
        self._buckets[client] = (level - 1.0 if ok else level, now)
        if len(self._buckets) > self.max_clients:
            self._forget(now)
        return ok

    def _forget(self, now: float) -> None:
        def refilled(item: tuple[str, tuple[float, float]]) -> float:
            level, last = item[1]
            return level + (now - last) * self.rate

        for client, _ in sorted(self._buckets.items(), key=refilled, reverse=True)[:len(self._buckets) // 10 + 1]:
            del self._buckets[client]

    def __len__(self) -> int:
        return len(self._buckets)


class StreamCounter:
    """Concurrent streams per client with one bound (0: unbounded)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: Counter[str] = Counter()

    def acquire(self, client: str) -> bool:
        if self.limit and self._open[client] >= self.limit:
            return False
        self._open[client] += 1
        return True

    def release(self, client: str) -> None:
        self._open[client] -= 1
        if self._open[client] <= 0:
            del self._open[client]

    def open(self, client: str) -> int:
        return self._open[client]

    def total(self) -> int:
        return sum(self._open.values())


# -- the interceptor --------------------------------------------------------------------------

def peer_address(peer: str) -> str:
    """The address part of a gRPC peer string (`ipv4:1.2.3.4:5`, `ipv6:[::1]:5`, `unix:/p`)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest[1:rest.index("]")] if rest.startswith("[") and "]" in rest else rest
    return peer


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a client call is refused: the gRPC status, a metric reason and the message."""

    code: grpc.StatusCode
    reason: str
    message: str


class ServerGuard(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Bearer-token auth and per-client limits for the services in `scopes` (service name →
    required scope); every other service (health, reflection) passes untouched."""

    def __init__(self, *, tokens: TokenStore | None, scopes: Mapping[str, str] | None = None,
                 max_streams_per_client: int = 0, rate_limiter: RateLimiter | None = None,
                 metrics: Any = None) -> None:
        self.tokens = tokens
        self.scopes = dict(GUARDED_SERVICES if scopes is None else scopes)
        self.streams = StreamCounter(max_streams_per_client)
        self.rate_limiter = rate_limiter
        self.refused: Counter[str] = Counter()
        # Optional: count_client_refused(reason) and set_client_streams(n) (SchedulerMetrics).
        self.metrics = metrics

    async def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = await continuation(details)
        service = details.method.lstrip("/").split("/", 1)[0]
        scope = self.scopes.get(service)
        if handler is None or scope is None:
            return handler
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._wrap_unary(handler.unary_unary, scope))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=self._wrap_unary(handler.stream_unary, scope))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._wrap_stream(handler.unary_stream, scope))
        return handler._replace(stream_stream=self._wrap_stream(handler.stream_stream, scope))

    def admit(self, presented: str | None, peer: str, scope: str) -> tuple[str, Refusal | None]:
        """Transport-free check of one call (the gRPC interceptor and the HTTP API share it):
        `presented` bearer token (None: none sent), `peer` address, required `scope`. Returns
        the client key (token name, else peer) and the refusal (counted) or None."""
        client = peer
        if self.tokens is not None:
            if presented is None:
                return client, self._refused(Refusal(grpc.StatusCode.UNAUTHENTICATED, "missing_token",
                                                     "missing bearer token (send `authorization: Bearer <token>`)"))
            token = self.tokens.check(presented)
            if token is None:
                return client, self._refused(Refusal(grpc.StatusCode.UNAUTHENTICATED, "bad_token",
                                                     "invalid bearer token"))
            if scope not in token.scopes:
                return client, self._refused(Refusal(grpc.StatusCode.PERMISSION_DENIED, "scope",
                                                     f"this token lacks the {scope!r} scope"))
            client = token.name
        if self.rate_limiter is not None and not self.rate_limiter.allow(client):
            return client, self._refused(Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "rate",
                                                 f"rate limit of {self.rate_limiter.rate:g} requests/s exceeded; "
                                                 "retry later"))
        return client, None

    def open_stream(self, client: str) -> Refusal | None:
        """Counts a stream of `client` against the limit; the refusal (counted) when over it.
        Every stream opened is closed with `close_stream`."""
        if not self.streams.acquire(client):
            return self._refused(Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "streams",
                                         f"too many concurrent streams from this client (limit {self.streams.limit})"))
        self._streams_changed()
        return None

    def close_stream(self, client: str) -> None:
        self.streams.release(client)
        self._streams_changed()

    def _refused(self, refusal: Refusal) -> Refusal:
        self.refused[refusal.reason] += 1
        if self.metrics is not None:
            self.metrics.count_client_refused(refusal.reason)
        return refusal

    async def _refuse(self, context: grpc.aio.ServicerContext, refusal: Refusal) -> None:
        logger.info("refused %s from %s: %s", refusal.reason, context.peer(), refusal.message)
        await context.abort(refusal.code, refusal.message)

    async def _admit(self, context: grpc.aio.ServicerContext, scope: str) -> str:
        """Checks the token and the rate; returns the client key (aborts the call otherwise)."""
        presented = bearer_token(context.invocation_metadata()) if self.tokens is not None else None
        client, refusal = self.admit(presented, peer_address(context.peer()), scope)
        if refusal is not None:
            await self._refuse(context, refusal)
        return client

    def _wrap_unary(self, behavior: Callable[..., Any], scope: str) -> Callable[..., Any]:
        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._admit(context, scope)
            return await behavior(request, context)

        return guarded

    def _wrap_stream(self, behavior: Callable[..., Any], scope: str) -> Callable[..., Any]:
        async def open_stream(context: grpc.aio.ServicerContext) -> str:
            client = await self._admit(context, scope)
            refusal = self.open_stream(client)
            if refusal is not None:
                await self._refuse(context, refusal)
            return client

        close_stream = self.close_stream

        if inspect.isasyncgenfunction(behavior):
            async def guarded_gen(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                client = await open_stream(context)
                try:
                    async with contextlib.aclosing(behavior(request, context)) as responses:
                        async for item in responses:
                            yield item
                finally:
                    close_stream(client)

            return guarded_gen

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            client = await open_stream(context)
            try:
                result = behavior(request, context)
                return await result if inspect.isawaitable(result) else result
            finally:
                close_stream(client)

        return guarded

    def _streams_changed(self) -> None:
        if self.metrics is not None:
            self.metrics.set_client_streams(self.streams.total())


@dataclass(frozen=True, slots=True)
class _Malformed:
    error: str


class MalformedRequestGuard(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Answers a request whose bytes do not parse as its message type with INVALID_ARGUMENT and
    a reason (grpc's aio server would report an unexpected exception: UNKNOWN); the servicer
    never sees it. On a request stream the call ends at the first malformed message."""

    def __init__(self) -> None:
        self.num_malformed = 0

    async def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer

        def safe_parse(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as e:  # noqa: BLE001 - any decoder failure is the client's malformed input
                return _Malformed(f"{type(e).__name__}: {e}")

        handler = handler._replace(request_deserializer=safe_parse)
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._unary(handler.unary_unary, details.method))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._unary(handler.unary_stream, details.method))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=self._streaming(handler.stream_unary, details.method))
        return handler._replace(stream_stream=self._streaming(handler.stream_stream, details.method))

    async def _refuse(self, context: grpc.aio.ServicerContext, method: str, bad: _Malformed) -> None:
        self.num_malformed += 1
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request for {method}: {bad.error}")

    def _unary(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):
            async def checked_gen(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(request, _Malformed):
                    await self._refuse(context, method, request)
                async for item in relay(context, behavior(request, context)):
                    yield item

            return checked_gen

        async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await self._refuse(context, method, request)
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result

        return checked

    def _streaming(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        def requests(iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async def gen() -> AsyncIterator[Any]:
                async for request in iterator:
                    if isinstance(request, _Malformed):
                        await self._refuse(context, method, request)
                    yield request

            return gen()

        if inspect.isasyncgenfunction(behavior):
            async def checked_gen(iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async for item in relay(context, behavior(requests(iterator, context), context)):
                    yield item

            return checked_gen

        async def checked(iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            result = behavior(requests(iterator, context), context)
            return await result if inspect.isawaitable(result) else result

        return checked


def certificate_names(context: grpc.aio.ServicerContext) -> set[str]:
    """The common name and DNS names of the peer's verified certificate (empty without one)."""
    auth = context.auth_context() or {}
    names = set()
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        names |= {v.decode(errors="replace") if isinstance(v, bytes) else str(v) for v in auth.get(key, [])}
    return names


class PeerNameGuard(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """On the internal ports (control streams, Engine API): only peers whose verified certificate
    names `peer_name` (CN or DNS SAN) reach `services`; others get PERMISSION_DENIED. Keeps a
    client certificate of the same CA (given to API users) from registering as an engine."""

    def __init__(self, peer_name: str, services: Iterable[str]) -> None:
        self.peer_name = peer_name
        self.services = set(services)
        self.refused = 0

    async def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.lstrip("/").split("/", 1)[0] not in self.services:
            return handler

        async def check(context: grpc.aio.ServicerContext) -> None:
            if self.peer_name not in certificate_names(context):
                self.refused += 1
                logger.warning("refused %s: its certificate does not name %r", context.peer(), self.peer_name)
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"this port serves pdserve components only (certificate must name {self.peer_name!r})")

        return before_behavior(handler, check)


def before_behavior(handler: Any, check: Callable[[grpc.aio.ServicerContext], Any]) -> Any:
    """`handler` with `await check(context)` run before its behavior (which ever kind it is)."""
    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        behavior = getattr(handler, kind)
        if behavior is None:
            continue
        if inspect.isasyncgenfunction(behavior):
            async def checked_gen(request: Any, context: grpc.aio.ServicerContext,
                                  behavior: Any = behavior) -> AsyncIterator[Any]:
                await check(context)
                async for item in behavior(request, context):
                    yield item

            return handler._replace(**{kind: checked_gen})

        async def checked(request: Any, context: grpc.aio.ServicerContext, behavior: Any = behavior) -> Any:
            await check(context)
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result

        return handler._replace(**{kind: checked})
    return handler


def peer_name_guards(config: Any, services: Iterable[str]) -> list[PeerNameGuard]:
    """[PeerNameGuard] when the config has TLS and a `tls_peer_name`, else []."""
    if config.tls_cert and config.tls_peer_name:
        return [PeerNameGuard(config.tls_peer_name, services)]
    return []


def server_guard(config: Any, metrics: Any = None) -> ServerGuard:
    """The scheduler's guard from its config (auth tokens, stream and rate limits); `metrics` as
    in ServerGuard."""
    tokens = TokenStore.from_config(config.auth_tokens_file, config.auth_tokens)
    limiter = RateLimiter(config.rate_limit_rps, config.rate_limit_burst) if config.rate_limit_rps > 0 else None
    if tokens is None:
        logger.warning("client API and KV events are UNAUTHENTICATED: no auth_tokens_file / auth_tokens configured")
    return ServerGuard(tokens=tokens, max_streams_per_client=config.max_streams_per_client, rate_limiter=limiter,
                       metrics=metrics)


# -- command-line clients (pdserve generate / events) -----------------------------------------

def add_client_security_arguments(parser: Any) -> None:
    """TLS and token flags of the command-line clients."""
    parser.add_argument("--tls-ca", default="", help="CA bundle to verify the scheduler with (turns TLS on)")
    parser.add_argument("--tls-cert", default="", help="client certificate, when the server requires one")
    parser.add_argument("--tls-key", default="", help="private key of --tls-cert")
    parser.add_argument("--tls-server-name", default="", help="name expected in the server's certificate")
    parser.add_argument("--token-file", default="", help="file holding the bearer token (first line)")


def client_security_from_args(args: Any) -> ChannelSecurity | None:
    """ChannelSecurity from the flags of `add_client_security_arguments`; None when plaintext
    without a token."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    if (args.tls_cert or args.tls_server_name) and not args.tls_ca:
        raise ValueError("--tls-cert / --tls-server-name need --tls-ca")
    token = ""
    if args.token_file:
        lines = Path(args.token_file).read_text().split()
        if not lines:
            raise ValueError(f"--token-file {args.token_file} is empty")
        token = lines[0]
    if not (args.tls_ca or token):
        return None
    return ChannelSecurity(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key, server_name=args.tls_server_name,
                           token=token)
