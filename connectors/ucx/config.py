"""`UcxConnectorConfig`: the data-plane settings of the `ucx` connector (EngineConfig carries the
same names), validated before anything starts, and the UCX context options they imply."""

from __future__ import annotations

import os
from dataclasses import dataclass

from connectors.ucx.ep_info import TransportExpectation
from connectors.ucx.handshake import DEFAULT_KV_TRANSPORT, KV_TRANSPORTS

# CMA rendezvous makes the reader process_vm_readv() the writer's memory, and with endpoint
# error handling off (needed for shared memory at all) UCX aborts the reading process when the
# writer dies mid-read. Copy-in/copy-out through SysV shared memory is as fast on one host (two
# cores pipeline the copies) and a dead peer only stalls it, which our timeouts handle.
DEFAULT_UCX_TLS = "^cma"


@dataclass(slots=True)
class UcxConnectorConfig:
    """Data-plane settings (EngineConfig carries the same names).

    `ucx_tls` empty means UCX_TLS from the environment if set, else `DEFAULT_UCX_TLS`.
    `kv_staging` "host" moves KV through a bounded pool of host block slots (pinned for GPU KV,
    connectors/ucx/host_staging.py) instead of the KV tensor itself; "none" registers the
    tensor itself. `kv_staging_blocks`: the pool's slots (0: the transfer window,
    `max_inflight_transfers` x 16 blocks, at most the cache).
    `kv_transport` "ucx-tag" (`UcxTagTransport`: the writer sends tagged messages) or "nixl"
    (`NixlTransport`: the reader posts one NIXL READ per pull; needs nixl-cu12).
    `expected_transports` (e.g. "rdma"): a pull over a slower UCX transport is a fallback,
    counted and logged once per peer pair (connectors/ucx/ep_info.py); empty expects nothing.
    """

    transfer_timeout_s: float = 5.0
    lease_s: float = 30.0
    max_inflight_transfers: int = 64
    ucx_tls: str = ""
    ucx_net_devices: str = ""
    kv_staging: str = "none"
    kv_staging_blocks: int = 0
    kv_transport: str = DEFAULT_KV_TRANSPORT
    expected_transports: str = ""

    def validate(self) -> None:
        if self.transfer_timeout_s <= 0:
            raise ValueError("transfer_timeout_s: must be > 0")
        if self.lease_s <= 0:
            raise ValueError("lease_s: must be > 0")
        if self.max_inflight_transfers < 1:
            raise ValueError("max_inflight_transfers: must be >= 1")
        if self.kv_staging not in ("none", "host"):
            raise ValueError(f"kv_staging: must be none or host, got {self.kv_staging!r}")
        if self.kv_staging_blocks < 0:
            raise ValueError(f"kv_staging_blocks: must be >= 0 (0: the transfer window), got {self.kv_staging_blocks}")
        if self.kv_staging == "host" and self.kv_transport == "nixl":
            raise ValueError("kv_staging host moves KV through a pool the writer fills per request, which a NIXL "
                             "READ (addressed by the writer's KV blocks) cannot see: use --kv-transport ucx-tag")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport: must be one of {', '.join(KV_TRANSPORTS)}, got {self.kv_transport!r}")
        TransportExpectation.parse(self.expected_transports)

    def ucx_options(self) -> dict[str, str]:
        """UCX context options (UCX_ names without the prefix)."""
        options = {}
        if self.ucx_tls:
            options["TLS"] = self.ucx_tls
        elif "UCX_TLS" not in os.environ:
            options["TLS"] = DEFAULT_UCX_TLS
        if self.ucx_net_devices:
            options["NET_DEVICES"] = self.ucx_net_devices
        return options
