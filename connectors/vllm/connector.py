"""`PdserveConnector`: the facade vLLM loads (`kv_connector_module_path="connectors.vllm.connector"`).

It only translates between vLLM's `KVConnectorBase_V1` API and pdserve's two halves:
`VllmSchedulerHalf` (role SCHEDULER, in the engine core) and `VllmWorkerHalf` (role WORKER, in
each worker rank). `kv_connector_extra_config` is a `PdserveConnectorConfig`; `kv_role` must be
`kv_both` (the pdserve scheduler, not the config, decides who prefills and who decodes).

KV layout: vLLM resolves one physical layout per engine from its attention backends' supported
sets; the connector states a preference (`get_required_kvcache_layout`): block-outermost BHLNC
off the CPU (a run of blocks, or a head range of it, is one contiguous range; vLLM drops the
preference with a warning where a backend cannot take it), none on the CPU, whose attention
takes LBHNC only. The worker half registers whatever was allocated (`kv_region.py`).

Refused at start, with the reason: more than one KV cache group (hybrid attention / Mamba, or
sliding-window layers under vLLM's hybrid allocator) and groups that are not full attention
(sliding-window or chunked-local blocks are freed behind the window, so a prefill's block list
would not hold its whole prompt's KV). A model mixing sliding and full layers is served: the
connector does not declare vLLM's `SupportsHMA`, so vLLM turns its hybrid allocator off and
keeps every layer's KV in one full-attention group (the sliding layers still attend within
their window; tests/vllm/test_vllm_sliding_window.py).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from connectors.vllm.params import REFUSAL_FILE_ENV, PdserveConnectorConfig, PdserveConnectorMetadata
from connectors.vllm.scheduler import VllmSchedulerHalf
from connectors.vllm.worker import ModelShape, VllmWorkerHalf

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# The halves of this process, for the worker extension (`extension.py`) and the engine service's
# inspection: vLLM creates the connectors, pdserve needs to reach them.
SCHEDULER_HALVES: list[VllmSchedulerHalf] = []
WORKER_HALVES: list[VllmWorkerHalf] = []


PREFERRED_GPU_LAYOUT = "BHLNC"


def _check_kv_cache_groups(kv_cache_config: KVCacheConfig | None) -> None:
    """Raises ValueError, naming why, for KV the connector cannot move whole."""
    if kv_cache_config is None:
        return
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) > 1:
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        raise ValueError(f"PdserveConnector moves one KV cache group; this model has {len(groups)} ({', '.join(kinds)}: "
                         "hybrid attention, Mamba or sliding-window layers). Serve it colocated, or with a vLLM "
                         "connector that transfers per group")
    for group in groups:
        spec = group.kv_cache_spec
        if isinstance(spec, FullAttentionSpec):
            continue
        reason = f"PdserveConnector moves full-attention KV only; this model's cache is {type(spec).__name__}"
        if isinstance(spec, SlidingWindowSpec):
            window = spec.sliding_window
            raise ValueError(f"{reason}, whose blocks behind the {window}-token window are freed (a prefill's blocks "
                             "would not hold its whole prompt's KV). Serve it colocated, or with "
                             f"--vllm-arg disable_sliding_window=true and --max-model-len {window} or less (full "
                             "attention; vLLM caps the context at the window)")
        raise ValueError(f"{reason} (not every prompt token's KV is kept in its blocks). Serve it colocated")


def _report_refusal(reason: str) -> None:
    """Leaves `reason` where the engine service reads it (`REFUSAL_FILE_ENV`), if it asked."""
    path = os.environ.get(REFUSAL_FILE_ENV)
    if path:
        try:
            with open(path, "w") as f:
                f.write(reason)
        except OSError:
            logger.warning("could not write the start refusal to %s", path)


class PdserveMetadata(PdserveConnectorMetadata, KVConnectorMetadata):
    """The step plan as vLLM's metadata type."""


def model_shape(vllm_config: VllmConfig) -> ModelShape:
    m = vllm_config.model_config
    architectures = getattr(m.hf_config, "architectures", None) or ["unknown"]
    return ModelShape(architecture=str(architectures[0]), vocab_size=int(m.get_vocab_size()),
                      hidden_size=int(m.get_hidden_size()), num_layers=int(m.get_num_layers(vllm_config.parallel_config)),
                      num_kv_heads=int(m.get_total_num_kv_heads()), head_dim=int(m.get_head_size()),
                      dtype=str(m.dtype).removeprefix("torch."))


class PdserveConnector(KVConnectorBase_V1):
    """pdserve's KV connector for vLLM v1 (see the package docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        if transfer.kv_role != "kv_both":
            raise ValueError(f"PdserveConnector needs kv_role kv_both, got {transfer.kv_role!r}")
        self.config = PdserveConnectorConfig.from_extra(transfer.kv_connector_extra_config)
        try:
            _check_kv_cache_groups(kv_cache_config)
        except ValueError as e:
            _report_refusal(str(e))
            raise
        self._vllm_config = vllm_config
        self._num_blocks = int(kv_cache_config.num_blocks) if kv_cache_config is not None else None
        block_size = int(vllm_config.cache_config.block_size)
        shape = model_shape(vllm_config)
        self._scheduler: VllmSchedulerHalf | None = None
        self._worker: VllmWorkerHalf | None = None
        self._invalid: set[int] = set()
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = VllmSchedulerHalf(self.config, block_size=block_size,
                                                tp_size=vllm_config.parallel_config.tensor_parallel_size,
                                                num_kv_heads=shape.num_kv_heads)
            SCHEDULER_HALVES.append(self._scheduler)
        else:
            from vllm.distributed.parallel_state import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            self._worker = VllmWorkerHalf(self.config, rank=get_tensor_model_parallel_rank(),
                                          tp_size=get_tensor_model_parallel_world_size(), model=shape,
                                          block_size=block_size)
            WORKER_HALVES.append(self._worker)

    # -- worker side ----------------------------------------------------------------------------

    def _w(self) -> VllmWorkerHalf:
        assert self._worker is not None, "worker-side call on the scheduler-side connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w().register_kv_caches(kv_caches, num_blocks=self._num_blocks,
                                     layout_name=self._vllm_config.cache_config.kv_cache_layout)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Block-outermost (BHLNC) where the platform's attention may take it (see the module docstring)."""
        from vllm.platforms import current_platform

        return None if current_platform.is_cpu() else PREFERRED_GPU_LAYOUT

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdserveConnectorMetadata)
        self._w().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: KV arrives before vLLM schedules the request."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing per layer: finished prompts are gathered whole in `wait_for_save`."""

    def wait_for_save(self) -> None:
        self._w().wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done = self._w().take_finished()
        self._invalid |= done.invalid_block_ids
        return KVConnectorTransferResults(finished_sending=done.finished_sending,
                                          finished_recving=done.finished_recving,
                                          failed_recving=done.failed_recving)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    # -- scheduler side -------------------------------------------------------------------------

    def _s(self) -> VllmSchedulerHalf:
        assert self._scheduler is not None, "scheduler-side call on a worker-side connector"
        return self._scheduler

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._s().bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        self._s().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._s().update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        plan = self._s().build_connector_meta(scheduler_output)
        return PdserveMetadata(plan.sends, plan.pulls, plan.cancels)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._s().update_connector_output(connector_output.finished_recving)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request)

    def has_pending_block_frees(self) -> bool:
        return False
