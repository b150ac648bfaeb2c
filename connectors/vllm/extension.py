"""`PdserveWorkerExtension`: what the engine service calls on every vLLM worker through
`AsyncLLM.collective_rpc` (vLLM mixes it into its worker class via `worker_extension_cls`).

The scheduler half lives in the engine-core process; with vLLM's single-process executor
(tp 1) the worker shares that process, so the block pool's counts are read here too. With a
multi-process executor those answers are empty (the engine service then reports what it sees).
"""

from __future__ import annotations

from connectors.vllm import connector
from services.engine.control_client import EngineLoad


class PdserveWorkerExtension:
    def pdserve_connect(self) -> int:
        """Registers rank 0 with the pdserve scheduler once vLLM's engine runs."""
        for worker in connector.WORKER_HALVES:
            worker.connect()
        return len(connector.WORKER_HALVES)

    def pdserve_release(self, request_id: str) -> bool:
        """Ends a pinned prefill (the Release / Abort RPC); True if this rank held it."""
        return any(worker.release(request_id) for worker in connector.WORKER_HALVES)

    def pdserve_report_load(self, num_running: int, num_waiting: int, draining: bool) -> list[int]:
        """Sends the engine's load with rank 0's next heartbeat; answers [free blocks, blocks,
        pinned prefills, waiting for remote KV] as far as this process knows them."""
        free, total = self._block_counts()
        pinned = sum(worker.num_pinned() for worker in connector.WORKER_HALVES)
        pulling = sum(worker.num_pulling() for worker in connector.WORKER_HALVES)
        usage = 1.0 - free / total if total else 0.0
        for worker in connector.WORKER_HALVES:
            control = worker.agent.control if worker.agent is not None else None
            if worker.rank == 0 and control is not None:
                control.set_load(EngineLoad(num_running, num_waiting, usage, pinned, free), draining)
        return [free, total, pinned, pulling]

    def pdserve_leaks(self) -> list[str]:
        """What the connector halves of this process still hold (empty when idle)."""
        leaks = []
        for worker in connector.WORKER_HALVES:
            leaks.extend(worker.leaks())
        for half in connector.SCHEDULER_HALVES:
            if half.num_tracked():
                leaks.append(f"scheduler half: {half.num_tracked()} requests tracked")
        free, total = self._block_counts()
        if total and free != total:
            leaks.append(f"vLLM block pool: {total - free} of {total} blocks in use")
        return leaks

    @staticmethod
    def _block_counts() -> tuple[int, int]:
        for half in connector.SCHEDULER_HALVES:
            manager = half._kv_cache_manager
            if manager is not None:
                pool = manager.block_pool
                # vLLM keeps one null block out of the free queue for good.
                return int(pool.get_num_free_blocks()), int(pool.num_gpu_blocks) - 1
        return 0, 0
