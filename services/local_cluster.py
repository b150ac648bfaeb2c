"""A whole pdserve cluster as local processes: what `pdserve up`, the demo, the end-to-end
tests and the serving benchmarks run.

Every component is a child process in its own session (process group), so stopping the cluster
also stops the rank processes an engine spawned; nothing is left behind.

Every component binds its own ports — the ones the spec gives, or ports the OS picks — and
writes what it bound to its ports file (services/common/bound_ports.py); the cluster reads them
back (`Component.address`, `.metrics_port`, the replicas' ports) instead of guessing free ports.
A restarted component is given the ports it bound the first time, so endpoints stay put.

With `ClusterSpec.tls` every component gets certificates from a throwaway CA (services/common/
certs.py) and every channel is mTLS; `auth_tokens` are given to the scheduler (environment, not
flags) and the first one is what `client_security` sends.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import engine_pb2 as engine_pb
from pdserve.v1 import engine_pb2_grpc as engine_grpc
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import generation_pb2_grpc as gen_grpc
from services.common.bound_ports import EXIT_PORT_IN_USE, read_ports
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.security import ChannelSecurity, open_sync_channel

if TYPE_CHECKING:
    from services.common.certs import LocalPki

logger = logging.getLogger(__name__)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


_rng = random.Random()


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago — no more. Only for a peer's process that cannot report
    the port it bound (vLLM's own server in the benchmarks) and for tests that fix a port on
    purpose; every pdserve component binds its own and reports it (services/common/bound_ports.py).
    Chosen below the kernel's ephemeral range, which any outgoing connection may take meanwhile."""
    low, _ = _ephemeral_range()
    for _ in range(200):
        port = _rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # everything below the range is taken: let the OS pick
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ComponentExited(RuntimeError):
    """A component exited while the cluster started (status 69: a port it was given is taken)."""

    def __init__(self, name: str, status: int, log_path: Path | None = None) -> None:
        where = f"; see {log_path}" if log_path else ""
        why = " (a port it was given is in use)" if status == EXIT_PORT_IN_USE else ""
        super().__init__(f"{name} exited with status {status} while starting{why}{where}")
        self.name, self.status = name, status


def default_torch_threads(num_rank_processes: int, cores: int | None = None) -> int:
    """Divides the machine's cores among the engine rank processes (at least 1 each)."""
    cores = cores or os.cpu_count() or 1
    return max(1, cores // max(1, num_rank_processes))


@dataclass(slots=True)
class ClusterSpec:
    model: str = ""
    num_prefill: int = 1
    num_decode: int = 1
    tp: int = 1
    prefill_tp: int = 0  # 0: tp
    decode_tp: int = 0  # 0: tp
    host: str = "127.0.0.1"
    port: int = 0
    control_port: int = 0
    events_port: int = 0
    http_port: int = 0  # the OpenAI-compatible HTTP API; 0: a port the scheduler's OS picks
    metrics: bool = False
    torch_threads: int = 0
    kv_cache_memory: str = "256MiB"
    scheduler_args: list[str] = field(default_factory=list)
    engine_args: list[str] = field(default_factory=list)
    log_dir: str = ""
    env: dict[str, str] = field(default_factory=dict)
    tls: bool = False  # mTLS on every channel with a throwaway CA
    tls_dir: str = ""  # where the certificates go (default: a temporary directory, removed by stop())
    auth_tokens: list[str] = field(default_factory=list)  # bearer tokens of the client API and KV events
    engine_devices: list[str] = field(default_factory=list)  # --devices of engine i (prefill first); empty: none
    # --gpu-memory-fraction of engine i, same order (services/placement.py); empty: none
    engine_memory_fractions: list[float] = field(default_factory=list)
    dtype: str = ""  # --dtype of every engine; empty: the engines' default (parity tests pin float32)
    engine: str = "native"  # engine backend of every prefill and decode engine (--engine)
    vllm_args: list[str] = field(default_factory=list)  # KEY=VALUE, passed to every engine as --vllm-arg
    # Scheduler replicas, all active; every engine connects to each. Replica 0 takes the ports
    # above; replica i the same ports + 10 * i when they were given, else ports its OS picks.
    num_schedulers: int = 1
    zmq: bool = False  # every replica also publishes vLLM-format KV events on ZMQ (PUB + replay ROUTER)
    # Or at these endpoints (replica 0; replica i: a tcp port + 10 * i, another path's "-i"):
    # `pdserve up --zmq-endpoint / --zmq-replay-endpoint`.
    zmq_endpoint: str = ""
    zmq_replay_endpoint: str = ""


def replica_endpoint(endpoint: str, i: int) -> str:
    """Replica i's copy of a ZMQ endpoint given for replica 0: `tcp://host:port` → port + 10 * i
    (as the other ports), any other endpoint (ipc://path, a wildcard port) → its text + "-i"."""
    if not endpoint or i == 0:
        return endpoint
    m = re.fullmatch(r"(tcp://.*:)(\d+)", endpoint)
    return f"{m.group(1)}{int(m.group(2)) + 10 * i}" if m else f"{endpoint}-{i}"


@dataclass(frozen=True, slots=True)
class ReplicaPorts:
    """One scheduler replica's ports (client API, control, KV events, HTTP): the spec's, 0 where
    it gives none until the replica has started and reported what it bound."""

    name: str
    port: int
    control_port: int
    events_port: int
    http_port: int
    zmq_endpoint: str = ""  # PUB and replay ROUTER (empty: none)
    zmq_replay_endpoint: str = ""


@dataclass(slots=True)
class Component:
    name: str
    argv: list[str]
    metrics_port: int | None = None  # rank 0's /metrics (None: metrics off, or not reported yet)
    address: str = ""  # an engine's Engine API host:port, once reported
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    ports_file: Path | None = None  # where the process reports the ports it bound
    ports: dict[str, int] = field(default_factory=dict)  # setting -> port bound (rank 0 / the process)
    metrics_ports: list[int] = field(default_factory=list)  # /metrics of rank r at index r, as reported

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class LocalCluster:
    """Starts, watches and stops a local cluster. Use as a context manager."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        if spec.num_schedulers < 1:
            raise ValueError(f"need at least one scheduler, got {spec.num_schedulers}")
        self.replicas = [self._replica_ports(i) for i in range(spec.num_schedulers)]
        first = self.replicas[0]
        self.port, self.control_port, self.events_port, self.http_port = (
            first.port, first.control_port, first.events_port, first.http_port)
        ranks = spec.num_prefill * self.role_tp("prefill") + spec.num_decode * self.role_tp("decode")
        self.torch_threads = spec.torch_threads or default_torch_threads(ranks)
        self.components: dict[str, Component] = {}
        self._log_dir = Path(spec.log_dir) if spec.log_dir else None
        self._ports_dir = Path(tempfile.mkdtemp(prefix="pdserve-ports-"))
        self.pki: LocalPki | None = None
        if spec.tls:
            # Imported only for TLS: `cryptography` is not needed (nor shipped to the GPU check) otherwise.
            from services.common.certs import make_local_pki

            self.pki = make_local_pki(spec.tls_dir or tempfile.mkdtemp(prefix="pdserve-tls-"), [spec.host])
        token = spec.auth_tokens[0] if spec.auth_tokens else ""
        # What a client of the Generate / KVEvents APIs uses, and what Engine.Inspect uses (mTLS).
        self.client_security: ChannelSecurity | None = None
        self.engine_security: ChannelSecurity | None = None
        if self.pki is not None:
            self.client_security = ChannelSecurity(ca=str(self.pki.ca_cert), cert=str(self.pki.client_cert),
                                                   key=str(self.pki.client_key), token=token)
            self.engine_security = ChannelSecurity(ca=str(self.pki.ca_cert), cert=str(self.pki.server_cert),
                                                   key=str(self.pki.server_key))
        elif token:
            self.client_security = ChannelSecurity(token=token)

    def _replica_ports(self, i: int) -> ReplicaPorts:
        s = self.spec

        def port(given: int) -> int:
            return given + 10 * i if given else 0
        if s.zmq:  # ZMQ binds a port of its own choosing for "*"; the scheduler reports it
            zmq = (f"tcp://{s.host}:*", f"tcp://{s.host}:*")
        else:
            zmq = (replica_endpoint(s.zmq_endpoint, i), replica_endpoint(s.zmq_replay_endpoint, i))
        return ReplicaPorts("scheduler" if i == 0 else f"scheduler-{i}", port(s.port), port(s.control_port),
                            port(s.events_port), port(s.http_port), *zmq)

    @staticmethod
    def is_scheduler(name: str) -> bool:
        return name == "scheduler" or name.startswith("scheduler-")

    @property
    def scheduler_names(self) -> list[str]:
        return [r.name for r in self.replicas]

    @property
    def engine_names(self) -> list[str]:
        return [n for n in self.components if not self.is_scheduler(n)]

    def replica_target(self, replica: ReplicaPorts) -> str:
        return f"{self.spec.host}:{replica.port}"

    def replica_http_url(self, replica: ReplicaPorts) -> str:
        scheme = "https" if self.pki is not None else "http"
        host = f"[{self.spec.host}]" if ":" in self.spec.host else self.spec.host
        return f"{scheme}://{host}:{replica.http_port}/v1"

    @property
    def targets(self) -> str:
        """Every replica's client API, comma-separated (what `pdserve generate --target` takes)."""
        return ",".join(self.replica_target(r) for r in self.replicas)

    def role_tp(self, role: str) -> int:
        """The TP size of the role's engines (`prefill_tp` / `decode_tp`, else `tp`)."""
        return (self.spec.prefill_tp if role == "prefill" else self.spec.decode_tp) or self.spec.tp

    @property
    def target(self) -> str:
        return f"{self.spec.host}:{self.port}"

    @property
    def http_url(self) -> str:
        """Base URL of the OpenAI-compatible API (what OpenAI clients take as `base_url`)."""
        return self.replica_http_url(self.replicas[0])

    @property
    def events_target(self) -> str:
        return f"{self.spec.host}:{self.events_port}"

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "services.common.cli", *args, *self._tls_args()]

    def _backend_args(self) -> list[str]:
        args = ["--engine", self.spec.engine]
        for item in self.spec.vllm_args:
            args += ["--vllm-arg", item]
        return args

    def _tls_args(self) -> list[str]:
        if self.pki is None:
            return []
        from services.common.certs import COMPONENT_NAME

        return ["--tls-cert", str(self.pki.server_cert), "--tls-key", str(self.pki.server_key),
                "--tls-ca", str(self.pki.ca_cert), "--tls-peer-name", COMPONENT_NAME]

    def _scheduler_component(self, r: ReplicaPorts | None = None) -> Component:
        """Scheduler replica `r` (default: replica 0)."""
        s = self.spec
        r = r or self.replicas[0]
        ports_file = self._ports_dir / f"{r.name}.jsonl"
        ephemeral = ",".join([*([] if r.http_port else ["http_port"]), *(["metrics_port"] if s.metrics else [])])
        argv = self._cli("scheduler", "--host", s.host, "--port", str(r.port),
                         "--control-port", str(r.control_port), "--events-port", str(r.events_port),
                         "--http-port", str(r.http_port), "--metrics-port", "0", "--ephemeral-ports", ephemeral,
                         "--ports-file", str(ports_file), *(["--model", s.model] if s.model else []),
                         *self._peer_args(r), *self._zmq_args(r), *s.scheduler_args)
        return Component(r.name, argv, ports_file=ports_file)

    @staticmethod
    def _zmq_args(r: ReplicaPorts) -> list[str]:
        return [*(["--zmq-endpoint", r.zmq_endpoint] if r.zmq_endpoint else []),
                *(["--zmq-replay-endpoint", r.zmq_replay_endpoint] if r.zmq_replay_endpoint else [])]

    def _peer_args(self, r: ReplicaPorts) -> list[str]:
        """The other replicas' KVEvents endpoints: a replica restarted takes its index from them.
        Those not started yet have no port to name (at the first start there is no index to
        take); a restart names every other replica."""
        peers = [f"{self.spec.host}:{p.events_port}" for p in self.replicas if p.name != r.name and p.events_port]
        return ["--peers", ",".join(peers)] if peers else []

    def _engine_component(self, role: str, index: int, tp: int = 0) -> Component:
        """Engine `{role}-{index}` at TP `tp` (0: the role's, `role_tp`)."""
        s = self.spec
        engine_id = f"{role}-{index}"
        ports_file = self._ports_dir / f"{engine_id}.jsonl"
        slot = index if role == "prefill" else s.num_prefill + index
        devices = s.engine_devices[slot] if slot < len(s.engine_devices) else ""
        fraction = s.engine_memory_fractions[slot] if slot < len(s.engine_memory_fractions) else 0.0
        argv = self._cli(role, "--engine-id", engine_id, "--scheduler", self._control_targets(),
                         "--host", s.host, "--port", "0", "--tp", str(tp or self.role_tp(role)), "--torch-threads", str(self.torch_threads),
                         "--metrics-port", "0", "--ephemeral-ports", "metrics_port" if s.metrics else "",
                         "--ports-file", str(ports_file), "--kv-cache-memory", s.kv_cache_memory,
                         *(["--model", s.model] if s.model else []), *(["--dtype", s.dtype] if s.dtype else []),
                         *(["--devices", devices] if devices else []),
                         *(["--gpu-memory-fraction", f"{fraction:.4f}"] if fraction else []),
                         *self._backend_args(), *s.engine_args)
        return Component(engine_id, argv, ports_file=ports_file)

    def _control_targets(self) -> str:
        return ",".join(f"{self.spec.host}:{r.control_port}" for r in self.replicas)

    def start(self, timeout: float = 180.0) -> None:
        """Starts every component and returns once every scheduler replica sees every engine
        registered."""
        deadline = time.monotonic() + timeout
        try:
            for i, replica in enumerate(self.replicas):
                comp = self._scheduler_component(replica)
                self._launch(comp)
                zmq = [name for name, endpoint in (("zmq_endpoint", replica.zmq_endpoint),
                                                   ("zmq_replay_endpoint", replica.zmq_replay_endpoint))
                       if endpoint.startswith("tcp://")]
                ports = self._await_ports(comp, deadline, {*self.REPLICA_SETTINGS, *zmq})
                self.replicas[i] = self._bound_replica(replica, ports)
        except Exception:
            self.stop()
            raise
        first = self.replicas[0]
        self.port, self.control_port, self.events_port, self.http_port = (
            first.port, first.control_port, first.events_port, first.http_port)
        self.start_engines(max(1.0, deadline - time.monotonic()))

    REPLICA_SETTINGS = ("port", "control_port", "events_port", "http_port")

    def _await_ports(self, comp: Component, deadline: float, settings: set[str]) -> dict[str, int]:
        """Waits until the component has reported the ports of these settings (and /metrics with
        metrics on); raises when it exits first (a port it was given is taken: its log says)."""
        wanted = set(settings)
        if self.spec.metrics:
            wanted.add("metrics_port")
        while time.monotonic() < deadline:
            self._read_ports(comp)
            if wanted <= set(comp.ports):
                return comp.ports
            if comp.proc is not None and comp.proc.poll() is not None:
                raise ComponentExited(comp.name, comp.proc.returncode, comp.log_path)
            time.sleep(0.05)
        raise TimeoutError(f"{comp.name} did not report its ports ({', '.join(sorted(wanted - set(comp.ports)))})")

    def _read_ports(self, comp: Component) -> None:
        """Takes what the component reported into its fields (address, metrics ports)."""
        if comp.ports_file is None:
            return
        reported = read_ports(comp.ports_file)
        comp.ports = {setting: port for (setting, rank), port in reported.items() if rank in (None, 0)}
        ranks = sorted((rank, port) for (setting, rank), port in reported.items()
                       if setting == "metrics_port" and rank is not None)
        comp.metrics_ports = [port for _, port in ranks]
        comp.metrics_port = comp.ports.get("metrics_port")
        if not self.is_scheduler(comp.name) and "port" in comp.ports:
            comp.address = f"{self.spec.host}:{comp.ports['port']}"

    def _bound_replica(self, replica: ReplicaPorts, ports: dict[str, int]) -> ReplicaPorts:
        zmq = [self._reported_endpoint(replica.name, name, given)
               for name, given in (("zmq_endpoint", replica.zmq_endpoint),
                                   ("zmq_replay_endpoint", replica.zmq_replay_endpoint))]
        return dataclasses.replace(replica, port=ports["port"], control_port=ports["control_port"],
                                   events_port=ports["events_port"], http_port=ports["http_port"],
                                   zmq_endpoint=zmq[0], zmq_replay_endpoint=zmq[1])

    def _reported_endpoint(self, name: str, setting: str, given: str) -> str:
        """A ZMQ endpoint with its wildcard port replaced by the port bound (reported as a port)."""
        if not given.endswith(":*"):
            return given
        port = self.components[name].ports.get(setting)
        return f"{given[:-1]}{port}" if port else given

    def start_engines(self, timeout: float = 180.0) -> None:
        """Starts only the engines, against a scheduler already listening on the spec's ports (an
        in-process SchedulerService in tests), and returns once it sees every engine registered."""
        s = self.spec
        for i in range(s.num_prefill):
            self._launch(self._engine_component("prefill", i))
        for i in range(s.num_decode):
            self._launch(self._engine_component("decode", i))
        try:
            self.wait_ready(s.num_prefill, s.num_decode, timeout)
        except Exception:
            self.stop()
            raise

    def add_engine(self, role: str, *, tp: int = 0, timeout: float = 180.0) -> str:
        """Starts one more engine of `role` beside the spec's (at TP `tp`; 0: the role's), named
        after the role's last one, and returns its name once the scheduler routes to it and it
        serves."""
        index = sum(1 for name in self.engine_names if name.startswith(f"{role}-"))
        comp = self._engine_component(role, index, tp)
        self._launch(comp)
        counts = {r: sum(1 for name in self.engine_names if name.startswith(f"{r}-")) for r in ("prefill", "decode")}
        self.wait_ready(counts["prefill"], counts["decode"], timeout)
        return comp.name

    def _launch(self, comp: Component) -> None:
        env = {**os.environ, **self.spec.env, "PYTHONUNBUFFERED": "1"}
        if self.spec.engine == "vllm":
            # vLLM's CPU worker binds its threads to cores itself ("auto"): every engine of one
            # host would bind to the same ones. Unbound, each takes --torch-threads threads.
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if self.spec.auth_tokens:
            env["PDSERVE_AUTH_TOKENS"] = ",".join(self.spec.auth_tokens)
        if self._log_dir is not None:
            self._log_dir.mkdir(parents=True, exist_ok=True)
            comp.log_path = self._log_dir / f"{comp.name}.log"
            out = comp.log_path.open("ab")
            comp.proc = subprocess.Popen(comp.argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
            out.close()
        else:
            comp.proc = subprocess.Popen(comp.argv, env=env, start_new_session=True)
        self.components[comp.name] = comp
        logger.info("started %s (pid %d)", comp.name, comp.proc.pid)

    def server_info(self, timeout: float = 2.0, target: str = "") -> gen_pb.ServerInfo:
        """GetServerInfo of replica 0 (or of the client API at `target`)."""
        security = self.client_security
        with open_sync_channel(target or self.target, security, CHANNEL_OPTIONS) as channel:
            return gen_grpc.GenerationStub(channel).GetServerInfo(
                gen_pb.GetServerInfoRequest(), timeout=timeout, metadata=security.metadata() if security else ())

    def wait_ready(self, num_prefill: int, num_decode: int, timeout: float = 180.0) -> None:
        """Waits until the scheduler reports at least these many registered, healthy engines and
        every engine process this cluster started serves (its gRPC health is SERVING). An
        engine's ranks register while its backend is still starting (vLLM's ranks say Hello
        from the worker, before the KV cache and warm-up), so registration alone is not
        readiness: a request sent straight to the engine then is answered UNAVAILABLE."""
        deadline = time.monotonic() + timeout
        last_error = ""
        while time.monotonic() < deadline:
            for comp in self.components.values():
                self._read_ports(comp)
                if comp.proc is not None and comp.proc.poll() is not None:
                    raise ComponentExited(comp.name, comp.proc.returncode, comp.log_path)
            try:
                infos = [self.server_info(target=self.replica_target(r)) for r in self.replicas
                         if self.components.get(r.name) is None or self.components[r.name].alive]
                last_error = "; ".join(f"{i.num_prefill_engines} prefill, {i.num_decode_engines} decode registered"
                                       for i in infos)
                if all(i.num_prefill_engines >= num_prefill and i.num_decode_engines >= num_decode for i in infos):
                    starting = [name for name in self.engine_names if not self._serving(name)]
                    if not starting:
                        return
                    last_error += f"; still starting: {', '.join(starting)}"
            except grpc.RpcError as e:
                last_error = f"{e.code().name}: {e.details()}"
            time.sleep(0.2)
        raise TimeoutError(f"cluster not ready after {timeout:.0f}s ({last_error})")

    def replica_ready(self, name: str, timeout: float = 2.0) -> bool:
        """Whether scheduler replica `name` is ready: its Generation service's gRPC health is
        SERVING (a restarted replica only once its prefix index converged)."""
        [replica] = [r for r in self.replicas if r.name == name]
        try:
            with open_sync_channel(self.replica_target(replica), self.client_security, CHANNEL_OPTIONS) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"), timeout=timeout)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def _serving(self, name: str, timeout: float = 2.0) -> bool:
        """Whether the component's gRPC health reports SERVING (False while it cannot answer)."""
        address = self.components[name].address
        if not address:
            return False
        try:
            with open_sync_channel(address, self.engine_security, CHANNEL_OPTIONS) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def inspect(self, name: str, timeout: float = 5.0) -> engine_pb.InspectResponse:
        """The engine's load and leak report (Engine.Inspect)."""
        with open_sync_channel(self.components[name].address, self.engine_security, CHANNEL_OPTIONS) as channel:
            return engine_grpc.EngineStub(channel).Inspect(engine_pb.InspectRequest(), timeout=timeout)

    def wait_no_leaks(self, names: list[str] | None = None, timeout: float = 15.0) -> dict[str, list[str]]:
        """Waits until every named engine (default: all alive) reports no leaks; returns the
        leaks still reported at the timeout (empty dict when clean)."""
        names = names or [n for n in self.engine_names if self.components[n].alive]
        deadline = time.monotonic() + timeout
        while True:
            leaks = {n: list(self.inspect(n).leaks) for n in names}
            leaks = {n: v for n, v in leaks.items() if v}
            if not leaks or time.monotonic() >= deadline:
                return leaks
            time.sleep(0.2)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` to a component's whole process group (its rank processes too)."""
        comp = self.components[name]
        if comp.proc is None:
            return
        try:
            os.killpg(comp.proc.pid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGKILL:
            comp.proc.wait()

    def component_names(self) -> list[str]:
        return list(self.components)

    def exit_status(self, name: str) -> int | None:
        """None while the component runs (or was never started), else its exit status."""
        proc = self.components[name].proc
        return None if proc is None else proc.poll()

    def restart(self, name: str) -> None:
        """Restarts a component on the ports it bound before (its endpoints stay put); when one
        was taken meanwhile it exits with EXIT_PORT_IN_USE, naming it."""
        comp = self.components[name]
        if comp.alive:
            self.kill(name)
        self._read_ports(comp)
        host = f"[{self.spec.host}]" if ":" in self.spec.host else self.spec.host
        pins = [arg for setting, port in sorted(comp.ports.items())
                for arg in ("--" + setting.replace("_", "-"),
                            f"tcp://{host}:{port}" if setting.startswith("zmq") else str(port))]
        if self.is_scheduler(name):
            pins += self._peer_args(next(r for r in self.replicas if r.name == name))
        if comp.ports_file is not None:
            comp.ports_file.unlink(missing_ok=True)
        self._launch(Component(comp.name, [*comp.argv, *pins], comp.metrics_port, comp.address,
                               ports_file=comp.ports_file, ports=dict(comp.ports),
                               metrics_ports=list(comp.metrics_ports)))

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM every component (engines first), SIGKILL what is left after `grace` seconds."""
        order = self.engine_names + [n for n in self.components if self.is_scheduler(n)]
        for name in order:
            self.kill(name, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for name in order:
            proc = self.components[name].proc
            if proc is None:
                continue
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in %.0fs; killing it", name, grace)
            self.kill(name, signal.SIGKILL)
        if self.pki is not None and not self.spec.tls_dir:
            shutil.rmtree(self.pki.directory, ignore_errors=True)  # throwaway keys do not outlive the cluster
        shutil.rmtree(self._ports_dir, ignore_errors=True)
