"""The KV-event plane: republisher (one seq, replay ring, bounded subscribers), the KVEvents
gRPC servicer and the vLLM-format ZMQ publisher."""

from services.scheduler.events.republisher import (
    EventFilter,
    EventRepublisher,
    NoticeKind,
    SequencedBatch,
    SnapshotBatch,
    StreamNotice,
    Subscription,
)

__all__ = ["EventFilter", "EventRepublisher", "NoticeKind", "SequencedBatch", "SnapshotBatch", "StreamNotice",
           "Subscription"]
