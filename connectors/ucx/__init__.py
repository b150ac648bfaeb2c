"""The `ucx` KV connector: decode ranks pull prompt KV from prefill ranks over UCX.

`connectors/ucx/handshake.py` (metadata, descriptor), `transport.py` (the transport interface),
`tag_transport.py` (UCX tagged messages), `worker.py` (`UcxWorkerConnector`, the worker side).
The data plane is driven by the services (add_peer / start_pull / expect_send), so the
registry's scheduler-side factory refuses with a clear message.
"""

from __future__ import annotations

from typing import Any

from connectors.base import SchedulerConnector, register_connector
from connectors.ucx.worker import UcxWorkerConnector


def _scheduler_side(**kwargs: Any) -> SchedulerConnector:
    raise NotImplementedError("the ucx connector has no scheduler-side half: the services drive pulls "
                              "(UcxWorkerConnector.start_pull / expect_send)")


try:
    register_connector("ucx", _scheduler_side, UcxWorkerConnector)
except KeyError:
    pass  # re-imported under importlib.reload
