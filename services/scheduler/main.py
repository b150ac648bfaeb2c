"""`pdserve scheduler`: run the central scheduler service until SIGTERM / SIGINT, then drain."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging

from prometheus_client import CollectorRegistry

from services.common.bound_ports import PortsFile, listen_port
from services.common.config import SchedulerConfig, add_config_arguments, load_config
from services.common.event_loop import run_on_loop
from services.common.grpc_server import install_drain_handler
from services.common.logs import setup_logging
from services.common.metrics import start_metrics_server
from services.common.tracing import setup_tracing
from services.scheduler.service import SchedulerService

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, SchedulerConfig)


def run(args: argparse.Namespace) -> int:
    config = load_config(SchedulerConfig, args)
    setup_logging(config.log_level, "scheduler")
    setup_tracing("scheduler")
    return run_on_loop(serve(config), config.event_loop)


# Allocations (net of deallocations) between two young collections; CPython's default is 700.
# Every message on a rank's control stream replaces that stream's pending read (a handful of
# coroutines, futures and grpc callback objects that live until the next message), so the young
# generation fills with ~6 live objects per stream heard from, not with garbage: at 1,024 ranks
# a young collection walked 8-12k objects (2-5 ms) about four times a second. At 5,000 they run
# ~4x less often, each walking about as many (bounded by the streams' pending reads), and the
# middle generation's passes, every tenth young one, likewise (docs/decisions/0004-gc-untracked-long-lived-state.md).
GC_YOUNG_THRESHOLD = 5000


def settle_gc() -> None:
    """Moves everything alive after start-up (modules, classes, servers: about 35k objects that
    live as long as the process) out of the collector's sight, so a full collection only walks
    what was made since, and collects the young generation less often (`GC_YOUNG_THRESHOLD`).
    The long-lived event state is kept collector-cheap by its layout (the prefix index and
    aggregator hold ints, the replay ring packed bytes)."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


async def serve(config: SchedulerConfig) -> int:
    registry = CollectorRegistry()
    service = SchedulerService(config, prometheus=registry)
    metrics_port = listen_port("metrics_port", config.metrics_port, config.ephemeral_ports)
    metrics_server = start_metrics_server(metrics_port, registry, config.host) if metrics_port is not None else None
    started = asyncio.Event()

    async def drain() -> None:
        await started.wait()  # a signal during start-up drains once the ports are up
        clean = await service.drain()
        if not clean:
            logger.warning("drain timed out with %d requests in flight", len(service.generation.table))

    # Before start(): its gRPC ports report SERVING before the HTTP API is up, and a SIGTERM in
    # between must still drain and exit 0, not kill the process with buffered spans unexported.
    done = install_drain_handler(drain)
    await service.start()
    ports = PortsFile(config.ports_file)
    for setting, port in (("port", service.port), ("control_port", service.control_port),
                          ("events_port", service.events_port), ("http_port", service.http_port),
                          ("health_port", service.health_port),
                          ("metrics_port", metrics_server.port if metrics_server is not None else 0)):
        ports.report(setting, port)
    zmq = service.plane.zmq if service.plane is not None else None
    if zmq is not None:  # a tcp endpoint's port (one given as tcp://host:* is the OS's choice)
        for setting, endpoint in (("zmq_endpoint", zmq.bound_endpoint), ("zmq_replay_endpoint", zmq.bound_replay_endpoint)):
            if endpoint.startswith("tcp://"):
                ports.report(setting, int(endpoint.rsplit(":", 1)[1]))
    started.set()
    settle_gc()
    try:
        await done.wait()
    finally:
        await service.stop()
        if metrics_server is not None:
            metrics_server.close()
    return 0
