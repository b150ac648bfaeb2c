"""The `Control` servicer: one bidirectional stream per rank of every engine.

Protobuf lives here and in `control_convert.py` and nowhere deeper: Hellos become
`RankHello`, reports become `KVConnectorOutput` for `connectors.aggregator.KVOutputAggregator`,
whose engine-level results feed the `TransferTracker`; its outcomes go to `on_transfer_outcome`
(the Generation servicer's hook, which applies the release-once rule) and from there to the
engines' rank-0 streams.

Contracts (see control.proto):
- The first message must be a Hello: a malformed one ends the stream with INVALID_ARGUMENT, a
  compatibility / hash-seed / block-size mismatch or a fenced epoch with FAILED_PRECONDITION,
  each with the reason; a refused Hello changes no state.
- Welcome carries the engine's expected ranks, the handshake metadata of every registered rank
  of the other role (decode ranks get every prefill rank, prefill ranks every decode rank) and
  the rank's last applied seq. A rank registering for the first time in its epoch is announced
  to the other role's connected ranks in a PeerUpdate (joined; the joins of one loop turn share
  one PeerUpdate per stream, and a stream never gets a join its Welcome held); an engine that
  dies or is fenced is announced as left.
- Each StepReport is applied at most once (seq <= last applied is a duplicate: ignored) and
  acknowledged with Ack(last applied seq). A ReportBatch (at most the Welcome's
  `max_reports_per_message` reports of one rank) is applied report by report, in order, and
  acknowledged once, after its last report. A report the scheduler cannot parse is acknowledged,
  dropped and counted (resending it would not help). Acks are throttled per stream to one per
  `ack_interval_s` (told in Welcome): a message on a stream whose last Ack is that old is acked
  at once, the others by one cumulative Ack at the interval's end, so none goes unacknowledged.
- Worker events come as `worker_events` or pre-encoded as `packed_worker_events` (an EventBatch
  with only `events` set); either is decoded once per (engine, epoch, bytes), and a batch the
  aggregator publishes unchanged keeps the rank's encoding for gRPC subscribers.
- A rank silent for its engine's heartbeat timeout (`EngineRegistry.heartbeat_timeout`), or whose stream closed and did not reopen within
  one heartbeat interval, is dead: its engine is down (transfers touching it
  fail over, an AllBlocksCleared for its epoch goes to the event sink, `on_engine_down` hooks
  run). A rank of a live epoch that speaks again brings its engine back.
- Roles change in place (docs/decisions/0044): `set_role` sends SetRole (compare-and-set on
  the engine's role generation) to every rank of the engine, and with it the peers the new role
  reads from (a decode side gets every prefill rank; decode ranks get a new prefill engine).
  Nothing is announced as left: pulls from the old role's pinned KV run to their end. The
  registry takes the new role when rank 0's heartbeat states it (every replica does the same),
  and `on_role_changed` hooks run then.
- Rank 0's heartbeat comes as a Heartbeat message or riding on a report message
  (`RankMessage.beat`, told in Welcome `accepts_report_beats`); either is applied the same way,
  a riding one after the message's reports. Any message of a rank counts as its liveness.
- Messages reach a stream in the order they were sent. KVReady and KVFailed go out from the
  turn of the report that completed the transfer: written by that report's reader while the
  engine's rank-0 stream has nothing queued and no write in flight, else queued behind what is.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from connectors import compact_events
from connectors.aggregator import AggregatedResult, KVOutputAggregator
from connectors.kv_events import AllBlocksCleared, KVEventBatch, event_from_proto
from pdserve.v1 import control_pb2 as pb
from pdserve.v1 import control_pb2_grpc
from services.scheduler.control_convert import (
    ROLE_FROM_PB,
    ROLE_TO_PB,
    CompactEventsError,
    CompactKindsError,
    WorkerEventDecoder,
    compact_from_proto,
    global_rank,
    hello_from_proto,
    identity_to_proto,
    merged_event_ranks,
    merged_transfer_ranks,
    output_from_proto,
    peer_info_to_proto,
    same_events,
)
from services.scheduler.engine_positions import EnginePositions
from services.scheduler.event_joiner import EventJoiner
from services.scheduler.event_sink import CompactBatch, EventSink, NullEventSink, ProtoBackedBatch
from services.scheduler.lifecycle import EngineRef
from services.scheduler.loop_stalls import LoopStalls
from services.scheduler.registry import (
    EngineRegistry,
    EngineState,
    LoadInfo,
    RankId,
    RankState,
    RegistrationError,
    RegistrationErrorKind,
    Role,
)
from services.scheduler.telemetry import SchedulerTelemetry
from services.scheduler.transfers import OutcomeKind, TransferOutcome, TransferTracker

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0
MAX_HELD_MESSAGES = 10_000
MAX_REPORTS_PER_MESSAGE = 256
# The default ack interval: ACK_INTERVAL_BEATS heartbeat intervals, at most MAX_ACK_INTERVAL_S
# (decision 0045: an Ack is a write, the costliest message per stream).
ACK_INTERVAL_BEATS = 4
MAX_ACK_INTERVAL_S = 4.0
STREAM_WINDOW_BYTES = 16 << 10


@dataclass(frozen=True, slots=True)
class _Close:
    code: grpc.StatusCode
    reason: str


def _leads(rank_id: RankId) -> bool:
    """Whether a rank of its engine is the engine's leader (`EngineState.leader`, without
    building a RankId per report)."""
    return rank_id.tp_rank == 0 and rank_id.pp_rank == 0


def peer_roles(role: Role, decode_peers: bool = False) -> tuple[Role, ...]:
    """The roles whose ranks' handshakes a rank of `role` gets: a prefill rank its readers (the
    decode ranks); a decode rank every engine it may pull from — prefill engines. With
    `decode_peers` (peer fetch on, decisions 0043 and 0046) every rank gets every engine's: any
    engine may pull a prefix from any other."""
    if decode_peers:
        return (Role.PREFILL, Role.DECODE)
    return (Role.DECODE,) if role == Role.PREFILL else (Role.PREFILL,)


def audience(role: Role, decode_peers: bool = False) -> tuple[Role, ...]:
    """The roles told when a rank of `role` joins or leaves (the converse of `peer_roles`)."""
    return peer_roles(role, decode_peers)


@dataclass(slots=True)
class RankConnection:
    rank_id: RankId
    conn_id: int
    epoch: int
    role: Role
    queue: asyncio.Queue[pb.SchedulerMessage | _Close]
    # The announcement counter when this stream was welcomed: joins announced before it were
    # in its Welcome, later ones reach it in a (coalesced) PeerUpdate.
    welcomed_at: int = 0
    # Acks at most once per ack interval: when the last one went (loop time), whether a
    # trailing one is scheduled.
    acked_at: float = float("-inf")
    ack_scheduled: bool = False
    # The stream's call, and its writes one at a time: the stream's own task writes what
    # `queue` holds; another stream's reader may write a transfer outcome at once (see
    # ControlServicer.deliver) while the queue is empty and no write holds the lock.
    context: grpc.aio.ServicerContext | None = None
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class ControlServicer(control_pb2_grpc.ControlServicer):
    """Rank streams, registration, reports, heartbeats (see the module docstring)."""

    def __init__(self, registry: EngineRegistry, *, aggregator: KVOutputAggregator | None = None,
                 tracker: TransferTracker | None = None, sink: EventSink | None = None,
                 heartbeat_interval_s: float = 1.0, scheduler_id: str = "",
                 telemetry: SchedulerTelemetry | None = None, ack_interval_s: float | None = None,
                 decode_peers: bool = False) -> None:
        self.registry = registry
        # Decode ranks also get the other decode engines' handshakes (peer fetch on).
        self.decode_peers = decode_peers
        self.aggregator = aggregator or KVOutputAggregator(clock=registry.clock)
        self.tracker = tracker or TransferTracker(clock=registry.clock)
        self.sink: EventSink = sink or NullEventSink()
        self.heartbeat_interval_s = heartbeat_interval_s
        # Reports a rank may send in one ReportBatch (told in Welcome).
        self.max_reports_per_message = MAX_REPORTS_PER_MESSAGE
        # At most one Ack per stream per this interval (the first at once, later ones at the
        # interval's end, cumulative): a rank reporting more often gets fewer messages back.
        # Default: ACK_INTERVAL_BEATS heartbeat intervals, at most MAX_ACK_INTERVAL_S (a rank
        # then buffers up to that long of reports, as it does while a stream reconnects; a
        # reconnect resends only those above the Welcome's last applied seq). Each Ack is a
        # write, which costs this process more than reading a report (decision 0045).
        if ack_interval_s is None:
            ack_interval_s = min(heartbeat_interval_s * ACK_INTERVAL_BEATS, MAX_ACK_INTERVAL_S)
        if ack_interval_s < 0:
            raise ValueError(f"ack_interval_s must be >= 0, got {ack_interval_s}")
        self.ack_interval_s = ack_interval_s
        # See flow_options (None: gRPC's default window, grown by BDP probing).
        self.stream_window_bytes: int | None = STREAM_WINDOW_BYTES
        # Told in Welcome: ranks may send StepReport.packed_worker_events.
        self.accepts_packed_worker_events = True
        # Told in Welcome: a report may carry its engine's other ranks' identical worker events
        # (StepReport.merged_event_ranks): one message per engine step instead of one per rank.
        self.accepts_merged_worker_events = True
        # Told in Welcome: ranks may send StepReport.compact_worker_events (a step's BlockStored
        # as bytes and a hash array: no object per event on the scheduler). `verify_compact`
        # also checks that the forms agree event by event (a full decode: tests, debugging).
        self.accepts_compact_worker_events = True
        # Likewise for rank 0's engine events (StepReport.compact_engine_events).
        self.accepts_compact_engine_events = True
        # Told in Welcome: compact events may mix BlockStored and BlockRemoved (CompactEvents.kinds).
        self.accepts_mixed_compact_events = True
        self.verify_compact = False
        # Told in Welcome: a report may carry its engine's other ranks' identical transfer
        # results (StepReport.merged_transfer_ranks): a transfer done on every rank is one message.
        self.accepts_merged_transfer_results = True
        # Told in Welcome: rank 0's heartbeat may ride on a report message (RankMessage.beat):
        # one message per step instead of a report and a beat.
        self.accepts_report_beats = True
        # How long a closed rank stream may take to come back before its engine is down.
        self.reconnect_grace_s = min(heartbeat_interval_s, registry.heartbeat_timeout_s)
        self.telemetry = telemetry or SchedulerTelemetry()
        self.scheduler_id = scheduler_id
        self.connections: dict[RankId, RankConnection] = {}
        # Messages for ranks of a live epoch that are between streams, delivered after Welcome.
        self.held: dict[tuple[RankId, int], list[pb.SchedulerMessage]] = {}
        # Set while a reader applies a message: transfer outcomes it produces collect in
        # `_outcomes_now` and are written before it reads the next one (`_write_now`).
        self._reading = False
        self._outcomes_now: list[tuple[RankConnection, pb.SchedulerMessage]] = []
        # Hooks (set by the scheduler service): what to do with a transfer outcome (default:
        # deliver it to the engine), and who to tell when an engine goes down or comes back.
        self.on_transfer_outcome: Callable[[TransferOutcome], None] = self.deliver
        self.on_engine_down: list[Callable[[EngineRef, str], None]] = []
        self.on_engine_up: list[Callable[[EngineRef], None]] = []
        # Called for every accepted Hello (first registration, reconnect or new epoch).
        self.on_registered: list[Callable[[EngineRef], None]] = []
        # Called when an engine's heartbeat states a new role: (engine, old role).
        self.on_role_changed: list[Callable[[EngineState, Role], None]] = []
        self.down: set[EngineRef] = set()
        self.counters: Counter[str] = Counter()
        self.transfer_bytes: Counter[tuple[str, str]] = Counter()
        self.worker_events = WorkerEventDecoder()
        # Rank 0's report positions per engine (convergence of a restarted replica).
        self.positions = EnginePositions()
        # Compact worker events: one decode and one aggregator call per step's copies, not per rank.
        self.joiner = EventJoiner(self.aggregator, self._publish_compact)
        self._monitor_task: asyncio.Task[None] | None = None
        # Joined ranks not yet announced, per role to tell: (announcement number, peer), sent as
        # one PeerUpdate per stream at the next loop turn (a burst of N registrations costs one
        # message per stream, not N) and always before any other broadcast, so order holds.
        self._announced = 0
        self._pending_joins: dict[Role, list[tuple[int, pb.PeerInfo]]] = {}
        self._flush_scheduled = False
        # The loop's own stalls, measured by the monitor on the registry's clock, discounted
        # from ranks' silence.
        self._tick_due: float | None = None
        self.stalls = LoopStalls(horizon_s=4 * registry.max_heartbeat_timeout_s,
                                 tolerance_s=min(0.05, registry.heartbeat_timeout_s / 10))

    def keepalive_options(self) -> list[tuple[str, int]]:
        """The Control server's transport liveness: an HTTP/2 PING to every rank each heartbeat
        interval, and a connection whose PING is not acknowledged within the base heartbeat
        timeout is closed (its ranks are then down after the reconnect grace). gRPC's own
        threads answer a PING, without the rank's interpreter: a frozen process or a vanished
        host is found within `heartbeat_timeout_s` whatever its engine's heartbeat timeout."""
        return [("grpc.keepalive_time_ms", max(1, int(self.heartbeat_interval_s * 1000))),
                ("grpc.keepalive_timeout_ms", max(1, int(self.registry.heartbeat_timeout_s * 1000))),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_pings_without_data", 0),
                # Any unanswered PING (a flow-control probe too) ends the connection at the timeout:
                # a keepalive PING queued behind one would never be sent.
                ("grpc.http2.ping_timeout_ms", max(1, int(self.registry.heartbeat_timeout_s * 1000))),
                *self.flow_options()]

    def flow_options(self) -> list[tuple[str, int]]:
        """Each rank stream's receive window, `stream_window_bytes` and never grown (no BDP
        probe): when this scheduler falls behind, a rank's unread reports wait at the rank,
        where the next ones join them in one ReportBatch (one message to read and apply for
        several steps, order kept), rather than as single messages in this process's buffers."""
        if self.stream_window_bytes is None:
            return []
        return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", self.stream_window_bytes)]

    # -- lifecycle ----------------------------------------------------------------------------

    def start_monitor(self) -> None:
        """Starts the heartbeat-timeout sweep on the running loop."""
        if self._monitor_task is None:
            self._monitor_task = asyncio.get_running_loop().create_task(self._monitor())

    async def stop(self) -> None:
        if self._monitor_task is not None:
            self._monitor_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor_task
            self._monitor_task = None
        for conn in list(self.connections.values()):
            conn.queue.put_nowait(_Close(grpc.StatusCode.UNAVAILABLE, "scheduler shutting down"))

    async def _monitor(self) -> None:
        """The heartbeat sweep; it also measures the loop's lag (how late its own wake-ups
        are), so that time the loop could not read its streams is not counted as silence."""
        period = self.monitor_period_s
        while True:
            self._tick_due = self.registry.clock() + period
            await asyncio.sleep(period)
            self.check_heartbeats()

    @property
    def monitor_period_s(self) -> float:
        return max(0.02, min(self.heartbeat_interval_s, self.registry.heartbeat_timeout_s) / 4)

    def check_heartbeats(self) -> None:
        """Takes down the engines of ranks silent past the timeout, not counting loop stalls:
        when this runs later than the monitor's tick was due, the loop was stalled since then."""
        now, due = self.registry.clock(), self._tick_due
        if due is not None and now >= due:
            self._tick_due = None
            self.stalls.observe(due, now)
        self.joiner.flush_all()  # bounds how long a noted copy may wait (see EventJoiner)
        for rank_id in self.registry.expire(self._stalled_since):
            engine = self.registry.engine(rank_id.engine_id)
            if engine is not None:
                self.engine_down(EngineRef(engine.engine_id, engine.epoch),
                                 f"rank tp={rank_id.tp_rank} pp={rank_id.pp_rank} silent for more than "
                                 f"{self.registry.heartbeat_timeout(engine)} s")

    def _stalled_since(self, t: float) -> float:
        return self.stalls.stalled_since(t)

    # -- sending ------------------------------------------------------------------------------

    def send(self, rank_id: RankId, epoch: int, msg: pb.SchedulerMessage) -> bool:
        """Queues `msg` for the rank's stream. While the rank (of that live epoch) is between
        streams, up to MAX_HELD_MESSAGES are held and delivered after its next Welcome; False
        when the message had to be dropped (no such rank or epoch)."""
        conn = self.connections.get(rank_id)
        if conn is not None and conn.epoch == epoch:
            conn.queue.put_nowait(msg)
            return True
        if self.registry.rank(rank_id) is not None and self.registry.engine(rank_id.engine_id, epoch) is not None:
            held = self.held.setdefault((rank_id, epoch), [])
            if len(held) < MAX_HELD_MESSAGES:
                held.append(msg)
                self.counters["send_held"] += 1
                return True
        self.counters["send_no_stream"] += 1
        return False

    def send_to_leader(self, engine: EngineRef, msg: pb.SchedulerMessage) -> bool:
        """Queues `msg` on the rank-0 stream of (engine_id, epoch); False when there is none."""
        return self.send(RankId(engine.engine_id, 0, 0), engine.epoch, msg)

    def deliver(self, outcome: TransferOutcome) -> None:
        """Sends a transfer outcome to its engine: KVReady / KVFailed / ReleaseBlocks."""
        if outcome.kind == OutcomeKind.KV_READY:
            msg = pb.SchedulerMessage(kv_ready=pb.KVReady(request_id=outcome.request_id))
        elif outcome.kind == OutcomeKind.KV_FAILED:
            msg = pb.SchedulerMessage(kv_failed=pb.KVFailed(request_id=outcome.request_id, reason=outcome.reason,
                                                            invalid_block_ids=outcome.invalid_block_ids))
        else:
            msg = pb.SchedulerMessage(release=pb.ReleaseBlocks(request_id=outcome.request_id))
        self.counters[f"sent_{outcome.kind}"] += 1
        if outcome.kind != OutcomeKind.RELEASE and self._reading:
            conn = self.connections.get(RankId(outcome.engine.engine_id, 0, 0))
            if conn is not None and conn.epoch == outcome.engine.epoch and self._idle(conn):
                self._outcomes_now.append((conn, msg))
                return
        self.send_to_leader(outcome.engine, msg)

    def _queue_outcomes(self, outcomes: list[tuple[RankConnection, pb.SchedulerMessage]]) -> None:
        for conn, msg in outcomes:
            conn.queue.put_nowait(msg)
        outcomes.clear()

    def _idle(self, conn: RankConnection) -> bool:
        """Nothing is queued on the stream and no write is in flight: a message written now
        keeps the stream's order."""
        return conn.context is not None and conn.queue.empty() and not conn.write_lock.locked() \
            and self.connections.get(conn.rank_id) is conn

    async def _write_now(self, outcomes: list[tuple[RankConnection, pb.SchedulerMessage]]) -> None:
        """Writes the transfer outcomes one message produced, each at once if its stream is
        still idle, else queued. A write that fails (the stream ended meanwhile) is dropped, as
        a queued message of an ended stream is."""
        for i, (conn, msg) in enumerate(outcomes):
            if not self._idle(conn):
                conn.queue.put_nowait(msg)
                continue
            assert conn.context is not None
            try:
                async with conn.write_lock:
                    await conn.context.write(msg)
                self.counters["sent_at_once"] += 1
            except asyncio.CancelledError:  # this reader is ending: the rest go by the queues
                self._queue_outcomes(outcomes[i + 1:])
                raise
            except Exception as e:  # noqa: BLE001 - whatever ended the other stream ends its writes
                self.counters["sent_at_once_failed"] += 1
                logger.debug("KV outcome for %s not written: %s", conn.rank_id, e)

    def release(self, engine: EngineRef, request_id: str) -> bool:
        return self.send_to_leader(engine, pb.SchedulerMessage(release=pb.ReleaseBlocks(request_id=request_id)))

    def _announce_joined(self, role: Role, peer: pb.PeerInfo) -> None:
        """Queues a joined peer for every `role` stream welcomed before now (coalesced)."""
        self._announced += 1
        self._pending_joins.setdefault(role, []).append((self._announced, peer))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush_joins)

    def flush_joins(self) -> None:
        """Sends the pending joined peers: each stream gets those announced after its Welcome."""
        self._flush_scheduled = False
        pending, self._pending_joins = self._pending_joins, {}
        for role, items in pending.items():
            marks = [n for n, _ in items]
            cache: dict[int, pb.SchedulerMessage] = {}
            for conn in self.connections.values():
                if conn.role != role:
                    continue
                start = bisect.bisect_right(marks, conn.welcomed_at)
                if start == len(items):
                    continue
                engine_id = conn.rank_id.engine_id
                if any(p.rank.engine_id == engine_id for _, p in items[start:]):  # never its own ranks
                    joined = [p for _, p in items[start:] if p.rank.engine_id != engine_id]
                    if joined:
                        conn.queue.put_nowait(pb.SchedulerMessage(peer_update=pb.PeerUpdate(joined=joined)))
                    continue
                msg = cache.get(start)
                if msg is None:
                    msg = pb.SchedulerMessage(peer_update=pb.PeerUpdate(joined=[p for _, p in items[start:]]))
                    cache[start] = msg
                conn.queue.put_nowait(msg)

    def _broadcast(self, role: Role, msg: pb.SchedulerMessage, skip: str = "") -> None:
        """`msg` to every stream of `role` but those of engine `skip`."""
        if self._pending_joins:
            self.flush_joins()
        for conn in self.connections.values():
            if conn.role == role and conn.rank_id.engine_id != skip:
                conn.queue.put_nowait(msg)

    # -- engines going down / coming back -----------------------------------------------------

    def engine_down(self, ref: EngineRef, reason: str, engine: EngineState | None = None) -> None:
        """Fails over everything on (engine, epoch); idempotent until the engine comes back.
        `engine` is the incarnation when the registry no longer holds it (fenced)."""
        if ref in self.down:
            return
        self.down.add(ref)
        logger.warning("engine %s epoch %#x down: %s", ref.engine_id, ref.epoch, reason)
        self.counters["engines_down"] += 1
        for outcome in self.tracker.fail_engine(ref, reason):
            self.on_transfer_outcome(outcome)
        self.joiner.flush(ref.engine_id)  # what its ranks reported before it went down comes first
        self.sink.publish(ref.engine_id, ref.epoch, KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        engine = engine or self.registry.engine(ref.engine_id, ref.epoch)
        if engine is not None and engine.ranks:
            left = [identity_to_proto(engine, rid) for rid in engine.ranks]
            for other in audience(engine.role, self.decode_peers):
                self._broadcast(other, pb.SchedulerMessage(peer_update=pb.PeerUpdate(left=left)),
                                skip=engine.engine_id)
        for hook in self.on_engine_down:
            hook(ref, reason)

    def _engine_up(self, engine: EngineState) -> None:
        if not self.down:
            return  # the common case, checked on every message
        ref = EngineRef(engine.engine_id, engine.epoch)
        if ref in self.down and engine.healthy:
            self.down.discard(ref)
            logger.info("engine %s epoch %#x is back", engine.engine_id, engine.epoch)
            joined = [peer_info_to_proto(engine, r) for r in engine.ranks.values()]
            for other in audience(engine.role, self.decode_peers):
                self._broadcast(other, pb.SchedulerMessage(peer_update=pb.PeerUpdate(joined=joined)),
                                skip=engine.engine_id)
            for hook in self.on_engine_up:
                hook(ref)

    # -- the stream ---------------------------------------------------------------------------

    async def Connect(self, request_iterator: AsyncIterator[pb.RankMessage],  # type: ignore[override]
                      context: grpc.aio.ServicerContext) -> None:
        """Writes (`context.write`, not yields) so that another stream's reader can write a
        transfer outcome to this stream between two of its writes (`RankConnection.write_lock`)."""
        conn = await self._handshake(request_iterator, context)
        if conn is None:
            return
        conn.context = context
        reader = asyncio.get_running_loop().create_task(self._read(conn, request_iterator))
        try:
            while True:
                item = await conn.queue.get()
                async with conn.write_lock:
                    if isinstance(item, _Close):
                        if item.code == grpc.StatusCode.OK:
                            return
                        await context.abort(item.code, item.reason)
                    await context.write(item)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            if self.connections.get(conn.rank_id) is conn:
                del self.connections[conn.rank_id]
            self.registry.disconnect(conn.rank_id, conn.conn_id)

    async def _handshake(self, request_iterator: AsyncIterator[pb.RankMessage],
                         context: grpc.aio.ServicerContext) -> RankConnection | None:
        try:
            first = await asyncio.wait_for(anext(aiter(request_iterator)), HELLO_TIMEOUT_S)
        except (StopAsyncIteration, TimeoutError):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a Hello")
        if first.WhichOneof("payload") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a Hello")
        try:
            hello = hello_from_proto(first.hello)
            reg = self.registry.register(hello)
        except RegistrationError as e:
            self.counters[f"hello_refused_{e.kind}"] += 1
            self.telemetry.metrics.count_registration_refused(
                "malformed" if e.kind == RegistrationErrorKind.INVALID else "fenced" if "fenced" in str(e)
                else "incompatible")
            code = (grpc.StatusCode.INVALID_ARGUMENT if e.kind == RegistrationErrorKind.INVALID
                    else grpc.StatusCode.FAILED_PRECONDITION)
            logger.warning("refused Hello from %s: %s", context.peer(), e)
            await context.abort(code, str(e))
        engine = reg.engine
        if reg.fenced_engine is not None:
            self._fence(reg.fenced_engine)
        if hello.rank_id == engine.leader:
            self.positions.hello(engine.engine_id, engine.epoch, first.hello.first_position)
        self.aggregator.register_engine(engine.engine_id, engine.epoch, range(engine.tp_size * engine.pp_size))
        conn = RankConnection(hello.rank_id, reg.rank.conn_id, engine.epoch, engine.role.side, asyncio.Queue())
        old = self.connections.get(hello.rank_id)
        if old is not None:
            old.queue.put_nowait(_Close(grpc.StatusCode.ABORTED, "replaced by a newer stream of this rank"))
        self.connections[hello.rank_id] = conn
        conn.welcomed_at = self._announced
        conn.queue.put_nowait(self._welcome(engine, reg.rank))
        for held in self.held.pop((hello.rank_id, engine.epoch), []):
            conn.queue.put_nowait(held)
        if reg.fenced_engine is not None:
            for rank_id in reg.fenced_engine.ranks:
                self.held.pop((rank_id, reg.fenced_engine.epoch), None)
        if not reg.new_rank:
            self.telemetry.metrics.count_control_reconnect(engine.engine_id)
        if reg.new_rank:
            for other in audience(engine.role, self.decode_peers):
                self._announce_joined(other, peer_info_to_proto(engine, reg.rank))
        self.counters["hello_accepted"] += 1
        logger.info("rank %s tp=%d/%d of %s engine %s epoch %#x registered", hello.tp_rank, hello.tp_rank,
                    hello.tp_size, engine.role, engine.engine_id, engine.epoch)
        for hook in self.on_registered:
            hook(EngineRef(engine.engine_id, engine.epoch))
        self._engine_up(engine)
        return conn

    def _fence(self, fenced: EngineState) -> None:
        self.counters["epochs_fenced"] += 1
        old = EngineRef(fenced.engine_id, fenced.epoch)
        for rank_id in fenced.ranks:
            conn = self.connections.get(rank_id)
            if conn is not None and conn.epoch == old.epoch:
                conn.queue.put_nowait(_Close(grpc.StatusCode.FAILED_PRECONDITION,
                                             f"epoch {old.epoch:#x} fenced by a newer epoch"))
                del self.connections[rank_id]
        self.down.discard(old)
        self.engine_down(old, "fenced by a new epoch", fenced)
        self.down.discard(old)

    def _welcome(self, engine: EngineState, rank: RankState) -> pb.SchedulerMessage:
        peers = [peer_info_to_proto(e, r) for other in peer_roles(engine.role, self.decode_peers) for e in self.registry.by_role(other)
                 if e.engine_id != engine.engine_id and EngineRef(e.engine_id, e.epoch) not in self.down
                 for r in e.ranks.values()]
        welcome = pb.Welcome(expected_ranks=[identity_to_proto(engine, r) for r in engine.expected_ranks()], peers=peers,
                             last_acked_seq=rank.last_applied_seq,
                             heartbeat_interval_ms=int(self.heartbeat_interval_s * 1000),
                             scheduler_id=self.scheduler_id,
                             max_reports_per_message=self.max_reports_per_message,
                             accepts_packed_worker_events=self.accepts_packed_worker_events,
                             ack_interval_ms=int(self.ack_interval_s * 1000),
                             accepts_merged_worker_events=self.accepts_merged_worker_events,
                             accepts_compact_worker_events=self.accepts_compact_worker_events,
                             accepts_merged_transfer_results=self.accepts_merged_transfer_results,
                             accepts_compact_engine_events=self.accepts_compact_engine_events,
                             accepts_mixed_compact_events=self.accepts_mixed_compact_events,
                             accepts_report_beats=self.accepts_report_beats,
                             peer_fetch=self.decode_peers)
        return pb.SchedulerMessage(welcome=welcome)

    async def _read(self, conn: RankConnection, request_iterator: AsyncIterator[pb.RankMessage]) -> None:
        try:
            async for msg in request_iterator:
                if not self.registry.touch(conn.rank_id, conn.conn_id):
                    return  # fenced or replaced
                engine = self.registry.engine(conn.rank_id.engine_id, conn.epoch)
                if engine is None:
                    return
                self._engine_up(engine)
                self._reading = True
                try:
                    self._apply_message(conn, engine, msg)
                except BaseException:
                    self._queue_outcomes(self._outcomes_now)
                    raise
                finally:
                    self._reading = False
                outcomes, self._outcomes_now = self._outcomes_now, []
                if outcomes:
                    await self._write_now(outcomes)
        except grpc.aio.AioRpcError:
            pass
        finally:
            if self.registry.disconnect(conn.rank_id, conn.conn_id):
                asyncio.get_running_loop().call_later(self.reconnect_grace_s, self._check_reconnected,
                                                      conn.rank_id, conn.conn_id)
            conn.queue.put_nowait(_Close(grpc.StatusCode.OK, "stream closed by the rank"))

    def _apply_message(self, conn: RankConnection, engine: EngineState, msg: pb.RankMessage) -> None:
        kind = msg.WhichOneof("payload")
        if kind == "report":
            self._count_applied(self._on_report(conn, engine, msg.report))
            self._ack(conn, msg.report.seq)
        elif kind == "reports":
            reports = msg.reports.reports
            applied = merged = 0
            for report in reports:
                one = self._on_report(conn, engine, report)
                applied += one is not None
                merged += bool(one)
            if applied:
                self._count_applied(merged, applied)
            if reports:
                self._ack(conn, reports[-1].seq)
            self.counters["report_batches"] += 1
        elif kind == "heartbeat":
            self._on_heartbeat(conn, engine, msg.heartbeat)
            self.counters["heartbeats"] += 1
            return
        else:
            self.counters["unexpected_message"] += 1
            return
        if msg.HasField("beat"):  # after the reports, as a Heartbeat sent right after them
            self._on_heartbeat(conn, engine, msg.beat)
            self.counters["report_beats"] += 1

    def _check_reconnected(self, rank_id: RankId, conn_id: int) -> None:
        """A rank whose stream closed and did not come back within the grace period takes its
        engine down now (a killed process), rather than after the heartbeat timeout."""
        rank = self.registry.rank(rank_id)
        engine = self.registry.engine(rank_id.engine_id)
        if rank is not None and engine is not None and rank.conn_id == conn_id and not rank.connected:
            self.engine_down(EngineRef(engine.engine_id, engine.epoch),
                             f"rank tp={rank_id.tp_rank} pp={rank_id.pp_rank} lost its control stream (closed by the rank, or its connection stopped answering PINGs)")

    def _on_heartbeat(self, conn: RankConnection, engine: EngineState, beat: pb.Heartbeat) -> None:
        if conn.rank_id == engine.leader:
            load = None
            if beat.HasField("load"):
                m = beat.load
                load = LoadInfo(m.num_running, m.num_waiting, m.kv_usage, m.num_pinned, m.num_free_blocks)
            self.registry.update_load(engine.engine_id, load or engine.load, beat.draining)
            role = ROLE_FROM_PB.get(beat.role)
            if role is not None and beat.role_epoch:
                old = self.registry.follow_role(engine.engine_id, role, beat.role_epoch)
                if old is not None:
                    self._role_changed(engine, old)

    # -- roles ---------------------------------------------------------------------------------

    def set_role(self, engine_id: str, role: Role, reason: str) -> int:
        """Asks the engine to serve `role` (see the module contracts); returns the role
        generation asked for. Raises KeyError for an unknown engine, ValueError when it is not
        healthy or already serves `role`."""
        engine = self.registry.engine(engine_id)
        if engine is None:
            raise KeyError(engine_id)
        if not engine.healthy:
            raise ValueError(f"engine {engine_id} is not healthy")
        if engine.role == role:
            raise ValueError(f"engine {engine_id} already serves {role}")
        role_epoch = engine.role_epoch + 1
        msg = pb.SchedulerMessage(set_role=pb.SetRole(role=ROLE_TO_PB[role], role_epoch=role_epoch, reason=reason))
        own = [c for c in self.connections.values() if c.rank_id.engine_id == engine_id and c.epoch == engine.epoch]
        for conn in own:
            conn.queue.put_nowait(msg)
        if role.side == Role.DECODE and engine.role.side == Role.PREFILL:
            peers = [peer_info_to_proto(e, r) for e in self.registry.by_role(Role.PREFILL)
                     if e.engine_id != engine_id for r in e.ranks.values()]
            for conn in own:
                conn.queue.put_nowait(pb.SchedulerMessage(peer_update=pb.PeerUpdate(joined=peers)))
        elif role.side == Role.PREFILL and engine.role.side == Role.DECODE:
            joined = [peer_info_to_proto(engine, r) for r in engine.ranks.values()]
            for conn in self.connections.values():
                if conn.role == Role.DECODE and conn.rank_id.engine_id != engine_id:
                    conn.queue.put_nowait(pb.SchedulerMessage(peer_update=pb.PeerUpdate(joined=joined)))
        logger.info("engine %s: asked to change role %s -> %s (role epoch %d): %s", engine_id, engine.role, role,
                    role_epoch, reason)
        return role_epoch

    def _role_changed(self, engine: EngineState, old: Role) -> None:
        for conn in self.connections.values():
            if conn.rank_id.engine_id == engine.engine_id:
                conn.role = engine.role.side
        self.counters["role_changes"] += 1
        logger.info("engine %s now serves %s (was %s, role epoch %d)", engine.engine_id, engine.role, old,
                    engine.role_epoch)
        for hook in self.on_role_changed:
            hook(engine, old)

    def _count_applied(self, merged: bool | int | None, applied: int = 1) -> None:
        """Counts `applied` reports of one message, `merged` of them carrying other ranks' events
        (None: the message's report was not applied): one counter update per message."""
        if merged is None:
            return
        self.counters["reports_applied"] += applied
        self.telemetry.metrics.count_rank_reports(applied - int(merged), int(merged))

    def _on_report(self, conn: RankConnection, engine: EngineState, report: pb.StepReport) -> bool | None:
        """Applies a new report once (the caller acknowledges and counts it): None when it was
        not applied (a duplicate, malformed), else whether it merges other ranks' events."""
        if report.seq == 0:
            self.counters["reports_malformed"] += 1
            return None
        if self.registry.accept_seq(conn.rank_id, conn.conn_id, report.seq):
            if report.position and _leads(conn.rank_id):
                self.positions.advance(engine.engine_id, engine.epoch, report.position)
            try:
                self.apply_report(engine, conn.rank_id, report)
                return bool(report.merged_event_ranks)
            except CompactEventsError as e:
                self.counters["reports_malformed"] += 1
                self.counters["reports_malformed_compact_events"] += 1
                if isinstance(e, CompactKindsError):
                    self.counters["reports_malformed_compact_kinds"] += 1
                logger.warning("dropped report %d of %s: %s", report.seq, conn.rank_id, e)
            except ValueError as e:
                self.counters["reports_malformed"] += 1
                logger.warning("dropped report %d of %s: %s", report.seq, conn.rank_id, e)
            return None
        self.counters["reports_duplicate"] += 1
        return None

    def _ack(self, conn: RankConnection, seq: int) -> None:
        """Acknowledges the rank's last applied seq (`seq` when the rank is gone): at once when
        the stream's last Ack is an ack interval old, else once at the interval's end."""
        if conn.ack_scheduled:
            return
        loop = asyncio.get_running_loop()
        due = conn.acked_at + self.ack_interval_s
        if loop.time() >= due:
            self._send_ack(conn, seq)
        else:
            conn.ack_scheduled = True
            loop.call_at(due, self._trailing_ack, conn, seq)

    def _trailing_ack(self, conn: RankConnection, seq: int) -> None:
        conn.ack_scheduled = False
        if self.connections.get(conn.rank_id) is conn:
            self._send_ack(conn, seq)

    def _send_ack(self, conn: RankConnection, seq: int) -> None:
        rank = self.registry.rank(conn.rank_id)
        acked = rank.last_applied_seq if rank is not None else seq
        conn.acked_at = asyncio.get_running_loop().time()
        conn.queue.put_nowait(pb.SchedulerMessage(ack=pb.Ack(seq=acked)))

    def _apply_compact(self, engine: EngineState, own: int, merged: tuple[int, ...], transfer_ranks: tuple[int, ...],
                       report: pb.StepReport, engine_batch: ProtoBackedBatch | None) -> None:
        """`apply_report` for worker events in compact form: counted from the hash array, a copy
        that another rank of the step already sent neither decoded nor applied on its own
        (`EventJoiner`), published as a `CompactBatch` when every event is (the common case),
        else the published ones decoded from the events' protobuf bytes."""
        if report.worker_events or report.packed_worker_events:
            raise CompactEventsError("a report carries compact_worker_events and another form of worker events")
        m = report.compact_worker_events
        compact, published = self.joiner.add(engine.engine_id, engine.epoch, (own, *merged), engine.tp_size * engine.pp_size,
                                       m.SerializeToString(), lambda: compact_from_proto(m, self.verify_compact))
        if engine_batch is not None:
            self.sink.publish(engine.engine_id, engine.epoch, engine_batch)
        self._publish_compact(engine.engine_id, engine.epoch, compact, published)
        self._apply_transfers(engine, own, transfer_ranks, report)

    def _publish_compact(self, engine_id: str, epoch: int, compact: compact_events.CompactEvents,
                         published: list[int] | None) -> None:
        """Publishes what the aggregator released of compact events (None: all of them)."""
        if published is None:
            self.sink.publish(engine_id, epoch, CompactBatch(time.time(), compact))
        elif published:
            events = compact.events()
            self.sink.publish(engine_id, epoch, KVEventBatch(ts=time.time(), events=[events[i] for i in published]))

    def _apply_transfers(self, engine: EngineState, own: int, transfer_ranks: tuple[int, ...],
                         report: pb.StepReport) -> None:
        """The report's transfer results (skipped when it has none, the common report)."""
        if not (report.finished_sending or report.finished_recving or report.failed_recving
                or report.invalid_block_ids or report.transfer_stats):
            return
        result = self.aggregator.add_report(engine.engine_id, engine.epoch, own, output_from_proto(report, ()))
        self._merge_transfers(engine, transfer_ranks, report, result)
        self._finish(engine, report, result)

    def _engine_batch(self, engine: EngineState, rank_id: RankId, report: pb.StepReport) -> ProtoBackedBatch | None:
        """Rank 0's engine-level events of the report, None when it has none (or the sender is
        not rank 0: ignored, as always). Compact ones (`compact_engine_events`) become a
        `CompactBatch` with the header's ts and data_parallel_rank, no object per event;
        CompactEventsError when they are malformed (checked before anything applies)."""
        if not _leads(rank_id):
            return None
        m = report.engine_events
        dp = m.data_parallel_rank if m.HasField("data_parallel_rank") else None
        if report.HasField("compact_engine_events"):
            if m.events:
                raise CompactEventsError("a report carries compact_engine_events and engine_events.events")
            compact = compact_from_proto(report.compact_engine_events, self.verify_compact, "engine events: ")
            self.counters["reports_compact_engine_events"] += 1
            return CompactBatch(m.ts, compact, dp)
        if m.events:
            return ProtoBackedBatch(ts=m.ts, events=[event_from_proto(e) for e in m.events], proto_events=m.events,
                                    data_parallel_rank=dp)
        return None

    def _merge_transfers(self, engine: EngineState, transfer_ranks: tuple[int, ...], report: pb.StepReport,
                         result: AggregatedResult) -> None:
        """The sender's transfer results count once for each rank of `transfer_ranks` too (a rank
        the aggregator already counted for an id is not counted again)."""
        if transfer_ranks:
            result.merge(self.aggregator.add_reports(engine.engine_id, engine.epoch,
                                                     dict.fromkeys(transfer_ranks, output_from_proto(report, ()))))

    def _finish(self, engine: EngineState, report: pb.StepReport, result: AggregatedResult) -> None:
        """The transfer outcomes and byte counts of an applied report."""
        ref = EngineRef(engine.engine_id, engine.epoch)
        outcomes: list[TransferOutcome] = []
        for request_id in result.finished_recving:
            outcomes += self.tracker.on_recving(ref, request_id, request_id in result.failed_recving,
                                                result.invalid_block_ids.get(request_id, ()))
        for request_id in result.finished_sending:
            outcomes += self.tracker.on_sending(ref, request_id)
        for stat in report.transfer_stats:
            self.transfer_bytes[(stat.src_engine_id, stat.dst_engine_id)] += stat.num_bytes
        for outcome in outcomes:
            self.on_transfer_outcome(outcome)

    def apply_report(self, engine: EngineState, rank_id: RankId, report: pb.StepReport) -> None:
        """Feeds one new report to the aggregator, tracker and event sink (ValueError: malformed,
        nothing applied)."""
        own = global_rank(engine, rank_id)
        merged = merged_event_ranks(report, own, engine.tp_size * engine.pp_size)
        transfer_ranks = merged_transfer_ranks(report, own, engine.tp_size * engine.pp_size)
        engine_batch = self._engine_batch(engine, rank_id, report)
        if report.HasField("compact_worker_events"):
            self._apply_compact(engine, own, merged, transfer_ranks, report, engine_batch)
            return
        # Copies of these events still to come from other ranks (none when this report merges them).
        uses = engine.tp_size * engine.pp_size - len(merged)
        events = self.worker_events.decode(engine.engine_id, engine.epoch, uses, report)
        if events:
            self.joiner.flush(engine.engine_id)  # its noted compact copies apply first
        if merged and not events:
            raise ValueError("merged_event_ranks without worker events")
        output = output_from_proto(report, events)
        if merged:
            # The events count once for each listed rank and the sender (§3's per-rank counting,
            # applied with the ranks' joint mask: the same state as rank by rank), then the
            # sender's own transfer results. Everything is validated before anything applies.
            result = self.aggregator.add_shared_events(engine.engine_id, engine.epoch, (own, *merged), events)
            result.merge(self.aggregator.add_report(engine.engine_id, engine.epoch, own,
                                                    output_from_proto(report, ())))
        else:
            result = self.aggregator.add_report(engine.engine_id, engine.epoch, own, output)
        self._merge_transfers(engine, transfer_ranks, report, result)
        if engine_batch is not None:
            self.sink.publish(engine.engine_id, engine.epoch, engine_batch)
        if result.events:
            batch: KVEventBatch
            if same_events(result.events, events):
                # Every decoded event of this report, in order: the report's own protobuf
                # events (or their packed bytes) describe the batch, so the gRPC encoding
                # copies them.
                packed = report.packed_worker_events
                batch = (ProtoBackedBatch(ts=time.time(), events=result.events, events_wire=packed) if packed else
                         ProtoBackedBatch(ts=time.time(), events=result.events, proto_events=report.worker_events))
            else:
                batch = KVEventBatch(ts=time.time(), events=result.events)
            self.sink.publish(engine.engine_id, engine.epoch, batch)
        self._finish(engine, report, result)
