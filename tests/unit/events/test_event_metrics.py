"""The event plane's Prometheus metrics, read back from a real registry."""

from prometheus_client import CollectorRegistry

from connectors.kv_events import BlockStored, KVEventBatch
from services.common.metrics import EventMetrics
from services.scheduler.events import EventRepublisher
from services.scheduler.events.metrics import instrument
from services.scheduler.prefix_index import InMemoryPrefixIndex


def test_counts_lag_resyncs_and_index_size() -> None:
    registry = CollectorRegistry()
    rp = EventRepublisher(InMemoryPrefixIndex(), subscriber_buffer=2)
    instrument(rp, EventMetrics(registry))
    stalled = rp.subscribe(None)
    rp.publish("p0", 1, KVEventBatch(1.0, [BlockStored((1, 2), None, (), 4, medium="GPU"),
                                          BlockStored((3,), None, (), 0, medium="CPU_OFFLOAD")]))
    rp.publish("p0", 1, KVEventBatch(1.0, [BlockStored((4,), None, (), 4, medium=None)]))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("pdserve_events_published_total", type="BlockStored", medium="GPU") == 2
    assert value("pdserve_events_received_total", engine="p0", type="BlockStored", medium="CPU_OFFLOAD") == 1
    assert value("pdserve_events_subscriber_lag_batches", transport="grpc") == 2
    assert value("pdserve_events_index_blocks", medium="GPU") == 3
    rp.publish("p0", 1, KVEventBatch(1.0, [BlockStored((5,), None, (), 4, medium="GPU")]))
    assert value("pdserve_events_subscriber_resyncs_total", transport="grpc") == 1
    assert stalled.lag == 0
    rp.register_epoch("p0", 2)
    assert value("pdserve_events_published_total", type="AllBlocksCleared", medium="all") == 1
    assert value("pdserve_events_index_blocks", medium="GPU") is None
    rp.publish("p0", 1, KVEventBatch(1.0, [BlockStored((6,), None, (), 4, medium="GPU")]))
    assert value("pdserve_events_rejected_total", reason="stale_epoch") == 1
