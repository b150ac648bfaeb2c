"""Builds pdserve's own engine for the engine service: model, KV cache spec, every rank with
its `RankAgent`, the UCX scheduler connector and (with `--kv-offload-memory`) the CPU offload
tier. Blocking: run it off the event loop."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from connectors.offload import OffloadScheduler, build_offload
from connectors.ucx.scheduler import UcxSchedulerConnector
from engine.config import ModelConfig
from engine.demo_model import demo_model_dir
from engine.kv_cache import make_kv_cache_spec
from engine.llm_engine import LLMEngine, resolve_device, resolve_dtype
from engine.workers import DTYPES
from services.common.bound_ports import listen_port
from services.common.config import EngineConfig
from services.common.security import component_channel_security
from services.engine.rank_agent import RankAgent, RankAgentFactory, compatibility_hash

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class NativeEngine:
    """The parts the native backend drives: the engine, rank 0's agent, the connector."""

    engine: LLMEngine
    agent: RankAgent
    connector: UcxSchedulerConnector


def build_native_engine(cfg: EngineConfig, epoch: int, engine_address: str) -> NativeEngine:
    """Loads the model, allocates KV and starts every rank; nothing is registered yet
    (`agent.connect()` registers once the engine loop runs). Raises NixlUnavailable (naming the
    package) before any rank starts when --kv-transport nixl is set and nixl is not installed."""
    if cfg.kv_transport == "nixl":
        from connectors.ucx.nixl_transport import require_nixl

        require_nixl()
    model = cfg.model or str(demo_model_dir())
    # The same dtype and KV spec the engine will resolve, so the compatibility hash is its own.
    kind = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, kind)
    model_config = ModelConfig.from_dir(model, dtype=dtype, max_model_len=cfg.max_model_len)
    spec = make_kv_cache_spec(model_config, block_size=cfg.block_size, memory_bytes=cfg.kv_cache_bytes,
                              tp_size=cfg.tp, num_blocks=None, element_size=DTYPES[dtype].itemsize,
                              device_kind=kind)
    factory = RankAgentFactory(
        engine_id=cfg.engine_id, role=cfg.role, epoch=epoch, scheduler=cfg.scheduler,
        engine_address=engine_address, num_kv_heads=model_config.num_kv_heads,
        compat_hash=compatibility_hash(model_config, spec, cfg.hash_seed, cfg.kv_transport), hash_seed=cfg.hash_seed,
        block_size=cfg.block_size, transfer_timeout_s=cfg.transfer_timeout_s, lease_s=cfg.lease_s,
        max_inflight=cfg.max_inflight_transfers, ucx_tls=cfg.ucx_tls, ucx_net_devices=cfg.ucx_net_devices,
        expected_transports=cfg.expected_transports,
        kv_staging=cfg.kv_staging, kv_staging_blocks=cfg.kv_staging_blocks, kv_transport=cfg.kv_transport, dtype=dtype, device_kind=kind, metrics_port=cfg.metrics_port,
        metrics_any_port=listen_port("metrics_port", cfg.metrics_port, cfg.ephemeral_ports) == 0, ports_file=cfg.ports_file, security=component_channel_security(cfg))
    connector = UcxSchedulerConnector(cfg.block_size, offload=_offload_tier(cfg, factory, spec.block_nbytes))
    engine = LLMEngine(model, tp=cfg.tp, kv_cache_memory=cfg.kv_cache_memory, block_size=cfg.block_size,
                       max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                       max_model_len=cfg.max_model_len, dtype=cfg.dtype, device=cfg.device,
                       hash_seed=cfg.hash_seed, kv_medium=cfg.kv_medium, torch_threads=cfg.torch_threads,
                       rank_init=factory, scheduler_connector=connector, devices=cfg.devices,
                       gpu_memory_fraction=cfg.gpu_memory_fraction, tp_timeout_s=cfg.tp_timeout_s)
    agent = engine.workers.rank0.connector
    assert isinstance(agent, RankAgent)
    return NativeEngine(engine, agent, connector)


def _offload_tier(cfg: EngineConfig, factory: RankAgentFactory, block_nbytes: int) -> OffloadScheduler | None:
    """The CPU offload tier's scheduler half (and the ranks' half on `factory`), or None."""
    if cfg.kv_offload_bytes <= 0:
        return None
    medium = cfg.kv_medium or ("GPU" if resolve_device(cfg.device).startswith("cuda") else "CPU")
    offload, factory.offload = build_offload(
        memory_bytes=cfg.kv_offload_bytes, block_size=cfg.block_size, block_nbytes=block_nbytes,
        working_medium=medium, hash_seed=cfg.hash_seed)
    logger.info("CPU offload tier: %d blocks per rank (%s), medium %s", offload.num_cpu_blocks,
                cfg.kv_offload_memory, factory.offload.medium)
    return offload
