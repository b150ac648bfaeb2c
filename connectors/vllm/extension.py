"""`PdserveWorkerExtension`: what the engine service calls on every vLLM worker through
`AsyncLLM.collective_rpc` (vLLM mixes it into its worker class via `worker_extension_cls`).

On CPU vLLM always runs its workers in their own processes (its OMP set-up needs the
multi-process executor), so these calls reach only worker halves; the engine core's view (block
usage, running and waiting requests) reaches the engine service through vLLM's stat loggers.
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

    def pdserve_report_load(self, num_running: int, num_waiting: int, kv_usage: float, num_free_blocks: int,
                            draining: bool) -> list[int]:
        """Hands the engine's load to rank 0's next heartbeat and /metrics; answers [pinned
        prefills, pulls vLLM waits on] of this worker."""
        pinned = sum(worker.num_pinned() for worker in connector.WORKER_HALVES)
        pulling = sum(worker.num_pulling() for worker in connector.WORKER_HALVES)
        load = EngineLoad(num_running, num_waiting, kv_usage, pinned, num_free_blocks)
        for worker in connector.WORKER_HALVES:
            if worker.rank == 0:
                worker.report_load(load, draining)
        return [pinned, pulling]

    def pdserve_leaks(self) -> list[str]:
        """What the connector halves of this process still hold (empty when idle)."""
        leaks = []
        for worker in connector.WORKER_HALVES:
            leaks.extend(worker.leaks())
        for half in connector.SCHEDULER_HALVES:
            if half.num_tracked():
                leaks.append(f"scheduler half: {half.num_tracked()} requests tracked")
        return leaks
