"""The torch-free contract between the engine service and both halves of `PdserveConnector`.

- `PdserveConnectorConfig`: what the engine service puts in vLLM's
  `kv_transfer_config.kv_connector_extra_config` (engine identity, epoch, scheduler address,
  data-plane settings, the ZMQ endpoint of vLLM's KV-event publisher).
- Per-request `kv_transfer_params` (vLLM's `SamplingParams.extra_args["kv_transfer_params"]`):
  a prefill request carries `{"do_remote_decode": True, "pdserve_request_id": id,
  "pdserve_reader_tp": decode TP}` and gets back
  the transfer descriptor (`descriptor_to_params`) when it finishes; a decode request carries
  `{"do_remote_prefill": True, "pdserve_request_id": id, **descriptor}`.
- `PdserveConnectorMetadata`: the per-step plan the scheduler half hands every worker rank
  (pins, pulls, cancels). vLLM's internal request id (the pdserve id plus a random suffix) is
  what vLLM's own bookkeeping uses; the pdserve id is what the data plane and the pdserve
  scheduler see, so both travel together.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from connectors.ucx.handshake import KVTransferDescriptor

# vLLM runs the connector in its engine-core process and reports a failed start only as "Engine
# core initialization failed": the connector writes why it refused to the file this variable
# names (set by `VllmEngine.start`), which the engine service reads back.
REFUSAL_FILE_ENV = "PDSERVE_VLLM_REFUSAL_FILE"

REMOTE_DECODE = "do_remote_decode"
REMOTE_PREFILL = "do_remote_prefill"
PDSERVE_ID = "pdserve_request_id"
READER_TP = "pdserve_reader_tp"  # a prefill's: the TP of the engine that will read its KV (0: this engine's)
_DESCRIPTOR_KEYS = ("engine_id", "epoch", "block_ids", "num_tokens", "tp_size", "block_size", "num_kv_heads",
                    "lease_expires_unix_ms")


@dataclass(slots=True)
class PdserveConnectorConfig:
    """`kv_connector_extra_config` of a vLLM engine behind pdserve (every field has a default
    so a partial dict names only what differs; `from_extra` rejects unknown keys)."""

    engine_id: str = ""
    role: str = "prefill"  # prefill or decode
    epoch: int = 0
    scheduler: str = "127.0.0.1:50052"
    engine_address: str = ""
    hash_seed: str = "0"
    transfer_timeout_s: float = 5.0
    lease_s: float = 30.0
    max_inflight_transfers: int = 64
    ucx_tls: str = ""
    ucx_net_devices: str = ""
    metrics_port: int = 0
    metrics_any_port: bool = False  # metrics_port 0: each rank serves /metrics on a port the OS picks
    ports_file: str = ""  # where each rank reports its ports (services/common/bound_ports.py)
    events_endpoint: str = ""  # vLLM's ZMQ KV-event PUB, read by rank 0; empty: no block-pool events
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""
    # "none": vLLM's KV is registered in place; "host": a bounded pool of block-major slots is
    # (CPU only), blocks copied in and out per transfer (the measured fallback,
    # `pdserve_engine_kv_mirror_bytes`); `kv_staging_blocks` its slots (0: the transfer window).
    kv_staging: str = "none"
    kv_staging_blocks: int = 0

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> PdserveConnectorConfig:
        """Parses and validates the extra config; raises ValueError naming the bad key."""
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"PdserveConnector: unknown kv_connector_extra_config keys {unknown}")
        config = cls(**extra)
        config.validate()
        return config

    def validate(self) -> None:
        if not self.engine_id:
            raise ValueError("PdserveConnector: engine_id must be set")
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"PdserveConnector: role must be prefill or decode, got {self.role!r}")
        if not 0 < self.epoch < 1 << 64:
            raise ValueError(f"PdserveConnector: epoch must be a non-zero 64-bit id, got {self.epoch}")
        if self.transfer_timeout_s <= 0 or self.lease_s <= 0:
            raise ValueError("PdserveConnector: transfer_timeout_s and lease_s must be > 0")
        if self.max_inflight_transfers < 1:
            raise ValueError("PdserveConnector: max_inflight_transfers must be >= 1")
        if self.kv_staging not in ("none", "host"):
            raise ValueError(f"PdserveConnector: kv_staging must be none or host, got {self.kv_staging!r}")
        if self.kv_staging_blocks < 0:
            raise ValueError(f"PdserveConnector: kv_staging_blocks must be >= 0, got {self.kv_staging_blocks}")


def descriptor_to_params(d: KVTransferDescriptor) -> dict[str, Any]:
    """The descriptor as plain `kv_transfer_params` entries (msgpack/JSON-safe)."""
    return {"engine_id": d.engine_id, "epoch": d.epoch, PDSERVE_ID: d.request_id, "block_ids": list(d.block_ids),
            "num_tokens": d.num_tokens, "tp_size": d.tp_size, "block_size": d.block_size,
            "num_kv_heads": d.num_kv_heads, "lease_expires_unix_ms": d.lease_expires_unix_ms}


def descriptor_from_params(params: dict[str, Any]) -> KVTransferDescriptor:
    """Inverse of `descriptor_to_params`; raises ValueError naming a missing or bad entry."""
    missing = [k for k in (*_DESCRIPTOR_KEYS, PDSERVE_ID) if k not in params]
    if missing:
        raise ValueError(f"kv_transfer_params lacks {missing}")
    try:
        return KVTransferDescriptor(str(params["engine_id"]), int(params["epoch"]), str(params[PDSERVE_ID]),
                                    tuple(int(b) for b in params["block_ids"]), int(params["num_tokens"]),
                                    int(params["tp_size"]), int(params["block_size"]), int(params["num_kv_heads"]),
                                    int(params["lease_expires_unix_ms"]))
    except (TypeError, ValueError) as e:
        raise ValueError(f"kv_transfer_params: bad descriptor: {e}") from None


@dataclass(frozen=True, slots=True)
class SendSpec:
    """Pin `block_ids` of a finished prefill for readers (in the step that computes its prompt)."""

    vllm_id: str
    request_id: str
    block_ids: tuple[int, ...]
    reader_tp_size: int = 0  # the reading engine's TP (0: this engine's), for each rank's reader count


@dataclass(frozen=True, slots=True)
class PullSpec:
    """Pull the descriptor's blocks into `local_block_ids` (the blocks after the local prefix
    hit). `vllm_waits`: vLLM holds the request in WAITING_FOR_REMOTE_KVS until this rank reports
    it; False for an empty pull that only tells the pdserve scheduler "nothing to read"."""

    vllm_id: str
    request_id: str
    descriptor: KVTransferDescriptor
    local_block_ids: tuple[int, ...]
    vllm_waits: bool


@dataclass(frozen=True, slots=True)
class CancelSpec:
    """Unpin a held prefill or abandon a pull (the request was aborted)."""

    vllm_id: str
    request_id: str


@dataclass(slots=True)
class PdserveConnectorMetadata:
    """One step's plan for every worker rank (pickled by vLLM to its workers)."""

    sends: list[SendSpec] = field(default_factory=list)
    pulls: list[PullSpec] = field(default_factory=list)
    cancels: list[CancelSpec] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.sends or self.pulls or self.cancels)
