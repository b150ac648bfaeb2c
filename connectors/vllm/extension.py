"""`PdserveWorkerExtension`: what the engine service calls on every vLLM worker through
`AsyncLLM.collective_rpc` (vLLM mixes it into its worker class via `worker_extension_cls`).

On CPU vLLM always runs its workers in their own processes (its OMP set-up needs the
multi-process executor), so these calls reach only worker halves; the engine core's view (block
usage, running and waiting requests) reaches the engine service through vLLM's stat loggers.
"""

from __future__ import annotations

from typing import Any

from connectors.vllm import connector
from services.engine.control_client import EngineLoad


class PdserveWorkerExtension:
    def pdserve_eager_forward(self, eager: bool) -> int:
        """The start-up self-check's switch (connectors/vllm/greedy_check.py): with `eager`, every
        compiled module of this worker's model (vLLM's `support_torch_compile` modules, which
        call their eager `forward` while `do_not_compile` is set) runs eagerly; without, the ones
        this switched go back to their compiled graph. Answers how many modules it switched."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]  # the vLLM worker this is mixed into
        if eager:
            switched = [m for m in model.modules() if getattr(m, "do_not_compile", True) is False]
            for module in switched:
                module.do_not_compile = True
            self._pdserve_eager = switched
            return len(switched)
        switched = getattr(self, "_pdserve_eager", [])
        for module in switched:
            module.do_not_compile = False
        self._pdserve_eager = []
        return len(switched)

    def pdserve_connect(self) -> int:
        """Registers rank 0 with the pdserve scheduler once vLLM's engine runs."""
        for worker in connector.WORKER_HALVES:
            worker.connect()
        return len(connector.WORKER_HALVES)

    def pdserve_release(self, request_id: str) -> bool:
        """Ends a pinned prefill (the Release / Abort RPC); True if this rank held it."""
        return any(worker.release(request_id) for worker in connector.WORKER_HALVES)

    def pdserve_report_load(self, num_running: int, num_waiting: int, kv_usage: float, num_free_blocks: int,
                            draining: bool, role_epoch: int = 0) -> list[Any]:
        """Hands the engine's load to rank 0's next heartbeat and /metrics; answers [pinned
        prefills, pulls vLLM waits on, role changes] of this worker — the changes (role,
        role_epoch, reason) rank 0 took after role generation `role_epoch`, oldest first."""
        pinned = sum(worker.num_pinned() for worker in connector.WORKER_HALVES)
        pulling = sum(worker.num_pulling() for worker in connector.WORKER_HALVES)
        load = EngineLoad(num_running, num_waiting, kv_usage, pinned, num_free_blocks)
        roles: list[tuple[str, int, str]] = []
        for worker in connector.WORKER_HALVES:
            if worker.rank == 0:
                worker.report_load(load, draining)
                roles += worker.role_changes(role_epoch)
        return [pinned, pulling, roles]

    def pdserve_leaks(self) -> list[str]:
        """What the connector halves of this process still hold (empty when idle)."""
        leaks = []
        for worker in connector.WORKER_HALVES:
            leaks.extend(worker.leaks())
        for half in connector.SCHEDULER_HALVES:
            if half.num_tracked():
                leaks.append(f"scheduler half: {half.num_tracked()} requests tracked")
        return leaks
