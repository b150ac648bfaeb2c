"""`SchedulerService`: the whole scheduler in one object — three gRPC servers (client API,
control streams, KV events), the registry, request table, router and the event plane.

In-process use (tests, benchmarks):

    service = SchedulerService(load_config(SchedulerConfig, overrides={"port": 0, "control_port": 0,
                                                                       "events_port": 0}))
    await service.start()          # binds; service.port / control_port / events_port are the bound ports
    ...                            # health SERVING once started
    await service.stop()

`pdserve scheduler` (services/scheduler/main.py) runs the same object until SIGTERM, then
`drain()`s: health NOT_SERVING, new requests UNAVAILABLE, in-flight ones finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from pdserve.v1 import control_pb2_grpc, generation_pb2_grpc
from services.common.bound_ports import PortInUse, listen_port
from services.common.config import SchedulerConfig
from services.common.grpc_server import ServiceServer
from services.common.metrics import EventMetrics
from services.common.security import (
    component_server_security,
    peer_name_guards,
    server_guard,
)
from services.common.tracing import server_interceptors
from services.scheduler.admission import Admission
from services.scheduler.control import ControlServicer
from services.scheduler.convergence import IndexConvergence
from services.scheduler.engine_positions import EnginePositions
from services.scheduler.event_sink import EventSink
from services.scheduler.generation import GenerationServicer
from services.scheduler.http_api import HttpApi
from services.scheduler.lifecycle import EngineRef, ReleaseCause
from services.scheduler.load_window import LoadWindow
from services.scheduler.path_costs import CostPriors, PathCosts
from services.scheduler.path_policy import PathConfig, PathPolicy
from services.scheduler.peer_fetch import PeerFetchConfig, PeerFetchPolicy
from services.scheduler.peer_snapshots import PeerSnapshots, peer_security
from services.scheduler.planner import PlannerConfig, RolePlanner
from services.scheduler.registry import EngineRegistry
from services.scheduler.request_table import RequestTable
from services.scheduler.roles import PlannerLoop, RoleAdmin, register_metrics
from services.scheduler.routing import Router, RoutingPolicy, make_policy
from services.scheduler.telemetry import SchedulerTelemetry
from services.scheduler.tokenization import ModelFacts, PromptTokenizer, read_model_facts

logger = logging.getLogger(__name__)

GENERATION_SERVICE = "pdserve.v1.Generation"
CONTROL_SERVICE = "pdserve.v1.Control"
EVENTS_SERVICE = "pdserve.v1.KVEvents"


def resolve_model_dir(model: str) -> Path:
    """The configured model directory, or the demo model's (converted on first use)."""
    if model:
        return Path(model)
    from engine.demo_model import demo_model_dir

    return demo_model_dir()


def make_path_policy(config: SchedulerConfig) -> PathPolicy:
    """The path policy of `config.path_*` (remote prefill vs decode-local, per request)."""
    priors = CostPriors(prefill_per_token_s=config.path_prior_prefill_us_per_token * 1e-6,
                        transfer_per_token_s=config.path_prior_transfer_us_per_token * 1e-6)
    path = PathConfig(mode=config.path_policy, threshold_tokens=config.path_threshold_tokens,
                      max_decode_kv_usage=config.path_max_decode_kv_usage,
                      decode_stall_budget_s=config.path_decode_stall_budget_ms / 1000.0,
                      decode_stall_steps=config.path_decode_stall_steps,
                      decode_load_s=config.path_decode_load_ms / 1000.0,
                      ttft_target_s=config.path_ttft_target_ms / 1000.0 or None, block_size=config.block_size)
    return PathPolicy(path, PathCosts(priors))


class SchedulerService:
    """See the module docstring. `sink` and `policy` override the event plane's (for tests)."""

    def __init__(self, config: SchedulerConfig, *, model_dir: Path | None = None, facts: ModelFacts | None = None,
                 sink: EventSink | None = None, policy: RoutingPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 prometheus: CollectorRegistry | None = None) -> None:
        self.config = config
        self.telemetry = SchedulerTelemetry(prometheus)
        self.scheduler_id = uuid.uuid4().hex[:12]
        self.tokenizer: PromptTokenizer | None = None
        if facts is None:
            path = model_dir or resolve_model_dir(config.model)
            facts = read_model_facts(path)
            self.tokenizer = PromptTokenizer(path)
        self.facts = facts
        self.plane: Any = None
        if sink is None:
            self.plane = self._event_plane()
            sink = self.plane.republisher if self.plane is not None else None
        if policy is None:
            policy = self.plane.routing_policy() if self.plane is not None and config.routing_policy == "prefix" \
                else make_policy(config.routing_policy)
        self.registry = EngineRegistry(block_size=config.block_size, hash_seed=config.hash_seed,
                                       compatibility_hash=config.compatibility_hash,
                                       heartbeat_timeout_s=config.heartbeat_timeout_s,
                                       multirank_cpu_heartbeat_timeout_s=config.multirank_cpu_heartbeat_timeout_s,
                                       clock=clock)
        self.table = RequestTable(clock, on_release=self.telemetry.release)
        # A replica with peers starts converging: its index learns the engines' blocks from a
        # peer's snapshot before it reports ready (services/scheduler/convergence.py).
        self.convergence: IndexConvergence | None = None
        if config.peers and sink is not None:
            sink = self.convergence = IndexConvergence(sink, EnginePositions())
        self.control = ControlServicer(self.registry, sink=sink, heartbeat_interval_s=config.heartbeat_interval_s,
                                       scheduler_id=self.scheduler_id, telemetry=self.telemetry,
                                       decode_peers=config.peer_fetch != "off")
        self.peer_snapshots: PeerSnapshots | None = None
        if self.convergence is not None:
            self.convergence.positions = self.control.positions
            self.convergence.live = self._engine_live
            self.convergence.on_converged.append(self._on_converged)
            self.peer_snapshots = PeerSnapshots(self.convergence, config.peers, self.scheduler_id,
                                                security=peer_security(config),
                                                timeout_s=config.converge_timeout_s)
        self.telemetry.track(self.registry, self.control.aggregator)
        if self.plane is not None:
            self.plane.republisher.position_of = self.control.positions.last
            self.plane.republisher.scheduler_id = self.scheduler_id
            self.plane.servicer.converged = lambda: self.converged
            if self.plane.zmq is not None:
                self.plane.zmq.converged = lambda: self.converged
            self.telemetry.metrics.track_convergence(lambda: self.converged)
            self.control.on_registered.append(self.plane.engine_up)
            self.control.on_engine_up.append(self.plane.engine_up)
            self.plane.instrument(EventMetrics(self.telemetry.prometheus))
        fetch = PeerFetchPolicy(PeerFetchConfig(config.peer_fetch, config.peer_fetch_min_blocks, config.block_size))
        self.router = Router(policy, config.decode_only_threshold, path=make_path_policy(config),
                             index=self.plane.index if self.plane is not None else None,
                             fetch=fetch if config.peer_fetch != "off" else None)
        self.admission = Admission(config.max_queue_per_engine)
        self.generation = GenerationServicer(config, facts=facts, tokenizer=self.tokenizer, control=self.control,
                                             router=self.router, admission=self.admission, table=self.table,
                                             telemetry=self.telemetry)
        # Bearer tokens and per-client limits guard the client API and KV events (not control).
        self.guard = server_guard(config, self.telemetry.metrics)
        size = config.max_message_bytes
        self.client_server = ServiceServer([GENERATION_SERVICE], max_message_bytes=size,
                                           interceptors=[self.guard, *server_interceptors()])
        self.control_server = ServiceServer([CONTROL_SERVICE], max_message_bytes=size,
                                            interceptors=peer_name_guards(config, [CONTROL_SERVICE]),
                                            options=self.control.keepalive_options())
        self.events_server = ServiceServer([EVENTS_SERVICE] if self.plane is not None else [],
                                           max_message_bytes=size, interceptors=[self.guard])
        generation_pb2_grpc.add_GenerationServicer_to_server(self.generation, self.client_server.server)
        control_pb2_grpc.add_ControlServicer_to_server(self.control, self.control_server.server)
        if self.plane is not None:
            self.plane.add_to_server(self.events_server.server)
        self.roles = RoleAdmin(self.control)
        self.planner = self._planner_loop(config)
        register_metrics(self.telemetry.prometheus, self.roles, self.planner)
        self.http: HttpApi | None = None
        if listen_port("http_port", config.http_port, config.ephemeral_ports) is not None:
            self.http = HttpApi(self.generation, self.guard, self.telemetry.prometheus)
            self.http.roles = self.roles
        self.port = self.control_port = self.events_port = self.health_port = self.http_port = 0
        self._sweeper: asyncio.Task[None] | None = None
        self._started = False
        self._converger: asyncio.Task[None] | None = None

    def _planner_loop(self, config: SchedulerConfig) -> PlannerLoop | None:
        if config.planner == "off":
            return None
        planner = RolePlanner(PlannerConfig(ttft_target_s=config.slo_ttft_ms / 1000, itl_target_s=config.slo_itl_ms / 1000,
                                            hysteresis=config.planner_hysteresis, min_dwell_s=config.planner_min_dwell_s))
        window = LoadWindow(config.planner_window_s, ttft_target_s=config.slo_ttft_ms / 1000,
                            itl_target_s=config.slo_itl_ms / 1000)
        self.generation.load_window = window
        return PlannerLoop(config.planner, planner, window, self.roles, self.router.path.costs,
                           interval_s=config.planner_interval_s)

    @property
    def converged(self) -> bool:
        """Whether the prefix index is complete (always, for a replica without peers)."""
        return self.convergence is None or self.convergence.converged

    def _engine_live(self, engine_id: str, epoch: int) -> bool:
        return (EngineRef(engine_id, epoch) not in self.control.down
                and self.registry.engine(engine_id, epoch) is not None)

    def _on_converged(self) -> None:
        """Ready: the client API's and KV events' health go SERVING (liveness, the service ""
        health, was SERVING throughout)."""
        if self._started and not self.generation.draining:
            asyncio.get_running_loop().create_task(self._set_ready(True))

    async def _set_ready(self, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for server in (self.client_server, self.events_server):
            for name in server.service_names:
                await server.health.set(name, status)

    def _event_plane(self) -> Any:
        try:
            from services.scheduler.events.plane import EventPlane
        except ImportError:
            logger.warning("KV-event plane not available: events are dropped, routing by load")
            return None
        return EventPlane.from_config(self.config, model_name=self.facts.name)

    @property
    def servers(self) -> list[ServiceServer]:
        return [self.client_server, self.control_server, self.events_server]

    async def start(self) -> None:
        """Binds the three ports (0 picks free ones), starts serving and reports SERVING."""
        c = self.config
        public = component_server_security(c, require_client_cert=c.tls_require_client_cert)
        ranks = component_server_security(c, require_client_cert=True)  # registration needs a certificate
        self.port = self.client_server.bind(c.host, c.port, public, "port")
        self.control_port = self.control_server.bind(c.host, c.control_port, ranks, "control_port")
        self.events_port = self.events_server.bind(c.host, c.events_port, public, "events_port")
        health_port = listen_port("health_port", c.health_port, c.ephemeral_ports)
        if health_port is not None:
            self.health_port = self.client_server.bind_health(c.host, health_port)
        if self.plane is not None:
            self.plane.start()
        for server in self.servers:
            await server.start()
        self.control.start_monitor()
        if self.planner is not None:
            self.planner.start()
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        self._started = True
        for server in self.servers:
            if self.converged or server is self.control_server:
                await server.set_serving(True)
            else:  # live, not ready: the client API and KV events wait for the index to converge
                await server.health.set("", health_pb2.HealthCheckResponse.SERVING)
        if self.peer_snapshots is not None:
            self._converger = asyncio.get_running_loop().create_task(self.peer_snapshots.run())
        if self.http is not None:
            self.http.ready = lambda: self.converged
            try:
                self.http_port = await self.http.start(c.host, c.http_port, public)
            except (OSError, SystemExit) as e:  # uvicorn exits (SystemExit) when it cannot bind
                raise PortInUse("http_port", c.host, c.http_port) from e
        logger.info("scheduler %s serving: client %s:%d, control %s:%d, events %s:%d", self.scheduler_id, c.host,
                    self.port, c.host, self.control_port, c.host, self.events_port)

    async def _sweep(self) -> None:
        """Lease expiry: blocks nobody released in time count as lease-expired (the prefill
        engine frees them itself; the ReleaseBlocks makes sure)."""
        while True:
            await asyncio.sleep(0.5)
            for request in self.table.lease_expired():
                if request.prefill is not None and request.release_prefill(ReleaseCause.LEASE_EXPIRED):
                    self.control.release(request.prefill, request.request_id)

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Health NOT_SERVING, new requests refused, waits for in-flight ones (True: all done)."""
        for server in self.servers:
            await server.set_serving(False)
        return await self.generation.drain(self.config.drain_timeout_s if timeout_s is None else timeout_s)

    async def stop(self, grace: float = 1.0) -> None:
        if self._converger is not None:
            self._converger.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._converger
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self.planner is not None:
            await self.planner.stop()
        await self.control.stop()
        if self.http is not None:
            await self.http.stop(grace)
        for server in self.servers:
            await server.stop(grace)
        await self.generation.close()
        if self.plane is not None:
            self.plane.close()

    def leaks(self) -> list[str]:
        """What is left after every request ended (empty when clean): requests, transfers, slots."""
        problems = [f"request {x}" for x in self.table.leaks()]
        problems += [f"transfer {r}" for r in self.control.tracker.transfers]
        problems += self.router.path.costs.leaks()
        if self.admission.total():
            problems.append(f"{self.admission.total()} admission slots held")
        if self.guard.streams.total():
            problems.append(f"{self.guard.streams.total()} client streams counted open")
        return problems
