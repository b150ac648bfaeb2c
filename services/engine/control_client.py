"""The rank side of the control stream (protos/pdserve/v1/control.proto), used by every rank.

`ControlClient` runs its own asyncio loop in a daemon thread, so a synchronous engine loop can
use it with plain calls:

    client = ControlClient("127.0.0.1:50052", ControlHello(identity, compat_hash, address, blob))
    welcome = client.start()              # blocks until registered; peers' handshake metadata
    seq = client.report(StepReport(finished_recving=["r1"]))
    for msg in client.poll():             # KVReady / KVFailed / ReleaseBlocks / PeerUpdate / Welcome
        ...
    client.set_load(EngineLoad(...))      # rank 0: sent with the next heartbeat
    client.close()

Contracts:
- Reports get per-rank sequence numbers 1, 2, 3 ... in `report()` order and are sent in that
  order. A report stays buffered until the scheduler acknowledges its seq; after a reconnect
  (stream lost, scheduler restarted) every report above the new Welcome's `last_acked_seq` is
  sent again, in order, so nothing is lost and the scheduler (which ignores seq <= its last
  applied) counts nothing twice. At most `max_unacked` reports are buffered; beyond that the
  oldest are dropped and counted in `num_dropped`. Reports that queued up while the stream was
  busy go out together, up to `max_reports_per_message` (and the scheduler's limit from
  Welcome) per ReportBatch message, acknowledged once per message (or less often: the
  scheduler may throttle Acks; they are cumulative). Worker events are encoded once into
  `packed_worker_events` when the scheduler's Welcome accepts that (else, and for a report
  resent to a scheduler that does not, as `worker_events`); a step's events that are all
  BlockStored of one medium and group with int hashes go as `compact_worker_events` to a
  scheduler that accepts that (resent to one that does not: as packed, or plain, events); rank
  0's engine events that qualify likewise go as `compact_engine_events` to a scheduler whose
  Welcome sets `accepts_compact_engine_events` (resent to one that does not: as
  `engine_events.events`); steps that mix BlockRemoved among those BlockStored go compact only
  while the Welcome sets `accepts_mixed_compact_events` (resent to one that does not: as
  packed / plain worker events, `engine_events.events`). A report may carry the identical
  worker events of other ranks of its engine (`StepReport.merged_event_ranks`, global ranks),
  gathered by the caller over the engine's own collective, only while the Welcome's
  `accepts_merged_worker_events` is true (else `report` raises ValueError); resent to a
  scheduler that no longer accepts them, their blocks are never whole there (under-reported,
  never wrong). Likewise a report may carry the identical transfer results of other ranks
  (`StepReport.merged_transfer_ranks`) only while the Welcome's
  `accepts_merged_transfer_results` is true; resent to a scheduler that no longer accepts them,
  those transfers never finish there (they fail over by the tracker's and the lease's
  timeouts, as for a silent rank).
- Heartbeats go every Welcome `heartbeat_interval`; a rank other than rank 0 skips a beat when
  it sent reports since its last one (every message counts as liveness for the scheduler; rank
  0's beats also carry the engine's load, draining flag and role). To a scheduler whose Welcome
  sets `accepts_report_beats`, rank 0's beat rides on its report messages (`RankMessage.beat`,
  on the last message of what goes out together) once half an interval passed since its last
  beat, so a rank 0 that reports at least that often sends no heartbeat message of its own;
  `heartbeat_now()` puts one on the next message.
- Reconnects back off exponentially (`backoff_initial_s` doubling up to `backoff_max_s`) and
  resend the same Hello (same epoch). After every reconnect a fresh `Welcome` is delivered
  through `poll()` (and the callback), so the rank can refresh its peers.
- A refusal (FAILED_PRECONDITION: incompatible or fenced; INVALID_ARGUMENT: malformed Hello)
  is final: `start()` raises `ControlRefusedError`, or, after a successful start, the client
  stops and `error` holds it.
- With `security` the stream is TLS and presents the rank's certificate (mTLS). A scheduler that
  rejects the certificate ends the TLS handshake without a reason, so that looks like an
  unreachable scheduler (UNAVAILABLE, retried with backoff), never like a registration.
- `on_message`, when given, is called from the client thread for every message, in order;
  it must not block. Without it, `poll()` returns the messages instead (drain, don't push);
  with it nothing is kept for `poll()` (a rank that never polls must not grow an inbox).
- One client talks to one scheduler; `services.engine.control_fanout.ControlFanout` keeps one
  per scheduler replica.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace

import grpc

from pdserve.v1 import control_pb2 as pb
from pdserve.v1 import control_pb2_grpc
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.security import ChannelSecurity, open_channel
from services.engine.control_messages import (
    PROTOCOL_VERSION,
    ROLES_TO_PB,
    ControlHello,
    ControlMessage,
    EngineLoad,
    KVFailed,
    KVReady,
    Peer,
    PeerUpdate,
    RankIdentity,
    ReleaseBlocks,
    SchedulerLost,
    SetRole,
    StepReport,
    TransferStat,
    Welcome,
    downgrade_report,
    message_from_proto,
    report_to_proto,
)

logger = logging.getLogger(__name__)

# Re-exported: the engine and its tests import the messages from here.
__all__ = [
    "ControlClient",
    "ControlHello",
    "ControlMessage",
    "ControlRefusedError",
    "EngineLoad",
    "KVFailed",
    "KVReady",
    "PROTOCOL_VERSION",
    "Peer",
    "PeerUpdate",
    "RankIdentity",
    "ReleaseBlocks",
    "SchedulerLost",
    "SetRole",
    "StepReport",
    "TransferStat",
    "Welcome",
    "downgrade_report",
    "message_from_proto",
    "report_to_proto",
]

_FINAL_CODES = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)


class ControlRefusedError(RuntimeError):
    """The scheduler refused this rank's registration (final; the reason is the message)."""

    def __init__(self, code: grpc.StatusCode, reason: str) -> None:
        super().__init__(f"{code.name}: {reason}")
        self.code = code
        self.reason = reason


class ControlClient:
    """One rank's control stream (see the module docstring for the contracts)."""

    def __init__(self, target: str, hello: ControlHello, *,
                 on_message: Callable[[ControlMessage], None] | None = None,
                 backoff_initial_s: float = 0.05, backoff_max_s: float = 2.0,
                 max_unacked: int = 100_000, max_reports_per_message: int = 64,
                 security: ChannelSecurity | None = None) -> None:
        self.target = target
        self.security = security
        self.hello = hello
        self.on_message = on_message
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.max_unacked = max_unacked
        self.max_reports_per_message = max_reports_per_message
        self.welcome: Welcome | None = None
        self.error: ControlRefusedError | None = None
        self.num_reconnects = 0
        self.num_dropped = 0
        self._lock = threading.Lock()
        self._seq = 0
        self._acked = 0
        # The position of the next report (Hello.first_position when nothing is unacked); the
        # fan-out sets it for a stream that joins an engine already reporting.
        self.next_position = 1
        self._unacked: dict[int, pb.StepReport] = {}
        self._inbox: deque[ControlMessage] = deque()
        self._load: EngineLoad | None = None
        self._draining = False
        self._beat_now = False
        self._connected = False
        self._closed = False
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    # -- thread-safe API -----------------------------------------------------------------------

    def start(self, timeout: float | None = 30.0) -> Welcome:
        """Starts the client thread and blocks until the first Welcome. Raises
        ControlRefusedError when refused, TimeoutError when no Welcome came in time (the client
        keeps trying in the background)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._thread_main, name="control-client", daemon=True)
            self._thread.start()
        if not self._started.wait(timeout):
            raise TimeoutError(f"no Welcome from the scheduler at {self.target} within {timeout} s")
        if self.error is not None:
            raise self.error
        if self.welcome is None:
            raise RuntimeError("control client stopped before it was welcomed")
        return self.welcome

    def report(self, report: StepReport) -> int:
        """Queues a report (thread-safe) and returns its seq. ValueError (nothing queued): the
        report merges other ranks' events (`merged_event_ranks`) without worker events, or the
        scheduler's Welcome does not accept merged events; likewise for other ranks' transfer
        results (`merged_transfer_ranks`) without transfer results or without the Welcome's
        `accepts_merged_transfer_results`."""
        if report.merged_event_ranks:
            if not report.worker_events:
                raise ValueError("merged_event_ranks without worker events")
            if self.welcome is None or not self.welcome.accepts_merged_worker_events:
                raise ValueError("the scheduler does not accept merged worker events "
                                 "(Welcome.accepts_merged_worker_events)")
        if report.merged_transfer_ranks:
            if not (report.finished_sending or report.finished_recving or report.failed_recving):
                raise ValueError("merged_transfer_ranks without transfer results")
            if self.welcome is None or not self.welcome.accepts_merged_transfer_results:
                raise ValueError("the scheduler does not accept merged transfer results "
                                 "(Welcome.accepts_merged_transfer_results)")
        with self._lock:
            self._seq += 1
            seq = self._seq
            packed = self.welcome is not None and self.welcome.accepts_packed_worker_events
            compact = self.welcome is not None and self.welcome.accepts_compact_worker_events
            compact_engine = self.welcome is not None and self.welcome.accepts_compact_engine_events
            mixed = self.welcome is not None and self.welcome.accepts_mixed_compact_events
            if report.position:
                self.next_position = report.position + 1
            self._unacked[seq] = report_to_proto(seq, report, self.hello.identity, packed=packed, compact=compact,
                                                 compact_engine=compact_engine, mixed=mixed)
            while len(self._unacked) > self.max_unacked:
                del self._unacked[next(iter(self._unacked))]
                self.num_dropped += 1
        self._poke()
        return seq

    def poll(self) -> list[ControlMessage]:
        """Drains the messages received since the last poll, in order."""
        out: list[ControlMessage] = []
        while self._inbox:
            out.append(self._inbox.popleft())
        return out

    def set_load(self, load: EngineLoad | None, draining: bool = False) -> None:
        """Load and draining flag sent with every heartbeat from now on (rank 0)."""
        self._load, self._draining = load, draining

    def set_role(self, role: str, role_epoch: int) -> None:
        """The role this engine serves now: stated in every heartbeat (rank 0) and in the Hello
        of every later (re)connect."""
        self.hello = replace(self.hello, identity=replace(self.hello.identity, role=role), role_epoch=role_epoch)
        self.heartbeat_now()

    def heartbeat_now(self) -> None:
        """Sends a heartbeat (with the current load) without waiting for the interval: on the
        next report message where it may ride on one, else as a message of its own."""
        self._beat_now = True
        self._poke()

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def last_acked_seq(self) -> int:
        return self._acked

    @property
    def last_seq(self) -> int:
        return self._seq

    def num_unacked(self) -> int:
        with self._lock:
            return len(self._unacked)

    def wait_acked(self, seq: int, timeout: float = 10.0) -> bool:
        """Blocks until `seq` is acknowledged (True) or the timeout passes (False)."""
        deadline = time.monotonic() + timeout
        while self._acked < seq:
            if time.monotonic() >= deadline or self.error is not None:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Stops the stream and the thread; idempotent."""
        self._closed = True
        self._poke()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- the client thread ---------------------------------------------------------------------

    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:
                pass  # loop closed in between

    def _thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        finally:
            self._started.set()
            loop.close()

    async def _main(self) -> None:
        self._wake = asyncio.Event()
        backoff = self.backoff_initial_s
        first = True
        while not self._closed:
            if not first:
                self.num_reconnects += 1
            first = False
            try:
                registered = await self._session()
            except ControlRefusedError as e:
                logger.error("scheduler %s refused rank %s: %s", self.target, self.hello.identity, e)
                self.error = e
                return
            self._connected = False
            if self._closed:
                return
            if registered:
                backoff = self.backoff_initial_s
            await self._sleep(backoff)
            backoff = min(self.backoff_max_s, backoff * 2)

    async def _sleep(self, seconds: float) -> None:
        assert self._wake is not None
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except TimeoutError:
            pass
        self._wake.clear()

    async def _session(self) -> bool:
        """One connection; returns whether it got as far as a Welcome."""
        registered = False
        channel = open_channel(self.target, self.security, CHANNEL_OPTIONS)
        try:
            stub = control_pb2_grpc.ControlStub(channel)
            call = stub.Connect(self._outgoing())
            async for msg in call:
                registered |= self._on_incoming(msg)
        except grpc.aio.AioRpcError as e:
            if e.code() in _FINAL_CODES:
                raise ControlRefusedError(e.code(), e.details() or "") from None
            logger.info("control stream to %s lost (%s); reconnecting", self.target, e.code().name)
        except (OSError, RuntimeError, ValueError) as e:
            logger.warning("control stream to %s failed (%s); reconnecting", self.target, e)
        finally:
            await channel.close(None)
        return registered

    def _on_incoming(self, msg: pb.SchedulerMessage) -> bool:
        if msg.WhichOneof("payload") == "ack":
            with self._lock:
                self._acked = max(self._acked, msg.ack.seq)
                for seq in [s for s in self._unacked if s <= msg.ack.seq]:
                    del self._unacked[seq]
            return False
        converted = message_from_proto(msg)
        if converted is None:
            return False
        if isinstance(converted, Welcome):
            with self._lock:
                self._acked = converted.last_acked_seq
                for seq in [s for s in self._unacked if s <= converted.last_acked_seq]:
                    del self._unacked[seq]
            self.welcome = converted
            self._connected = True
            self._started.set()
        if self.on_message is None:
            self._inbox.append(converted)
        else:
            try:
                self.on_message(converted)
            except Exception:
                logger.exception("control message callback failed")
        return isinstance(converted, Welcome)

    def _hello_proto(self) -> pb.RankMessage:
        h = self.hello
        msg = pb.Hello(rank=h.identity.to_proto(), compatibility_hash=h.compatibility_hash,
                       protocol_version=h.protocol_version, engine_address=h.engine_address,
                       handshake_metadata=h.handshake_metadata, last_sent_seq=self._seq,
                       first_position=self._first_position(), role_epoch=h.role_epoch)
        if h.hash_seed is not None:
            msg.hash_seed = h.hash_seed
        if h.block_size is not None:
            msg.block_size = h.block_size
        if h.dtype is not None:
            msg.dtype = h.dtype
        if h.device_kind is not None:
            msg.device_kind = h.device_kind
        return pb.RankMessage(hello=msg)

    def _first_position(self) -> int:
        """Hello.first_position: the oldest unacked report's position, else the next one's."""
        with self._lock:
            oldest = next(iter(self._unacked.values()), None)
            return oldest.position if oldest is not None and oldest.position else self.next_position

    async def _outgoing(self) -> AsyncIterator[pb.RankMessage]:
        """Hello, then (once welcomed) the unacked reports in seq order and heartbeats."""
        assert self._wake is not None
        yield self._hello_proto()
        while not self._connected and not self._closed:
            await self._sleep(0.05)
        sent_upto = self._acked
        last_beat = 0.0
        while not self._closed:
            with self._lock:
                pending = [m for s, m in self._unacked.items() if s > sent_upto]
            if self.welcome is not None:
                for m in pending:  # encoded for a scheduler that was replaced by an older one
                    downgrade_report(m, self.welcome)
            interval = self.welcome.heartbeat_interval_s if self.welcome and self.welcome.heartbeat_interval_s > 0 else 1.0
            if pending:
                beat = self._riding_beat(time.monotonic() - last_beat, interval)
                for msg in self._report_messages(pending, beat):
                    yield msg
                sent_upto = pending[-1].seq
                if beat is not None or not self._leader:
                    # Any message proves liveness; only rank 0's beats carry something more (load).
                    last_beat = time.monotonic()
            now = time.monotonic()
            if now - last_beat >= interval or self._beat_now:
                last_beat, self._beat_now = now, False
                yield pb.RankMessage(heartbeat=self._heartbeat())
            await self._sleep(max(0.0, interval - (time.monotonic() - last_beat)))

    def _report_messages(self, pending: list[pb.StepReport], beat: pb.Heartbeat | None) -> Iterator[pb.RankMessage]:
        """`pending` in messages of at most the agreed number of reports, built one at a time (a
        resent backlog is not copied at once); `beat` rides on the last."""
        limit = max(1, min(self.max_reports_per_message, self.welcome.max_reports_per_message if self.welcome else 1))
        for i in range(0, len(pending), limit):
            chunk = pending[i:i + limit]
            last = i + limit >= len(pending)
            yield pb.RankMessage(report=chunk[0], beat=beat if last else None) if len(chunk) == 1 else \
                pb.RankMessage(reports=pb.ReportBatch(reports=chunk), beat=beat if last else None)

    def _riding_beat(self, since_beat_s: float, interval_s: float) -> pb.Heartbeat | None:
        """Rank 0's heartbeat to ride on the reports about to go (a scheduler that takes them):
        once half an interval passed since the last beat, or when one is asked for now. A rank
        that reports at least every half interval then sends no heartbeat message of its own,
        and its load is never older than a beat every interval would leave it."""
        if not (self._leader and self.welcome is not None and self.welcome.accepts_report_beats):
            return None
        if not self._beat_now and since_beat_s < interval_s / 2:
            return None
        self._beat_now = False
        return self._heartbeat()

    @property
    def _leader(self) -> bool:
        return self.hello.identity.tp_rank == 0 and self.hello.identity.pp_rank == 0

    def _heartbeat(self) -> pb.Heartbeat:
        beat = pb.Heartbeat(draining=self._draining, role=ROLES_TO_PB[self.hello.identity.role],
                            role_epoch=self.hello.role_epoch)
        load = self._load
        if load is not None and self.hello.identity.tp_rank == 0 and self.hello.identity.pp_rank == 0:
            beat.load.CopyFrom(pb.EngineLoad(num_running=load.num_running, num_waiting=load.num_waiting,
                                             kv_usage=load.kv_usage, num_pinned=load.num_pinned,
                                             num_free_blocks=load.num_free_blocks))
        return beat
