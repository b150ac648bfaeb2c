"""`pdserve prefill` / `pdserve decode`: picks the engine backend from config (`--engine`) and
serves the Engine API over it until SIGTERM/SIGINT (then drains).

One process per engine (rank 0; ranks 1..tp-1 are spawned by the engine). Start-up order: the
gRPC server listens (answering "still starting"), the backend builds and registers with the
scheduler, then the health service says SERVING. The process exits non-zero when the backend
fails (e.g. a rank died), so a supervisor restarts it.

Tracing (on from the OTEL_* environment, see services.common.tracing): the servicer's spans.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import threading

from pdserve.v1 import engine_pb2_grpc as pb_grpc
from services.common.bound_ports import PortsFile, listen_port
from services.common.config import EngineConfig, load_config
from services.common.grpc_server import ServiceServer, install_drain_handler
from services.common.security import component_server_security, peer_name_guards
from services.common.tracing import server_interceptors
from services.engine.backend import EngineBackend
from services.engine.registry import (
    BackendFactory,
    BackendUnavailable,
    EngineRefused,
    backend_factory,
    check_backend,
)
from services.engine.servicer import EngineServicer

logger = logging.getLogger(__name__)

FAILED_EXIT_GRACE_S = 5.0
STOP_BEFORE_READY_GRACE_S = 10.0


async def serve(config: EngineConfig, factory: BackendFactory) -> None:
    """Runs one engine service until SIGTERM/SIGINT (then drains)."""
    server = ServiceServer(["pdserve.v1.Engine"], max_message_bytes=config.max_message_bytes,
                           interceptors=[*peer_name_guards(config, ["pdserve.v1.Engine"]), *server_interceptors()])
    port = server.bind(config.host, config.port, component_server_security(config, require_client_cert=True))
    ports = PortsFile(config.ports_file)
    ports.report("port", port)
    health_port = listen_port("health_port", config.health_port, config.ephemeral_ports)
    if health_port is not None:
        ports.report("health_port", server.bind_health(config.host, health_port))
    advertise = config.advertise_host or (config.host if config.host not in ("0.0.0.0", "::") else socket.getfqdn())
    backend = factory(config, f"{advertise}:{port}")
    servicer = EngineServicer(config, backend)
    pb_grpc.add_EngineServicer_to_server(servicer, server.server)
    await server.start()
    logger.info("%s engine %s (%s): Engine API on %s:%d, building the engine", config.role, config.engine_id,
                config.engine, config.host, port)

    async def drain() -> None:
        servicer.start_draining()
        await server.set_serving(False)
        if backend.ready:
            load = await servicer.wait_drained(config.drain_timeout_s)
            logger.info("drained (%d pinned, %d running left)", load.num_pinned, load.num_running)

    stopped = install_drain_handler(drain)
    try:
        if not await _started_unless_stopped(backend, stopped, config.engine_id):
            return
        await server.set_serving(True)
        await _until_stopped_or_failed(stopped, backend, config.engine_id)
    finally:
        await server.stop(1.0)
        backend.shutdown()


async def _started_unless_stopped(backend: EngineBackend, stopped: asyncio.Event, engine_id: str) -> bool:
    """Starts the backend (the model load, then the wait for a scheduler's Welcome, which has
    no deadline); False when SIGTERM/SIGINT came first. Then the caller shuts the backend down,
    which ends the wait (the control streams close), so a pod deleted while its scheduler is
    unreachable exits in its grace period; a start that cannot be interrupted (inside vLLM's
    engine start-up) is cut by a watchdog after STOP_BEFORE_READY_GRACE_S."""
    start = asyncio.ensure_future(backend.start())
    stop = asyncio.ensure_future(stopped.wait())
    await asyncio.wait({start, stop}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if start.done():
        start.result()  # a failed start raises here
        return True
    start.add_done_callback(lambda f: f.cancelled() or f.exception())  # its error is expected now
    logger.info("engine %s: stopped before it was ready (no scheduler answered yet)", engine_id)
    watchdog = threading.Timer(STOP_BEFORE_READY_GRACE_S, os._exit, args=(0,))
    watchdog.daemon = True
    watchdog.start()
    return False


async def _until_stopped_or_failed(stopped: asyncio.Event, backend: EngineBackend, engine_id: str) -> None:
    """Returns on SIGTERM/SIGINT; raises when the backend failed, so the process exits
    non-zero instead of lingering registered-but-dead (a supervisor restarts it)."""
    while not stopped.is_set():
        if backend.failed:
            # Clean-up with a dead rank can block (UCX, collectives, non-daemon threads): give it
            # a few seconds, then leave hard so a supervisor restarts the engine.
            watchdog = threading.Timer(FAILED_EXIT_GRACE_S, os._exit, args=(1,))
            watchdog.daemon = True
            watchdog.start()
            raise RuntimeError(f"engine {engine_id}: the engine loop died (see the step error above); exiting")
        try:
            await asyncio.wait_for(stopped.wait(), 0.5)
        except TimeoutError:
            pass


def run_engine(args: argparse.Namespace, role: str) -> int:
    """`pdserve prefill` / `pdserve decode`: config from YAML + env + flags, the backend check
    (an unavailable backend exits with status 2 and a one-line reason, before any heavy
    import), logging and tracing for this process, then serve until SIGTERM."""
    from services.common.logs import setup_logging
    from services.common.tracing import setup_tracing, shutdown_tracing

    config = load_config(EngineConfig, args, overrides={"role": role})
    try:
        check_backend(config.engine)
    except BackendUnavailable as e:
        print(f"pdserve {role}: {e}", file=sys.stderr)
        return 2
    if not config.engine_id:
        config.engine_id = f"{role}-{socket.gethostname()}"
    setup_logging(config.log_level, config.engine_id)
    setup_tracing(role, attributes={"pdserve.engine_id": config.engine_id, "pdserve.rank": 0})
    try:
        asyncio.run(serve(config, backend_factory(config.engine)))
    except EngineRefused as e:
        print(f"pdserve {role}: {e}", file=sys.stderr)
        return 2
    finally:
        shutdown_tracing()  # flush batched spans (after the SIGTERM drain too)
    return 0
