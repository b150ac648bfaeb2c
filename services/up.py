"""`pdserve up`: the whole cluster — scheduler, prefill and decode engines — as local processes."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from engine.config import ModelConfig
from engine.demo_model import demo_model_dir
from engine.device import HostDevices, cpu_has_native_bf16, probe_host, resolve_dtype, resolve_kind
from services.common.bound_ports import EXIT_PORT_IN_USE
from services.common.config import ENGINES, check_vllm_args, parse_vllm_args
from services.common.logs import setup_logging
from services.common.security import check_plaintext
from services.local_cluster import ClusterSpec, ComponentExited, LocalCluster
from services.placement import DEFAULT_KV_SHARE, PlacementPlan, plan_placement
from services.supervisor import Supervisor

VLLM_BLOCK_SIZE = 32  # vLLM 0.32's CPU attention takes block sizes that are multiples of 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="model directory (Hugging Face layout); default: the demo model")
    parser.add_argument("--schedulers", type=int, default=1,
                        help="scheduler replicas, all active (any serves any request); every engine connects to "
                             "each; replica i listens on the four ports below + 10 * i")
    parser.add_argument("--prefill", type=int, default=1, help="number of prefill engines")
    parser.add_argument("--decode", type=int, default=1, help="number of decode engines")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of every engine")
    parser.add_argument("--prefill-tp", type=int, default=0,
                        help="tensor-parallel size of the prefill engines (default: --tp)")
    parser.add_argument("--decode-tp", type=int, default=0,
                        help="tensor-parallel size of the decode engines (default: --tp); decode ranks "
                             "read their KV heads from whichever prefill ranks hold them")
    parser.add_argument("--host", default="127.0.0.1", help="address every component listens on")
    parser.add_argument("--port", type=int, default=50051, help="client API port")
    parser.add_argument("--control-port", type=int, default=50052, help="scheduler control-stream port")
    parser.add_argument("--events-port", type=int, default=50053, help="KV-event subscription port")
    parser.add_argument("--http-port", type=int, default=8000,
                        help="OpenAI-compatible HTTP API port (/v1/completions, /v1/chat/completions, ...)")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch threads per rank process; 0 divides the cores among them")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="KV cache budget per rank (CPU)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when a GPU is visible)")
    parser.add_argument("--dtype", default="auto",
                        help="float32, bfloat16, float16 or auto (bfloat16 on CUDA and on CPUs with native bf16)")
    parser.add_argument("--gpu-memory-fraction", type=float, default=0.0,
                        help=f"share of a GPU's memory each engine rank's KV cache takes; 0: {DEFAULT_KV_SHARE} "
                             "divided by the engine ranks sharing the GPU")
    parser.add_argument("--exclusive-gpus", action="store_true",
                        help="refuse a shape with more engine ranks than GPUs (default: engines then share "
                             "GPUs, ranks round-robin, the KV share split between them)")
    parser.add_argument("--plan", action="store_true",
                        help="print which GPU every rank of every engine takes and each engine's KV share, "
                             "start nothing, exit 0 (2 when the shape cannot be placed)")
    parser.add_argument("--gpus", type=int, default=None,
                        help="with --plan: pretend this many GPUs instead of probing the host")
    parser.add_argument("--kv-staging", default="none", choices=("none", "host"),
                        help="host: GPU KV moves through pinned host memory (when UCX has no CUDA transport)")
    parser.add_argument("--kv-staging-blocks", type=int, default=0,
                        help="with --kv-staging host: blocks of each rank's staging pool (0: the transfer window)")
    parser.add_argument("--kv-transport", default="ucx-tag", choices=("ucx-tag", "nixl"),
                        help="how decode ranks pull KV from prefill ranks: ucx-tag (tagged messages) or nixl "
                             "(one NIXL READ per pull; needs nixl-cu12); every engine uses it")
    parser.add_argument("--planner", choices=("off", "advise", "on"), default="off",
                        help="the scheduler's role planner: advise exports desired engines per role, on also "
                             "changes the running engines' roles (docs/decisions/0044)")
    parser.add_argument("--metrics", action="store_true", help="serve /metrics on a free port per process")
    parser.add_argument("--zmq-endpoint", default="", help="ZMQ PUB endpoint for vLLM-format KV events")
    parser.add_argument("--zmq-replay-endpoint", default="", help="ZMQ ROUTER replay endpoint (vLLM format)")
    parser.add_argument("--log-dir", default="", help="write each component's log to DIR/<name>.log")
    parser.add_argument("--tls", action="store_true",
                        help="mTLS on every channel with a throwaway CA (default: plaintext, loopback only)")
    parser.add_argument("--tls-dir", default="", help="where --tls writes its certificates (default: a temp dir)")
    parser.add_argument("--allow-plaintext", action="store_true",
                        help="explicit opt-in to plaintext on a non-loopback --host (prefer --tls)")
    parser.add_argument("--auth-tokens-file", default="",
                        help="bearer tokens required on Generate and KV events (see `pdserve scheduler --help`)")
    parser.add_argument("--log-level", default="INFO", help="logging level")
    parser.add_argument("--engine", default="native", choices=ENGINES,
                        help="engine backend of every prefill and decode engine (vllm: run from .venv-vllm)")
    parser.add_argument("--vllm-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="a vLLM engine argument for every engine (repeatable; with --engine vllm)")
    parser.add_argument("--block-size", type=int, default=0,
                        help="KV block size of the whole cluster; 0: 16, or 32 with --engine vllm (vLLM's CPU "
                             "attention needs a multiple of 32)")


def check_model_tp(args: argparse.Namespace) -> None:
    """Refuses (ValueError: exit 2, nothing started) a TP size the model's heads cannot split
    over, before any engine starts and fails (the supervisor would restart it forever). The
    native engine's rule is `ModelConfig.check_tp`; vLLM's is that TP divides the attention heads."""
    sizes = sorted({args.prefill_tp or args.tp, args.decode_tp or args.tp} - {1})
    if not sizes:
        return
    model_dir = Path(args.model) if args.model else demo_model_dir()
    source = "the demo model" if not args.model else args.model
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {source}: cannot read config.json ({e})") from None
    for tp in sizes:
        try:
            if args.engine == "native":
                ModelConfig.from_dict(raw, source=str(model_dir / "config.json")).check_tp(tp)
            elif int(raw.get("num_attention_heads", 0) or 0) % tp:
                raise ValueError(f"tp={tp} does not divide num_attention_heads={raw.get('num_attention_heads')}")
        except ValueError as e:
            raise ValueError(f"{source} cannot run at tensor-parallel size {tp}: {e}") from None


def spec_from_args(args: argparse.Namespace) -> ClusterSpec:
    if args.prefill < 0 or args.decode < 1 or args.tp < 1:
        raise ValueError("need --prefill >= 0, --decode >= 1 and --tp >= 1")
    if not 1 <= args.schedulers <= 8:
        raise ValueError(f"--schedulers must be in [1, 8], got {args.schedulers}")
    if args.prefill_tp < 0 or args.decode_tp < 0:
        raise ValueError("need --prefill-tp >= 1 and --decode-tp >= 1 (or 0: --tp)")
    if not (args.tls or args.allow_plaintext):
        try:
            check_plaintext("--host", args.host, tls=False, allow_plaintext=False)
        except ValueError:
            raise ValueError(f"--host {args.host} is not loopback: add --tls (or --allow-plaintext)") from None
    _check_engine(args.engine, args.vllm_arg)
    scheduler_args: list[str] = []
    engine_args: list[str] = []
    if args.allow_plaintext:
        scheduler_args.append("--allow-plaintext")
        engine_args.append("--allow-plaintext")
    if args.auth_tokens_file:
        scheduler_args += ["--auth-tokens-file", args.auth_tokens_file]
    if args.planner != "off":
        scheduler_args += ["--planner", args.planner]
    placement = gpu_placement(args)
    # Engines resolve auto the same way; only what differs from their defaults is passed on.
    if args.device != "auto" or placement.kind == "cuda":
        engine_args += ["--device", placement.kind]
    if args.dtype != "auto":
        engine_args += ["--dtype", args.dtype]
    if args.kv_staging != "none":
        engine_args += ["--kv-staging", args.kv_staging]
    if args.kv_staging_blocks:
        engine_args += ["--kv-staging-blocks", str(args.kv_staging_blocks)]
    if args.kv_transport != "ucx-tag":
        engine_args += ["--kv-transport", args.kv_transport]
    block_size = args.block_size or (VLLM_BLOCK_SIZE if args.engine == "vllm" else 0)
    if block_size:
        scheduler_args += ["--block-size", str(block_size)]
        engine_args += ["--block-size", str(block_size)]
    return ClusterSpec(model=args.model, num_prefill=args.prefill, num_decode=args.decode, tp=args.tp,
                       prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
                       engine_devices=placement.engine_devices,
                       engine_memory_fractions=placement.memory_fractions,
                       host=args.host, port=args.port, control_port=args.control_port,
                       events_port=args.events_port, http_port=args.http_port, metrics=args.metrics, torch_threads=args.torch_threads,
                       kv_cache_memory=args.kv_cache_memory, scheduler_args=scheduler_args,
                       log_dir=args.log_dir, tls=args.tls, tls_dir=args.tls_dir, engine_args=engine_args,
                       engine=args.engine, vllm_args=list(args.vllm_arg), num_schedulers=args.schedulers,
                       zmq_endpoint=args.zmq_endpoint, zmq_replay_endpoint=args.zmq_replay_endpoint)


def _check_engine(engine: str, vllm_args: list[str]) -> None:
    """Refuses an engine backend that cannot run here, or bad vLLM arguments, before anything starts."""
    from services.engine.registry import BackendUnavailable, check_backend

    if vllm_args and engine != "vllm":
        raise ValueError("--vllm-arg applies only with --engine vllm")
    check_vllm_args(parse_vllm_args(vllm_args))
    try:
        check_backend(engine)
    except BackendUnavailable as e:
        raise ValueError(str(e)) from None


@dataclass(frozen=True, slots=True)
class GpuPlacement:
    """Where `pdserve up` puts the engines: kind, dtype and, on CUDA, every rank's GPU."""

    kind: str
    dtype: str
    plan: PlacementPlan | None = None  # None on CPU
    pretended: bool = False  # the GPU count came from --gpus, not from the host

    @property
    def engine_devices(self) -> list[str]:
        return self.plan.engine_devices() if self.plan is not None else []

    @property
    def memory_fractions(self) -> list[float]:
        return self.plan.memory_fractions() if self.plan is not None else []

    def describe(self) -> str:
        if self.plan is None:
            return f"cpu, dtype {self.dtype}"
        busiest = max(len(self.plan.ranks_on(g)) for g in range(self.plan.num_gpus))
        shares = sorted(set(self.memory_fractions))
        return (f"cuda ({self.plan.num_gpus} GPU(s), up to {busiest} engine rank(s) per GPU, KV "
                f"{'/'.join(f'{f:.2f}' for f in shares)} of GPU memory per rank), dtype {self.dtype}")

    def render(self) -> list[str]:
        """What `pdserve up --plan` prints."""
        if self.plan is None:
            return [f"cpu, dtype {self.dtype}: every rank on the CPU"]
        source = "pretended by --gpus" if self.pretended else "visible"
        return [f"cuda, {self.plan.num_gpus} GPU(s) {source}, dtype {self.dtype}", *self.plan.render()]


def gpu_placement(args: argparse.Namespace, host: HostDevices | None = None) -> GpuPlacement:
    """Resolves --device / --dtype for the whole cluster and places every engine rank on the
    GPUs (services/placement.py) by its role's TP. Raises DeviceUnavailableError for --device
    cuda without CUDA and PlacementError for a shape the GPUs cannot hold (both ValueErrors:
    exit 2, no process started)."""
    if args.gpus is not None:
        if not args.plan:
            raise ValueError("--gpus pretends a GPU count; it needs --plan")
        if args.gpus < 0:
            raise ValueError(f"--gpus must be >= 0, got {args.gpus}")
        if args.gpus == 0 and args.device == "cuda":
            raise ValueError("--device cuda with --gpus 0: no GPU to place engines on")
        host = HostDevices(args.gpus, "pretended" if args.gpus else None, cpu_has_native_bf16())
    host = host if host is not None else probe_host()
    kind = resolve_kind(args.device, host)
    dtype = resolve_dtype(args.dtype, kind, host.native_bf16)
    pretended = args.gpus is not None
    if kind == "cpu":
        return GpuPlacement(kind, dtype, None, pretended)
    plan = plan_placement(host.num_gpus, args.prefill, args.decode, args.prefill_tp or args.tp,
                          args.decode_tp or args.tp, share_gpus=not args.exclusive_gpus,
                          memory_fraction=args.gpu_memory_fraction)
    return GpuPlacement(kind, dtype, plan, pretended)


def print_plan(args: argparse.Namespace) -> int:
    """`pdserve up --plan`: the placement, nothing started; a shape that cannot be placed raises
    (exit 2 with the reason)."""
    if args.prefill < 0 or args.decode < 1 or args.tp < 1 or args.prefill_tp < 0 or args.decode_tp < 0:
        raise ValueError("need --prefill >= 0, --decode >= 1 and --tp, --prefill-tp, --decode-tp >= 1")
    check_model_tp(args)  # a plan `up` would refuse to start is no plan
    placement = gpu_placement(args)
    print(f"pdserve up --plan: {args.prefill} prefill (tp {args.prefill_tp or args.tp}) and {args.decode} decode "
          f"(tp {args.decode_tp or args.tp}) engine(s)")
    for line in placement.render():
        print(f"  {line}")
    return 0


def print_endpoints(cluster: LocalCluster, args: argparse.Namespace, flags: str) -> None:
    """Every replica's endpoints; with replicas, the Generate line names them all (a client
    given the list retries on another replica when one dies)."""
    token_hint = "  (Authorization: Bearer <token>)" if args.auth_tokens_file else ""
    print(f"  Generate API   {cluster.targets}   (pdserve generate --target {cluster.targets}{flags} --prompt ...)")
    for r in cluster.replicas:
        tag = f"  [{r.name}]" if len(cluster.replicas) > 1 else ""
        host = args.host
        print(f"  OpenAI API     {cluster.replica_http_url(r)}   (base_url of any OpenAI client){token_hint}{tag}")
        print(f"  KV events      {host}:{r.events_port}   (pdserve events --target {host}:{r.events_port}{flags}){tag}")
        print(f"  control plane  {host}:{r.control_port}{tag}")
        if r.zmq_endpoint:
            replay = f" --zmq-replay {r.zmq_replay_endpoint}" if r.zmq_replay_endpoint else ""
            print(f"  ZMQ KV events  {r.zmq_endpoint}   (pdserve events --zmq {r.zmq_endpoint}{replay}){tag}")
        if len(cluster.replicas) > 1:
            print(f"  Generate API   {host}:{r.port}{tag}")


def run(args: argparse.Namespace) -> int:
    if args.plan:
        return print_plan(args)
    setup_logging(args.log_level, "up")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    spec = spec_from_args(args)
    check_model_tp(args)
    cluster = LocalCluster(spec)
    placement = gpu_placement(args)
    replicas = f"{args.schedulers} scheduler replicas" if args.schedulers > 1 else "scheduler"
    print(f"pdserve up: starting {replicas}, "
          f"{args.prefill} prefill (tp {cluster.role_tp('prefill')}) and {args.decode} decode "
          f"(tp {cluster.role_tp('decode')}) engine(s) on {placement.describe()} ...", flush=True)
    if placement.plan is not None:
        for line in placement.plan.render():
            print(f"  {line}")
    try:
        with cluster:
            flags = ""
            if cluster.pki is not None:
                p = cluster.pki
                flags = f" --tls-ca {p.ca_cert} --tls-cert {p.client_cert} --tls-key {p.client_key}"
                print(f"  mTLS           certificates in {p.directory}")
            if args.auth_tokens_file:
                flags += " --token-file <file with one of your tokens>"
            print_endpoints(cluster, args, flags)
            for comp in cluster.components.values():
                if comp.metrics_port:
                    print(f"  metrics        http://{args.host}:{comp.metrics_port}/metrics   ({comp.name})")
            print("Ctrl-C stops everything; a component that exits is restarted (with backoff).", flush=True)
            supervisor = Supervisor(cluster)
            while not stop.wait(0.5):
                supervisor.poll()
                if supervisor.failed:
                    print(f"pdserve up: {', '.join(supervisor.failed)} cannot bind a port it was given (in use); "
                          "stopping", file=sys.stderr, flush=True)
                    return EXIT_PORT_IN_USE
    except ComponentExited as e:
        print(f"pdserve up: {e}", file=sys.stderr, flush=True)
        return e.status if e.status == EXIT_PORT_IN_USE else 1
    print("pdserve up: stopped", flush=True)
    return 0
