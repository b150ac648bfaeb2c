"""`EventPlane`: the scheduler's KV-event plane assembled from its config.

What the scheduler main wires up:

    plane = EventPlane.from_config(config, model_name=...)
    plane.add_to_server(events_server.server)   # KVEvents on config.events_port
    plane.start()                               # binds ZMQ when configured
    sink = plane.republisher                    # EventSink: publish(engine_id, epoch, batch)
    control.on_engine_up.append(plane.engine_up)  # a new epoch retires the old one at once
    policy = plane.routing_policy()             # RoutingPolicy for routing_policy == "prefix"
    plane.instrument(EventMetrics(registry))    # optional Prometheus metrics
    ...
    plane.close()
"""

from __future__ import annotations

import logging

import grpc

from services.common.config import SchedulerConfig
from services.common.metrics import EventMetrics
from services.scheduler.events.metrics import instrument
from services.scheduler.events.republisher import EventRepublisher
from services.scheduler.events.servicer import GrpcRingCodec, KVEventsServicer
from services.scheduler.events.zmq_publisher import ZmqEventPublisher
from services.scheduler.lifecycle import EngineRef
from services.scheduler.prefix_index import InMemoryPrefixIndex
from services.scheduler.prefix_routing import PrefixAwarePolicy, parse_medium_weights

logger = logging.getLogger(__name__)


class EventPlane:
    """Prefix index + republisher + KVEvents servicer (+ ZMQ publisher when an endpoint is set)."""

    def __init__(self, republisher: EventRepublisher, *, zmq: ZmqEventPublisher | None = None,
                 medium_weights: dict[str, float] | None = None, load_weight: float = 0.25) -> None:
        self.republisher = republisher
        self.index = republisher.index
        self.servicer = KVEventsServicer(republisher)
        self.zmq = zmq
        self._medium_weights = medium_weights
        self._load_weight = load_weight

    @classmethod
    def from_config(cls, config: SchedulerConfig, *, model_name: str = "") -> EventPlane:
        """Raises ValueError for a malformed medium_weights setting."""
        weights = parse_medium_weights(config.medium_weights)
        index = InMemoryPrefixIndex(config.prefix_index_max_entries)
        republisher = EventRepublisher(index, ring_size=config.event_ring_size,
                                       subscriber_buffer=config.subscriber_buffer, ring_codec=GrpcRingCodec())
        zmq = None
        if config.zmq_endpoint:
            zmq = ZmqEventPublisher(republisher, config.zmq_endpoint, config.zmq_replay_endpoint or None,
                                    topic=config.zmq_topic, model=model_name, hwm=config.zmq_hwm)
        elif config.zmq_replay_endpoint:
            raise ValueError("zmq_replay_endpoint: needs zmq_endpoint as well")
        return cls(republisher, zmq=zmq, medium_weights=weights, load_weight=config.prefix_load_weight)

    def routing_policy(self) -> PrefixAwarePolicy:
        return PrefixAwarePolicy(self.index, medium_weights=self._medium_weights, load_weight=self._load_weight)

    def engine_up(self, ref: EngineRef) -> None:
        """Hook for `ControlServicer.on_engine_up`: the engine's current epoch is `ref.epoch`, so
        an older one is retired now (its entries dropped, its late events refused)."""
        try:
            self.republisher.register_epoch(ref.engine_id, ref.epoch)
        except ValueError as e:
            logger.warning("KV-event plane: %s", e)

    def instrument(self, metrics: EventMetrics) -> None:
        instrument(self.republisher, metrics)

    def add_to_server(self, server: grpc.aio.Server) -> None:
        self.servicer.add_to_server(server)

    def start(self) -> None:
        if self.zmq is not None:
            self.zmq.start()

    def close(self) -> None:
        if self.zmq is not None:
            self.zmq.close()
