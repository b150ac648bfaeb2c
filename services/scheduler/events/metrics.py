"""Prometheus metrics of the KV-event plane, as a wrapper: observers on the republisher and
scrape-time readers of the subscribers and the index (the core knows nothing of Prometheus)."""

from __future__ import annotations

from collections import Counter

from connectors.kv_events import AllBlocksCleared, KVEventBatch
from services.common.metrics import EventMetrics, SubscriberLag
from services.scheduler.event_sink import CompactBatch
from services.scheduler.events.republisher import EventRepublisher, SequencedBatch, Subscription
from services.scheduler.prefix_index import DEFAULT_MEDIUM, InMemoryPrefixIndex


def _by_type_and_medium(batch: KVEventBatch) -> Counter[tuple[str, str]]:
    counts: Counter[tuple[str, str]] = Counter()
    if type(batch) is CompactBatch:  # BlockStored (and BlockRemoved) of one medium
        c = batch.compact
        medium = c.medium or DEFAULT_MEDIUM
        for kind, n in (("BlockStored", c.num_stored), ("BlockRemoved", c.num_removed)):
            if n:
                counts[(kind, medium)] = n
        return counts
    for e in batch.events:
        medium = e.medium or ("all" if isinstance(e, AllBlocksCleared) else DEFAULT_MEDIUM)
        counts[(type(e).__name__, medium)] += 1
    return counts


def instrument(republisher: EventRepublisher, metrics: EventMetrics) -> None:
    """Counts received / published / rejected events and resyncs, and exports subscriber lag
    (gRPC subscribers; a ZMQ PUB has no per-subscriber view) and the index size per medium."""

    def received(engine_id: str, batch: KVEventBatch) -> None:
        for (kind, medium), n in _by_type_and_medium(batch).items():
            metrics.count_received(engine_id, kind, medium, n)

    def published(sb: SequencedBatch) -> None:
        for (kind, medium), n in _by_type_and_medium(sb.batch).items():
            metrics.count_published(kind, medium, n)

    def resynced(_: Subscription) -> None:
        metrics.count_resync("grpc")

    republisher.on_received.append(received)
    republisher.on_rejected.append(lambda reason, n: metrics.count_rejected(reason, n))
    republisher.on_resync.append(resynced)
    republisher.add_listener(published)
    metrics.track_subscribers(lambda: [SubscriberLag("grpc", lag) for lag in republisher.subscriber_lags()])
    index = republisher.index
    if isinstance(index, InMemoryPrefixIndex):
        metrics.track_index(index.blocks_by_medium)
