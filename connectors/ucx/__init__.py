"""The `ucx` KV connector: decode ranks pull prompt KV from prefill ranks over UCX.

`handshake.py` (metadata, descriptor), `transport.py` (the transport interface),
`tag_transport.py` (UCX tagged messages), `worker.py` (`UcxWorkerConnector`, the worker side:
its reader half in `pull_side.py`, its writer half in `serve_side.py`, their shared state in
`worker_state.py`, settings in `config.py`, stats in `transfer_stats.py`), `scheduler.py`
(`UcxSchedulerConnector`, which carries the services' data-plane commands to every rank in the
step plan).
"""

from __future__ import annotations

from connectors.base import register_connector
from connectors.ucx.scheduler import UcxSchedulerConnector
from connectors.ucx.worker import UcxWorkerConnector

try:
    register_connector("ucx", UcxSchedulerConnector, UcxWorkerConnector)
except KeyError:
    pass  # re-imported under importlib.reload
