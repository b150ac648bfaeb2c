"""The rank side's control messages (protos/pdserve/v1/control.proto): the dataclasses a rank
speaks in (`RankIdentity`, `ControlHello`, `StepReport`, `EngineLoad`, and what the scheduler
sends: `Welcome`, `PeerUpdate`, `KVReady`, `KVFailed`, `ReleaseBlocks`, `SetRole`) and their
protobuf conversions. `services.engine.control_client` sends and receives them (and re-exports
them); the contracts of each form are in its module docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from connectors import compact_events
from connectors.kv_events import KVCacheEvent, KVEventBatch, event_to_proto
from pdserve.v1 import control_pb2 as pb
from pdserve.v1 import kv_events_pb2

PROTOCOL_VERSION = 1
ROLES_TO_PB = {"prefill": pb.ROLE_PREFILL, "decode": pb.ROLE_DECODE, "mixed": pb.ROLE_MIXED}
ROLES_FROM_PB = {v: k for k, v in ROLES_TO_PB.items()}


@dataclass(frozen=True, slots=True)
class RankIdentity:
    engine_id: str
    role: str  # "prefill", "decode" or "mixed"
    epoch: int
    tp_rank: int
    tp_size: int
    pp_rank: int = 0
    pp_size: int = 1

    def to_proto(self) -> pb.RankIdentity:
        return pb.RankIdentity(engine_id=self.engine_id, role=ROLES_TO_PB[self.role], epoch=self.epoch,
                               tp_rank=self.tp_rank, tp_size=self.tp_size, pp_rank=self.pp_rank,
                               pp_size=self.pp_size)

    @staticmethod
    def from_proto(m: pb.RankIdentity) -> RankIdentity:
        return RankIdentity(m.engine_id, ROLES_FROM_PB.get(m.role, "unspecified"), m.epoch, m.tp_rank, m.tp_size,
                            m.pp_rank, m.pp_size)


@dataclass(frozen=True, slots=True)
class ControlHello:
    """What a rank says about itself at registration."""

    identity: RankIdentity
    compatibility_hash: str
    engine_address: str
    handshake_metadata: bytes = b""
    hash_seed: str | None = None
    block_size: int | None = None
    protocol_version: int = PROTOCOL_VERSION
    dtype: str | None = None
    device_kind: str | None = None
    role_epoch: int = 0  # the role generation `identity.role` belongs to (SetRole)


@dataclass(frozen=True, slots=True)
class Peer:
    rank: RankIdentity
    engine_address: str
    handshake_metadata: bytes


@dataclass(frozen=True, slots=True)
class Welcome:
    expected_ranks: list[RankIdentity]
    peers: list[Peer]
    last_acked_seq: int
    heartbeat_interval_s: float
    scheduler_id: str
    # Reports the scheduler accepts in one message (1: one report per message).
    max_reports_per_message: int = 1
    # Whether the scheduler takes worker events pre-encoded (StepReport.packed_worker_events).
    accepts_packed_worker_events: bool = False
    # Whether a report may carry other ranks' worker events (StepReport.merged_event_ranks).
    accepts_merged_worker_events: bool = False
    # Whether the scheduler takes a step's BlockStored in compact form (compact_worker_events).
    accepts_compact_worker_events: bool = False
    # Whether a report may carry other ranks' transfer results (StepReport.merged_transfer_ranks).
    accepts_merged_transfer_results: bool = False
    # Whether the scheduler takes rank 0's engine events in compact form (compact_engine_events).
    accepts_compact_engine_events: bool = False
    # Whether compact events may mix BlockStored and BlockRemoved (CompactEvents.kinds).
    accepts_mixed_compact_events: bool = False
    # Peer fetch on: a prefill rank connects to its peers too (it may pull from them).
    peer_fetch: bool = False
    # Whether rank 0's heartbeat may ride on a report message (RankMessage.beat).
    accepts_report_beats: bool = False


@dataclass(frozen=True, slots=True)
class PeerUpdate:
    joined: list[Peer]
    left: list[RankIdentity]


@dataclass(frozen=True, slots=True)
class KVReady:
    request_id: str


@dataclass(frozen=True, slots=True)
class KVFailed:
    """The transfer failed; recompute `invalid_block_ids` (all blocks not received when empty)."""

    request_id: str
    reason: str
    invalid_block_ids: list[int]


@dataclass(frozen=True, slots=True)
class ReleaseBlocks:
    request_id: str


@dataclass(frozen=True, slots=True)
class SetRole:
    """Serve `role` from now on, if `role_epoch` is the engine's role generation + 1."""

    role: str
    role_epoch: int
    reason: str


@dataclass(frozen=True, slots=True)
class SchedulerLost:
    """Not on the wire: the rank's `ControlFanout` declares a scheduler replica gone (its stream
    down past the loss timeout, or it came back as another scheduler id); the engine releases
    what it holds for the requests that replica owned."""

    scheduler_id: str


ControlMessage = Welcome | PeerUpdate | KVReady | KVFailed | ReleaseBlocks | SetRole | SchedulerLost


@dataclass(slots=True)
class TransferStat:
    src_engine_id: str
    dst_engine_id: str
    num_bytes: int = 0
    seconds: float = 0.0
    num_operations: int = 0
    num_failures: int = 0
    failures_by_reason: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class StepReport:
    """One rank's report for one step (fields as in control.proto's StepReport)."""

    finished_sending: list[str] = field(default_factory=list)
    finished_recving: list[str] = field(default_factory=list)
    failed_recving: list[str] = field(default_factory=list)
    invalid_block_ids: list[int] = field(default_factory=list)
    transfer_stats: list[TransferStat] = field(default_factory=list)
    worker_events: list[KVCacheEvent] = field(default_factory=list)
    # Rank 0 only: the engine's block-pool events of this step.
    engine_events: KVEventBatch | None = None
    worker_metadata: bytes = b""
    # Other ranks of this engine (pp_rank * tp_size + tp_rank) whose worker events of this step
    # are exactly `worker_events` (see the module docstring).
    merged_event_ranks: tuple[int, ...] = ()
    # Other ranks of this engine whose transfer results of this step are exactly this report's
    # finished_sending / finished_recving / failed_recving / invalid_block_ids (gathered by the
    # sender; see the module docstring).
    merged_transfer_ranks: tuple[int, ...] = ()
    # The rank's report position (1, 2, 3 ...), the same at every scheduler replica; 0: not
    # numbered. `ControlFanout.report` numbers the reports.
    position: int = 0


@dataclass(frozen=True, slots=True)
class EngineLoad:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_pinned: int = 0
    num_free_blocks: int = 0


def _peer(m: pb.PeerInfo) -> Peer:
    return Peer(RankIdentity.from_proto(m.rank), m.engine_address, m.handshake_metadata)


def message_from_proto(m: pb.SchedulerMessage) -> ControlMessage | None:
    """Converts a scheduler message (Acks excepted: None) into its dataclass."""
    kind = m.WhichOneof("payload")
    if kind == "welcome":
        w = m.welcome
        return Welcome([RankIdentity.from_proto(r) for r in w.expected_ranks], [_peer(p) for p in w.peers],
                       w.last_acked_seq, w.heartbeat_interval_ms / 1000.0, w.scheduler_id,
                       max(1, w.max_reports_per_message), w.accepts_packed_worker_events,
                       w.accepts_merged_worker_events, w.accepts_compact_worker_events,
                       w.accepts_merged_transfer_results, w.accepts_compact_engine_events,
                       w.accepts_mixed_compact_events, w.peer_fetch, w.accepts_report_beats)
    if kind == "peer_update":
        return PeerUpdate([_peer(p) for p in m.peer_update.joined],
                          [RankIdentity.from_proto(r) for r in m.peer_update.left])
    if kind == "kv_ready":
        return KVReady(m.kv_ready.request_id)
    if kind == "kv_failed":
        return KVFailed(m.kv_failed.request_id, m.kv_failed.reason, list(m.kv_failed.invalid_block_ids))
    if kind == "release":
        return ReleaseBlocks(m.release.request_id)
    if kind == "set_role" and m.set_role.role in ROLES_FROM_PB:
        return SetRole(ROLES_FROM_PB[m.set_role.role], m.set_role.role_epoch, m.set_role.reason)
    return None


def report_to_proto(seq: int, r: StepReport, identity: RankIdentity, *, packed: bool = False,
                    compact: bool = False, compact_engine: bool = False, mixed: bool = False) -> pb.StepReport:
    """The report as protobuf; `compact` encodes worker events that qualify (BlockStored of
    one medium and group, int hashes; with `mixed` BlockRemoved too) once into
    `compact_worker_events`, `packed` the others into `packed_worker_events` (each for a
    scheduler that accepts it), else `worker_events`; `compact_engine` likewise puts engine
    events that qualify in `compact_engine_events` (`engine_events` keeping the batch's
    header), else in `engine_events.events`."""
    msg = pb.StepReport(seq=seq, finished_sending=r.finished_sending, finished_recving=r.finished_recving,
                        failed_recving=r.failed_recving, invalid_block_ids=r.invalid_block_ids,
                        worker_metadata=r.worker_metadata, merged_event_ranks=r.merged_event_ranks,
                        merged_transfer_ranks=r.merged_transfer_ranks, position=r.position)
    c = compact_events.encode(r.worker_events, mixed) if compact else None
    events = [] if c is not None else [event_to_proto(e) for e in r.worker_events]
    if c is not None:
        msg.compact_worker_events.CopyFrom(compact_events.to_proto(c))
    elif packed and events:
        msg.packed_worker_events = kv_events_pb2.EventBatch(events=events).SerializeToString()
    else:
        msg.worker_events.extend(events)
    for s in r.transfer_stats:
        msg.transfer_stats.append(pb.TransferStat(
            src_engine_id=s.src_engine_id, dst_engine_id=s.dst_engine_id, num_bytes=s.num_bytes,
            seconds=s.seconds, num_operations=s.num_operations, num_failures=s.num_failures,
            failures_by_reason=s.failures_by_reason))
    if r.engine_events is not None:
        batch = kv_events_pb2.EventBatch(ts=r.engine_events.ts, engine_id=identity.engine_id, epoch=identity.epoch)
        ce = compact_events.encode(r.engine_events.events, mixed) if compact_engine else None
        if ce is not None:
            msg.compact_engine_events.CopyFrom(compact_events.to_proto(ce))
        else:
            batch.events.extend(event_to_proto(e) for e in r.engine_events.events)
        if r.engine_events.data_parallel_rank is not None:
            batch.data_parallel_rank = r.engine_events.data_parallel_rank
        msg.engine_events.CopyFrom(batch)
    return msg


def downgrade_report(m: pb.StepReport, welcome: Welcome) -> None:
    """Rewrites `m` in place into the forms `welcome`'s scheduler understands: compact worker
    events as packed ones, compact engine events into `engine_events.events` (mixed compact
    events too for a scheduler that does not read `kinds`), packed worker events as
    `worker_events` (the same events; nothing else changes)."""
    mixed = welcome.accepts_mixed_compact_events
    if m.HasField("compact_worker_events") and not (
            welcome.accepts_compact_worker_events and (mixed or not m.compact_worker_events.kinds)):
        m.packed_worker_events = m.compact_worker_events.events_wire
        m.ClearField("compact_worker_events")
    if m.HasField("compact_engine_events") and not (
            welcome.accepts_compact_engine_events and (mixed or not m.compact_engine_events.kinds)):
        m.engine_events.MergeFromString(m.compact_engine_events.events_wire)  # only `events` set: appended
        m.ClearField("compact_engine_events")
    if not welcome.accepts_packed_worker_events and m.packed_worker_events:
        m.worker_events.extend(kv_events_pb2.EventBatch.FromString(m.packed_worker_events).events)
        m.ClearField("packed_worker_events")
