"""Component configuration: one dataclass per component, loaded from YAML, env and flags.

Precedence (lowest to highest): dataclass defaults < YAML file (`--config`) < environment
(`PDSERVE_<FIELD>` upper-cased, read only here) < command-line flags. Every field's `help`
metadata doubles as its CLI help; `validate()` raises ValueError naming the offending field.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from connectors.hashing import DEFAULT_HASH_SEED
from engine.byte_size import parse_size  # noqa: F401  (re-exported: services import it from here)
from services.common.bound_ports import parse_ephemeral
from services.common.scheduler_targets import parse_scheduler_targets
from services.common.security import TokenStore, check_plaintext, check_tls_files

ENV_PREFIX = "PDSERVE_"
C = TypeVar("C")

ENGINES = ("native", "vllm")  # engine backends (services/engine/registry.py loads them)
# vLLM engine arguments that pdserve derives from its own settings (so they always agree with
# the scheduler and the other engines): passing them as --vllm-arg is an error naming the flag.
VLLM_RESERVED_ARGS = {
    "model": "use --model", "tensor_parallel_size": "use --tp", "block_size": "use --block-size",
    "dtype": "use --dtype", "max_model_len": "use --max-model-len", "max_num_seqs": "use --max-num-seqs",
    "max_num_batched_tokens": "use --max-num-batched-tokens",
    "kv_transfer_config": "pdserve's own KV connector is always configured",
}
_VLLM_ARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

def opt(default: Any, help: str, **kw: Any) -> Any:
    """A config field with its CLI help."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass(slots=True)
class SchedulerConfig:
    """The central scheduler service (one per cluster)."""

    host: str = opt("127.0.0.1", "address every listener binds to")
    port: int = opt(50051, "client API port (Generation service)")
    control_port: int = opt(50052, "rank control-stream port (Control service)")
    events_port: int = opt(50053, "KV-event subscription port (KVEvents service)")
    metrics_port: int = opt(9400, "Prometheus /metrics port; 0 disables")
    http_port: int = opt(0, "OpenAI-compatible HTTP API port (/v1/completions, /v1/chat/completions, /v1/models, "
                            "/health, /metrics); same host, TLS and bearer tokens as the client API; 0 disables")
    ports_file: str = opt("", "append every port this process (and each rank) binds to this file, one JSON "
                              "line each (services/common/bound_ports.py): how `pdserve up` learns them")
    ephemeral_ports: str = opt("", "optional listeners to open on a port the OS picks where their port setting is 0 "
                                   "(comma list of http_port, metrics_port, health_port); the ports bound go to ports_file")
    model: str = opt("", "model directory (for the tokenizer); empty selects the demo model")
    block_size: int = opt(16, "KV block size in tokens; must match every engine")
    hash_seed: str = opt(DEFAULT_HASH_SEED, "block-hash seed (NONE_HASH); must match every engine")
    routing_policy: str = opt("prefix", "prefill routing policy: prefix, load or round_robin")
    decode_only_threshold: int = opt(0, "prompts shorter than this many tokens skip prefill")
    # Path policy (services/scheduler/path_policy.py): remote prefill + transfer or decode-local.
    path_policy: str = opt("cost", "per-request path: cost (predicted time, the default), threshold "
                                   "(uncached tokens on the decode engine) or remote (always disaggregated)")
    path_threshold_tokens: int = opt(256, "threshold path policy: decode-local below this many uncached tokens")
    path_decode_stall_steps: float = opt(2.0, "cost path policy: longest prefill a decode engine takes on (it "
                                              "stalls the requests decoding there), in measured inter-token gaps")
    path_decode_stall_budget_ms: float = opt(50.0, "cost path policy: the stall budget's floor (before any "
                                                   "inter-token gap is measured)")
    path_decode_load_ms: float = opt(2.0, "cost path policy: cost of one unit of decode-engine load")
    path_max_decode_kv_usage: float = opt(0.9, "decode engines at or above this KV usage get no new request "
                                               "while another is below it")
    path_ttft_target_ms: float = opt(0.0, "default TTFT target of requests that set none: the cost path policy "
                                          "then maximises requests meeting their targets; 0: none")
    path_itl_target_ms: float = opt(0.0, "default ITL target of requests that set none: no local prefill stalls "
                                         "a decode engine past it unless that meets more targets; 0: none")
    path_prior_prefill_us_per_token: float = opt(200.0, "cost path policy: prefill cost per token until measured")
    path_prior_transfer_us_per_token: float = opt(20.0, "cost path policy: transfer cost per token until measured")
    # Peer fetch (services/scheduler/peer_fetch.py, decision 0043): the engine computing a prompt
    # pulls a longer prefix cached on another engine instead of recomputing it.
    peer_fetch: str = opt("off", "KV reuse across engines: cost (fetch when the pair's predicted transfer beats "
                                 "recomputing and routing), always (whenever a peer holds more), off (the default)")
    peer_fetch_min_blocks: int = opt(2, "peer fetch: fewest blocks a peer must hold beyond the computing engine")
    peer_fetch_timeout_s: float = opt(5.0, "peer fetch: longest wait for the holder to pin its blocks; then the "
                                           "prompt is recomputed")
    planner: str = opt("off", "role planner (docs/decisions/0044): off, advise (export desired engines per role, "
                              "change nothing) or on (change the running engines' roles)")
    planner_interval_s: float = opt(5.0, "role planner: seconds between decisions")
    planner_window_s: float = opt(30.0, "role planner: finished requests of this many seconds are its load")
    planner_min_dwell_s: float = opt(20.0, "role planner: no role change within this many seconds of the last")
    planner_hysteresis: float = opt(0.1, "role planner: change only for this much more predicted goodput (relative)")
    slo_ttft_ms: float = opt(1000.0, "role planner: TTFT target of requests that set none")
    slo_itl_ms: float = opt(100.0, "role planner: inter-token latency target of requests that set none")
    default_deadline_s: float = opt(120.0, "deadline for requests that set none")
    max_queue_per_engine: int = opt(256, "in-flight requests per engine before RESOURCE_EXHAUSTED")
    prefill_failure_policy: str = opt("recompute", "on prefill failure: recompute (decode) or retry")
    heartbeat_interval_s: float = opt(1.0, "rank heartbeat interval")
    heartbeat_timeout_s: float = opt(5.0, "a rank silent this long is declared dead")
    multirank_cpu_heartbeat_timeout_s: float = opt(
        20.0, "a rank of a CPU engine of more than one rank (tp or pp > 1) silent this long is declared dead: its "
              "control thread shares the host's cores and its interpreter with the engine's compute and wakes "
              "seconds late under load; 0: heartbeat_timeout_s")
    peers: str = opt("", "the other scheduler replicas' KVEvents endpoints (comma list of host:port and/or "
                         "dns:NAME:PORT); a replica that starts while engines run takes its prefix index from one "
                         "of them and reports ready once converged; empty: ready at once")
    converge_timeout_s: float = opt(30.0, "longest wait for a peer's snapshot to complete the prefix index; "
                                          "then ready with what it has (a peer refusing this replica's token: "
                                          "never; it stays not ready)")
    peer_token_file: str = opt("", "file holding the bearer token this replica presents to its peers' KVEvents "
                                   "(first line); default: the first token with the events scope in "
                                   "auth_tokens_file / auth_tokens")
    max_prompt_tokens: int = opt(0, "longest accepted prompt; 0 means the model's max length")
    max_new_tokens: int = opt(4096, "largest accepted max_tokens")
    event_ring_size: int = opt(4096, "KV-event batches kept for replay")
    subscriber_buffer: int = opt(1024, "batches buffered per subscriber before it is resynced")
    zmq_endpoint: str = opt("", "optional ZMQ PUB endpoint speaking vLLM's KV-event format")
    zmq_replay_endpoint: str = opt("", "optional ZMQ ROUTER replay endpoint (vLLM format)")
    zmq_topic: str = opt("kv@{engine_id}@{model}", "ZMQ topic frame; {engine_id} and {model} are filled in")
    zmq_hwm: int = opt(100_000, "ZMQ PUB send high-water mark (messages)")
    medium_weights: str = opt("GPU=1.0,CPU=0.8,CPU_OFFLOAD=0.7,STORAGE=0.5",
                              "prefix routing weight per KV medium, NAME=WEIGHT,... (others 0.5)")
    prefix_load_weight: float = opt(0.25, "prefix routing: prompt blocks charged per unit of engine load")
    prefix_index_max_entries: int = opt(1_000_000, "prefix index bound, (block, engine, medium) entries; LRU beyond")
    default_max_tokens: int = opt(256, "max_tokens for requests that set none")
    max_migrations: int = opt(3, "decode-engine failures one request survives before UNAVAILABLE")
    max_prefill_attempts: int = opt(2, "prefill engines tried per request when prefill_failure_policy is retry")
    compatibility_hash: str = opt("", "required engine compatibility hash; empty: the first engine sets it")
    lease_s: float = opt(30.0, "prefill KV lease assumed when a descriptor states none")
    drain_timeout_s: float = opt(60.0, "longest SIGTERM drain (in-flight requests finish) before exiting")
    log_level: str = opt("INFO", "logging level")
    event_loop: str = opt("asyncio", "the process's event loop: asyncio (the standard library's) or uvloop "
                                     "(libuv's; measured no better for grpc aio here, docs/benchmarks.md)")
    # Security (services/common/security.py; docs/architecture.md "Security").
    tls_cert: str = opt("", "PEM certificate of the scheduler (server identity, and client identity towards engines)")
    tls_key: str = opt("", "PEM private key of tls_cert")
    tls_ca: str = opt("", "PEM CA bundle peers' certificates must chain to; tls_cert, tls_key, tls_ca turn TLS on")
    tls_server_name: str = opt("", "name expected in engines' server certificates (default: the address dialed)")
    tls_require_client_cert: bool = opt(False, "client API and KV events also require a client certificate "
                                               "(control streams always do under TLS)")
    tls_peer_name: str = opt("", "control streams only from certificates naming this (CN or DNS SAN); "
                                 "empty: any certificate of tls_ca")
    allow_plaintext: bool = opt(False, "explicit opt-in to plaintext gRPC on a non-loopback host")
    health_port: int = opt(0, "plaintext port serving only the gRPC health service (probes under TLS); 0 disables")
    auth_tokens_file: str = opt("", "bearer tokens, one per line: <token> [generate,events,admin] (no scopes: "
                                    "generate and events; admin: the /admin endpoints)")
    auth_tokens: str = opt("", "comma-separated bearer tokens (generate and events); prefer env PDSERVE_AUTH_TOKENS")
    max_message_bytes: int = opt(64 * 1024 * 1024, "largest gRPC message received or sent")
    max_streams_per_client: int = opt(1024, "concurrent Generate / Subscribe streams per client; 0 unbounded")
    rate_limit_rps: float = opt(0.0, "requests per second per client (client API, KV events); 0 disables")
    rate_limit_burst: int = opt(100, "burst allowed above rate_limit_rps")

    def validate(self) -> None:
        _require(self.routing_policy in ("prefix", "load", "round_robin"), "routing_policy",
                 f"must be prefix, load or round_robin, got {self.routing_policy!r}")
        _require(self.prefill_failure_policy in ("recompute", "retry"), "prefill_failure_policy",
                 f"must be recompute or retry, got {self.prefill_failure_policy!r}")
        _require(self.block_size >= 1, "block_size", "must be >= 1")
        _require(self.default_deadline_s > 0, "default_deadline_s", "must be > 0")
        _require(self.max_queue_per_engine >= 1, "max_queue_per_engine", "must be >= 1")
        _require(self.event_ring_size >= 1, "event_ring_size", "must be >= 1")
        _require(self.subscriber_buffer >= 1, "subscriber_buffer", "must be >= 1")
        _require(self.prefix_load_weight >= 0, "prefix_load_weight", "must be >= 0")
        _require(self.path_policy in ("cost", "threshold", "remote"), "path_policy",
                 f"must be cost, threshold or remote, got {self.path_policy!r}")
        _require(self.path_threshold_tokens >= 0, "path_threshold_tokens", "must be >= 0")
        _require(self.peer_fetch in ("cost", "always", "off"), "peer_fetch",
                 f"must be cost, always or off, got {self.peer_fetch!r}")
        _require(self.peer_fetch_min_blocks >= 1, "peer_fetch_min_blocks", "must be >= 1")
        _require(self.peer_fetch_timeout_s > 0, "peer_fetch_timeout_s", "must be > 0")
        _require(0 < self.path_max_decode_kv_usage <= 1, "path_max_decode_kv_usage", "must be in (0, 1]")
        for name in ("path_decode_stall_steps", "path_decode_stall_budget_ms", "path_decode_load_ms", "path_ttft_target_ms",
                     "path_itl_target_ms", "path_prior_prefill_us_per_token", "path_prior_transfer_us_per_token"):
            _require(getattr(self, name) >= 0, name, "must be >= 0")
        _require(self.planner in ("off", "advise", "on"), "planner", f"must be off, advise or on, got {self.planner!r}")
        for name in ("planner_interval_s", "planner_window_s", "slo_ttft_ms", "slo_itl_ms"):
            _require(getattr(self, name) > 0, name, "must be > 0")
        for name in ("planner_min_dwell_s", "planner_hysteresis"):
            _require(getattr(self, name) >= 0, name, "must be >= 0")
        _require(self.prefix_index_max_entries >= 1, "prefix_index_max_entries", "must be >= 1")
        _require(self.event_loop in ("uvloop", "asyncio"), "event_loop",
                 f"must be uvloop or asyncio, got {self.event_loop!r}")
        for name in ("port", "control_port", "events_port", "metrics_port", "health_port", "http_port"):
            _require(0 <= getattr(self, name) < 65536, name, "must be a TCP port (0..65535)")
        parse_ephemeral(self.ephemeral_ports)
        _validate_security(self, [("host", self.host)])
        _require(self.max_streams_per_client >= 0, "max_streams_per_client", "must be >= 0")
        _require(self.converge_timeout_s > 0, "converge_timeout_s", "must be > 0")
        _require(self.rate_limit_rps >= 0, "rate_limit_rps", "must be >= 0")
        _require(self.rate_limit_burst >= 1, "rate_limit_burst", "must be >= 1")
        if self.auth_tokens:
            TokenStore.from_config("", self.auth_tokens)


@dataclass(slots=True)
class EngineConfig:
    """A prefill or decode engine (rank 0 serves the Engine API; --tp ranks in all)."""

    role: str = opt("prefill", "prefill or decode")
    engine: str = opt("native", "engine backend: native (pdserve's own engine) or vllm (vLLM's async engine; "
                                "needs `make install-vllm` and .venv-vllm/bin/pdserve)")
    vllm: dict[str, Any] = opt({}, "a vLLM engine argument KEY=VALUE (repeatable; VALUE is read as YAML, e.g. "
                                   "enforce_eager=true); the YAML config's `vllm:` section sets them too; only "
                                   "with --engine vllm", flag="vllm-arg")
    vllm_self_check: bool = opt(True, "with --engine vllm: at start, greedy tokens of a few short prompts on vLLM's "
                                      "serving path (its compiled model) against the same model run eagerly; an "
                                      "engine whose tokens differ refuses to start with the reason (skipped when "
                                      "vLLM runs the model eagerly, pdserve's CPU default)")
    engine_id: str = opt("", "stable engine id; default <role>-<hostname>")
    model: str = opt("", "model directory; empty selects the demo model")
    scheduler: str = opt("127.0.0.1:50052", "scheduler control address host:port; with replicas a comma list, "
                                            "or dns:NAME:PORT (every address NAME resolves to, re-resolved "
                                            "periodically: a Kubernetes headless Service)")
    host: str = opt("127.0.0.1", "address the Engine API binds to")
    advertise_host: str = opt("", "address peers use to reach this engine; default --host")
    port: int = opt(0, "Engine API port; 0 picks a free port")
    metrics_port: int = opt(0, "Prometheus /metrics port of rank 0 (rank r serves on port + r); 0 disables")
    ports_file: str = opt("", "append every port this process (and each rank) binds to this file, one JSON "
                              "line each (services/common/bound_ports.py): how `pdserve up` learns them")
    ephemeral_ports: str = opt("", "optional listeners to open on a port the OS picks where their port setting is 0 "
                                   "(comma list of metrics_port, health_port); the ports bound go to ports_file")
    tp: int = opt(1, "tensor-parallel size (rank processes)")
    dtype: str = opt("auto", "float32, bfloat16, float16 or auto (bfloat16 on CUDA and on CPUs with native bf16, "
                             "else float32)")
    device: str = opt("auto", "cpu, cuda or auto (cuda when a GPU is visible)")
    devices: str = opt("", "GPU indices of the ranks, e.g. 2,3 (rank r takes the r-th; indices among "
                           "CUDA_VISIBLE_DEVICES); empty: rank r takes GPU r")
    gpu_memory_fraction: float = opt(0.0, "share of each rank's GPU memory its KV cache takes, e.g. 0.4 when "
                                          "two engines share a GPU (CUDA only); 0: use kv_cache_memory")
    kv_staging: str = opt("none", "KV pulls of GPU memory: none (UCX CUDA transports, fail at start if missing) "
                                  "or host (bounce through a bounded pinned pool of kv_staging_blocks, slower, "
                                  "measured and labelled)")
    kv_staging_blocks: int = opt(0, "with kv_staging host: blocks of each rank's pinned staging pool, the only "
                                    "memory UCX registers (0: the transfer window, max_inflight_transfers x 16, at "
                                    "most the cache)")
    kv_cache_memory: str = opt("256MiB", "KV cache memory budget per rank (e.g. 512MiB, 8GiB)")
    block_size: int = opt(16, "KV block size in tokens; must match the scheduler")
    hash_seed: str = opt(DEFAULT_HASH_SEED, "block-hash seed; must match the scheduler")
    max_num_seqs: int = opt(64, "most requests running at once")
    max_num_batched_tokens: int = opt(2048, "token budget per engine step")
    max_model_len: int = opt(0, "longest sequence; 0 means the model's config")
    torch_threads: int = opt(0, "torch intra-op threads per rank; 0 lets pdserve choose")
    kv_medium: str = opt("", "medium name of the working KV cache in events; default GPU or CPU")
    kv_offload_memory: str = opt("0", "host-memory budget per rank of the CPU offload tier (e.g. 1GiB): "
                                      "finished blocks are copied there and loaded back on a prefix hit; "
                                      "0 turns the tier off")
    kv_transport: str = opt("ucx-tag", "how decode ranks pull KV: ucx-tag (the prefill rank sends tagged "
                                       "messages) or nixl (the decode rank posts one NIXL READ per pull, the "
                                       "prefill rank passive; needs nixl-cu12; host KV only); every engine of "
                                       "a cluster must use the same")
    ucx_tls: str = opt("", "UCX_TLS for the KV data plane (empty: UCX's choice)")
    ucx_net_devices: str = opt("", "UCX_NET_DEVICES for the KV data plane")
    expected_transports: str = opt("", "UCX transports KV pulls are expected to use, e.g. rdma (or tcp, shm, "
                                       "cuda, or UCX names such as rc_mlx5); a pull over a slower one is counted "
                                       "(pdserve_transfer_transport_fallbacks_total) and logged once per peer "
                                       "pair; empty expects nothing")
    transfer_timeout_s: float = opt(5.0, "a KV pull not finished in this time fails")
    tp_timeout_s: float = opt(300.0, "longest wait of one collective between an engine's TP ranks (a step's "
                                     "all-reduce, a plan); idle ranks are kept alive, so idling is unbounded")
    lease_s: float = opt(30.0, "prefill blocks not pulled within the lease are freed")
    max_inflight_transfers: int = opt(64, "concurrent KV pulls per decode rank")
    drain_timeout_s: float = opt(60.0, "longest SIGTERM drain before exiting")
    log_level: str = opt("INFO", "logging level")
    # Security (services/common/security.py; docs/architecture.md "Security").
    tls_cert: str = opt("", "PEM certificate of this engine (Engine API server identity, control-stream client identity)")
    tls_key: str = opt("", "PEM private key of tls_cert")
    tls_ca: str = opt("", "PEM CA bundle peers' certificates must chain to; tls_cert, tls_key, tls_ca turn TLS on")
    tls_server_name: str = opt("", "name expected in the scheduler's certificate (default: the address dialed)")
    tls_peer_name: str = opt("", "Engine API calls only from certificates naming this (CN or DNS SAN); "
                                 "empty: any certificate of tls_ca")
    allow_plaintext: bool = opt(False, "explicit opt-in to plaintext gRPC on a non-loopback host or scheduler")
    health_port: int = opt(0, "plaintext port serving only the gRPC health service (probes under TLS); 0 disables")
    max_message_bytes: int = opt(64 * 1024 * 1024, "largest gRPC message received or sent")

    def validate(self) -> None:
        _require(self.role in ("prefill", "decode"), "role", f"must be prefill or decode, got {self.role!r}")
        _require(self.engine in ENGINES, "engine", f"must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        _require(not self.vllm or self.engine == "vllm", "vllm",
                 f"vLLM engine arguments apply only with --engine vllm (got {sorted(self.vllm)})")
        check_vllm_args(self.vllm)
        _require(self.tp >= 1, "tp", "must be >= 1")
        _require(self.block_size >= 1, "block_size", "must be >= 1")
        _require(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
                 f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        _require(self.device in ("auto", "cpu", "cuda"), "device", f"must be auto, cpu or cuda, got {self.device!r}")
        _require(0.0 <= self.gpu_memory_fraction < 1.0, "gpu_memory_fraction", "must be in [0, 1)")
        _require(self.kv_staging in ("none", "host"), "kv_staging", f"must be none or host, got {self.kv_staging!r}")
        _require(self.kv_staging_blocks >= 0, "kv_staging_blocks", "must be >= 0 (0: the transfer window)")
        _require(self.kv_staging == "none" or self.kv_transport == "ucx-tag", "kv_staging",
                 "host staging moves KV with --kv-transport ucx-tag only (a NIXL READ addresses the KV itself)")
        _require(self.kv_transport in ("ucx-tag", "nixl"), "kv_transport",
                 f"must be ucx-tag or nixl, got {self.kv_transport!r}")
        _require(self.kv_transport == "ucx-tag" or self.engine == "native", "kv_transport",
                 f"{self.kv_transport} is wired up for the native engine only; use ucx-tag with --engine vllm")
        try:
            from connectors.ucx.ep_info import TransportExpectation

            TransportExpectation.parse(self.expected_transports)
        except ValueError as e:
            raise ValueError(f"expected_transports: {e}") from None
        try:
            from engine.device import parse_devices

            parse_devices(self.devices)
        except ValueError as e:
            raise ValueError(f"devices: {e}") from None
        _require(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _require(self.max_num_batched_tokens >= self.block_size, "max_num_batched_tokens",
                 "must be >= block_size")
        _require(self.transfer_timeout_s > 0, "transfer_timeout_s", "must be > 0")
        _require(self.tp_timeout_s > 0, "tp_timeout_s", "must be > 0")
        _require(self.lease_s > 0, "lease_s", "must be > 0")
        try:
            parse_size(self.kv_cache_memory)
        except ValueError as e:
            raise ValueError(f"kv_cache_memory: {e}") from None
        try:
            parse_size(self.kv_offload_memory)
        except ValueError as e:
            raise ValueError(f"kv_offload_memory: {e}") from None
        schedulers = [("scheduler", t.host) for t in parse_scheduler_targets(self.scheduler)]
        _validate_security(self, [("host", self.host), *schedulers])
        _require(0 <= self.health_port < 65536, "health_port", "must be a TCP port (0..65535)")
        parse_ephemeral(self.ephemeral_ports, frozenset({"metrics_port", "health_port"}))

    @property
    def kv_cache_bytes(self) -> int:
        return parse_size(self.kv_cache_memory)

    @property
    def kv_offload_bytes(self) -> int:
        """Per-rank CPU offload tier budget; 0 = no tier."""
        return parse_size(self.kv_offload_memory)


def check_vllm_args(args: Mapping[str, Any]) -> None:
    """Raises ValueError for a vLLM argument name that is malformed or that pdserve sets itself."""
    for key in args:
        _require(bool(_VLLM_ARG_NAME.fullmatch(str(key))), "vllm",
                 f"{key!r} is not a vLLM engine argument name (letters, digits, _ or -)")
        owner = VLLM_RESERVED_ARGS.get(str(key))
        _require(owner is None, "vllm", f"{key} is set by pdserve: {owner}")


def parse_vllm_args(value: Any) -> dict[str, Any]:
    """vLLM engine arguments from a YAML mapping, `KEY=VALUE` flags (a list) or the environment
    (`PDSERVE_VLLM`, a YAML mapping such as `{enforce_eager: true}`); names use `_` for `-`."""
    if isinstance(value, str):
        value = yaml.safe_load(value) if value.strip() else {}
    if isinstance(value, (list, tuple)):
        value = dict(_split_vllm_arg(item) for item in value)
    if not isinstance(value, Mapping):
        raise ValueError(f"vllm: expected a mapping of vLLM engine arguments, got {value!r}")
    return {str(k).replace("-", "_"): v for k, v in value.items()}


def _split_vllm_arg(item: str) -> tuple[str, Any]:
    key, sep, text = str(item).partition("=")
    if not sep or not key.strip():
        raise ValueError(f"vllm: expected KEY=VALUE, got {item!r}")
    if not text.strip():
        raise ValueError(f"vllm: {key.strip()} has no value (KEY=VALUE)")
    try:
        return key.strip(), yaml.safe_load(text)
    except yaml.YAMLError:
        raise ValueError(f"vllm: {key.strip()}: cannot read {text!r} as a YAML value") from None


def _validate_security(config: SchedulerConfig | EngineConfig, hosts: list[tuple[str, str]]) -> None:
    check_tls_files(config.tls_cert, config.tls_key, config.tls_ca)
    for name, host in hosts:
        check_plaintext(name, host, tls=bool(config.tls_cert), allow_plaintext=config.allow_plaintext)
    _require(config.max_message_bytes >= 1024, "max_message_bytes", "must be >= 1024")


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


def _field_type(cls: type, f: dataclasses.Field[Any]) -> type:
    hints = typing.get_type_hints(cls)
    t = hints[f.name]
    if isinstance(t, types.UnionType):
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return typing.get_origin(t) or t


def _coerce(cls: type, f: dataclasses.Field[Any], value: Any) -> Any:
    t = _field_type(cls, f)
    if t is dict:
        return parse_vllm_args(value)
    if t is bool and isinstance(value, str):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{f.name}: not a boolean: {value!r}")
    try:
        return t(value)
    except (TypeError, ValueError):
        raise ValueError(f"{f.name}: expected {t.__name__}, got {value!r}") from None


def _put(cls: type, values: dict[str, Any], f: dataclasses.Field[Any], value: Any) -> None:
    """A later source replaces a setting; a mapping setting (`vllm`) is merged key by key."""
    if _field_type(cls, f) is dict:
        values[f.name] = {**values.get(f.name, {}), **_coerce(cls, f, value)}
    else:
        values[f.name] = value


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds `--config FILE` and one `--<field>` flag per dataclass field (help from metadata)."""
    parser.add_argument("--config", metavar="FILE", help="YAML file with these settings (flags win)")
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{f.metadata.get('help', '')} (default: {f.default!r})"
        if _field_type(cls, f) is dict:
            parser.add_argument("--" + f.metadata.get("flag", flag[2:]), dest=f.name, default=None, action="append",
                                metavar="KEY=VALUE", help=f.metadata.get("help", ""))
        elif _field_type(cls, f) is bool:
            parser.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction,
                                help=help_text)
        else:
            parser.add_argument(flag, dest=f.name, default=None, metavar=f.name.upper(), help=help_text)


def load_config(cls: type[C], args: argparse.Namespace | None = None, *, yaml_path: str | None = None,
                env: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None) -> C:
    """Builds and validates a config from defaults, YAML, env and parsed flags."""
    env = os.environ if env is None else env
    names = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    path = yaml_path or (getattr(args, "config", None) if args is not None else None)
    if path:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of settings")
        for key, value in data.items():
            key = key.replace("-", "_")
            if key not in names:
                raise ValueError(f"{path}: unknown setting {key!r}")
            _put(cls, values, names[key], value)
    for name in names:
        env_value = env.get(ENV_PREFIX + name.upper())
        if env_value is not None:
            _put(cls, values, names[name], env_value)
    if args is not None:
        for name in names:
            flag_value = getattr(args, name, None)
            if flag_value is not None:
                _put(cls, values, names[name], flag_value)
    for key, value in (overrides or {}).items():
        values[key] = value
    coerced = {k: _coerce(cls, names[k], v) for k, v in values.items()}
    config = cls(**coerced)
    config.validate()  # type: ignore[attr-defined]
    return config
