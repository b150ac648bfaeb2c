"""gRPC plumbing shared by every service: an aio server with the standard health service,
reflection, message-size limits and SIGTERM drain; channel options for clients."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.bound_ports import PortInUse
from services.common.security import MalformedRequestGuard, ServerSecurity

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
]


class ServiceServer:
    """One aio gRPC server on one port, with health and reflection.

    Health reports NOT_SERVING for every registered service until `set_serving(True)`; the
    overall status ("") follows the same switch, so Kubernetes' grpc probe sees readiness.
    """

    def __init__(self, service_names: Iterable[str], *, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
                 options: Iterable[tuple[str, int]] = ()) -> None:
        """`options`: more channel arguments (e.g. the Control server's keepalive pings)."""
        extra = dict(options)
        base = [o for o in SERVER_OPTIONS if "message_length" not in o[0] and o[0] not in extra]
        options = [*base, ("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes), *extra.items()]
        # Malformed request bytes: INVALID_ARGUMENT with the reason (see MalformedRequestGuard).
        self.malformed = MalformedRequestGuard()
        self.server = grpc.aio.server(options=options, interceptors=[self.malformed, *interceptors])
        self.service_names = list(service_names)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self.port: int | None = None
        self.health_server: grpc.aio.Server | None = None

    def bind(self, host: str, port: int, security: ServerSecurity | None = None, setting: str = "port") -> int:
        """Binds host:port (0 picks a free port) with TLS when `security` is given, plaintext
        otherwise (logged as a warning: see services/common/security.py), and returns the port;
        `PortInUse` naming `setting` when it cannot."""
        try:  # grpcio raises RuntimeError where it cannot bind (older releases returned 0)
            if security is None:
                bound = self.server.add_insecure_port(f"{host}:{port}")
            else:
                bound = self.server.add_secure_port(f"{host}:{port}", security.credentials())
        except RuntimeError as e:
            raise PortInUse(setting, host, port) from e
        if bound == 0:
            raise PortInUse(setting, host, port)
        if security is None:
            logger.warning("PLAINTEXT gRPC (no TLS, no peer verification) for %s on %s:%d",
                           ", ".join(self.service_names) or "health", host, bound)
        self.port = bound
        return bound

    def bind_health(self, host: str, port: int) -> int:
        """A second, plaintext listener that serves only this server's health service (for
        Kubernetes gRPC probes, which cannot speak TLS); returns the bound port."""
        self.health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
        try:
            bound = self.health_server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as e:
            raise PortInUse("health_port", host, port) from e
        if bound == 0:
            raise PortInUse("health_port", host, port)
        return bound

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace: float | None = 5.0) -> None:
        if self.health_server is not None:
            await self.health_server.stop(0)
        await self.server.stop(grace)


def install_drain_handler(drain: Callable[[], Awaitable[None]]) -> asyncio.Event:
    """On SIGTERM or SIGINT run `drain` once, then set the returned event (the exit signal)."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    started = False

    def on_signal(signum: int) -> None:
        nonlocal started
        if started:
            return
        started = True
        logger.info("received %s: draining", signal.Signals(signum).name)

        async def run() -> None:
            try:
                await drain()
            finally:
                done.set()

        loop.create_task(run())

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    return done


def insecure_channel(target: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
