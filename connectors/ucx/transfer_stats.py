"""`UcxTransferStats`: the `ucx` connector's transfer stats, vLLM's `KVConnectorStats` series plus
a breakdown per prefill→decode engine pair (`PairTransferStats`: bytes, blocks, durations,
failures by reason, bytes by UCX transport, fallbacks) that the metrics need. Plain data: the
connector records into one under its lock and hands it out whole (`get_kv_connector_stats`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from connectors.outputs import KVConnectorStats


@dataclass(slots=True)
class PairTransferStats:
    """Pulls from one prefill engine (src) to one decode engine (dst) in one interval."""

    src_engine_id: str
    dst_engine_id: str
    num_bytes: int = 0
    num_blocks: int = 0
    num_operations: int = 0
    durations: list[float] = field(default_factory=list)  # seconds of each successful pull
    failures_by_reason: dict[str, int] = field(default_factory=dict)
    # num_bytes by the UCX transport that carried them ("unknown" where it could not be read)
    bytes_by_transport: dict[str, int] = field(default_factory=dict)
    # (expected, actual) transports -> pulls that fell back to a slower one than expected
    fallbacks: dict[tuple[str, str], int] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return float(sum(self.durations))

    @property
    def num_failures(self) -> int:
        return sum(self.failures_by_reason.values())

    def record_failure(self, reason: str) -> None:
        key = reason if reason.startswith("refused:") else reason.split(":", 1)[0]
        self.failures_by_reason[key] = self.failures_by_reason.get(key, 0) + 1

    def merge(self, other: PairTransferStats) -> None:
        self.num_bytes += other.num_bytes
        self.num_blocks += other.num_blocks
        self.num_operations += other.num_operations
        self.durations.extend(other.durations)
        for reason, n in other.failures_by_reason.items():
            self.failures_by_reason[reason] = self.failures_by_reason.get(reason, 0) + n
        for transport, n in other.bytes_by_transport.items():
            self.bytes_by_transport[transport] = self.bytes_by_transport.get(transport, 0) + n
        for pair, n in other.fallbacks.items():
            self.fallbacks[pair] = self.fallbacks.get(pair, 0) + n


@dataclass(slots=True)
class UcxTransferStats(KVConnectorStats):
    """`KVConnectorStats` plus the per prefill→decode pair breakdown the metrics need.

    Series in `data`: `transfer_duration` (s), `bytes_transferred`, `num_failed_transfers`
    (1 each), `num_kv_expired_reqs` (1 each), as in vLLM's NIXL stats.
    """

    pairs: dict[tuple[str, str], PairTransferStats] = field(default_factory=dict)
    lease_expiries: int = 0

    def pair(self, src: str, dst: str) -> PairTransferStats:
        stats = self.pairs.get((src, dst))
        if stats is None:
            stats = self.pairs[(src, dst)] = PairTransferStats(src, dst)
        return stats

    def is_empty(self) -> bool:
        return not self.pairs and not self.lease_expiries and not any(self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        KVConnectorStats.aggregate(self, other)
        assert isinstance(other, UcxTransferStats)
        for key, pair in other.pairs.items():
            self.pair(*key).merge(pair)
        self.lease_expiries += other.lease_expiries
        return self

    def clone_and_reset(self) -> KVConnectorStats:
        snapshot = UcxTransferStats(data=self.data, pairs=self.pairs, lease_expiries=self.lease_expiries)
        self.data, self.pairs, self.lease_expiries = {}, {}, 0
        return snapshot
