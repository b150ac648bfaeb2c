"""Protobuf to the scheduler's core for the Control stream: Hellos to `RankHello`, reports to
`KVConnectorOutput`, worker events (plain, packed, merged across ranks) decoded once per
distinct form (`WorkerEventDecoder`). Pure: every function raises ValueError (or a
`CompactEventsError`) for a malformed message and changes no state.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from connectors import compact_events
from connectors.kv_events import KVCacheEvent, event_from_proto
from connectors.outputs import KVConnectorOutput
from pdserve.v1 import control_pb2 as pb
from pdserve.v1 import kv_events_pb2
from services.scheduler.registry import (
    PROTOCOL_VERSION,
    EngineState,
    RankHello,
    RankId,
    RankState,
    RegistrationError,
    RegistrationErrorKind,
    Role,
)

ROLE_FROM_PB = {pb.ROLE_PREFILL: Role.PREFILL, pb.ROLE_DECODE: Role.DECODE, pb.ROLE_MIXED: Role.MIXED}
ROLE_TO_PB = {v: k for k, v in ROLE_FROM_PB.items()}


def hello_from_proto(m: pb.Hello) -> RankHello:
    """Converts a Hello; raises RegistrationError(INVALID) when required parts are missing."""
    if not m.HasField("rank"):
        raise RegistrationError(RegistrationErrorKind.INVALID, "hello: rank identity missing")
    role = ROLE_FROM_PB.get(m.rank.role)
    if role is None:
        raise RegistrationError(RegistrationErrorKind.INVALID, "hello: role must be ROLE_PREFILL, ROLE_DECODE or ROLE_MIXED")
    r = m.rank
    return RankHello(engine_id=r.engine_id, role=role, epoch=r.epoch, tp_rank=r.tp_rank, tp_size=r.tp_size,
                     pp_rank=r.pp_rank, pp_size=r.pp_size or 1, compatibility_hash=m.compatibility_hash,
                     engine_address=m.engine_address, handshake_metadata=m.handshake_metadata,
                     protocol_version=m.protocol_version or PROTOCOL_VERSION, last_sent_seq=m.last_sent_seq,
                     hash_seed=m.hash_seed if m.HasField("hash_seed") else None,
                     block_size=m.block_size if m.HasField("block_size") else None,
                     dtype=m.dtype if m.HasField("dtype") else None,
                     device_kind=m.device_kind if m.HasField("device_kind") else None, role_epoch=m.role_epoch)


def identity_to_proto(engine: EngineState, rank_id: RankId) -> pb.RankIdentity:
    return pb.RankIdentity(engine_id=engine.engine_id, role=ROLE_TO_PB[engine.role], epoch=engine.epoch,
                           tp_rank=rank_id.tp_rank, tp_size=engine.tp_size, pp_rank=rank_id.pp_rank,
                           pp_size=engine.pp_size)


def peer_info_to_proto(engine: EngineState, rank: RankState) -> pb.PeerInfo:
    return pb.PeerInfo(rank=identity_to_proto(engine, rank.hello.rank_id), engine_address=rank.hello.engine_address,
                       handshake_metadata=rank.hello.handshake_metadata)


def global_rank(engine: EngineState, rank_id: RankId) -> int:
    return rank_id.pp_rank * engine.tp_size + rank_id.tp_rank


class CompactEventsError(ValueError):
    """A report's compact_worker_events or compact_engine_events are malformed (counted apart
    from other malformed reports: `reports_malformed_compact_events`)."""


class CompactKindsError(CompactEventsError):
    """Their `kinds` is malformed (wrong length, an unknown kind byte): also counted in
    `reports_malformed_compact_kinds`."""


def compact_from_proto(m: pb.CompactEvents, verify: bool, what: str = "") -> compact_events.CompactEvents:
    """`compact_events.from_proto` (and `verify` when asked) with its errors as CompactEventsError."""
    try:
        compact = compact_events.from_proto(m)
        if verify:
            compact_events.verify(compact)
    except compact_events.KindsError as e:
        raise CompactKindsError(f"{what}{e}") from None
    except ValueError as e:
        raise CompactEventsError(f"{what}{e}") from None
    return compact


def output_from_proto(report: pb.StepReport, events: tuple[KVCacheEvent, ...] | None = None) -> KVConnectorOutput:
    """The aggregator's view of a StepReport; raises ValueError for malformed events.
    `events`, when given, are the report's worker events already decoded."""
    if events is None:
        events = tuple(event_from_proto(e) for e in report.worker_events)
    return KVConnectorOutput(
        finished_sending=frozenset(report.finished_sending),
        finished_recving=frozenset(report.finished_recving),
        failed_recving=frozenset(report.failed_recving),
        invalid_block_ids=frozenset(report.invalid_block_ids),
        kv_cache_events=events)


# StepReport fields other than worker_events, cleared to serialize the worker events alone.
_NON_EVENT_FIELDS = tuple(f.name for f in pb.StepReport.DESCRIPTOR.fields if f.name != "worker_events")


def worker_events_key(report: pb.StepReport) -> bytes:
    """The serialized worker events of `report` (b"" when it has none): equal keys decode to
    equal events, so one decoded copy serves every rank that sent the same bytes."""
    if not report.worker_events:
        return b""
    only = pb.StepReport()
    only.CopyFrom(report)
    for name in _NON_EVENT_FIELDS:
        only.ClearField(name)
    return only.SerializeToString()


def unpack_worker_events(packed: bytes) -> tuple[KVCacheEvent, ...]:
    """The events of a `packed_worker_events` (ValueError when it is not an EventBatch holding
    only events, or an event is malformed)."""
    try:
        batch = kv_events_pb2.EventBatch.FromString(packed)
    except DecodeError as e:
        raise ValueError(f"packed_worker_events: not an EventBatch ({e})") from None
    extra = [f.name for f, _ in batch.ListFields() if f.name != "events"]
    if extra:
        raise ValueError(f"packed_worker_events: only `events` may be set, not {', '.join(extra)}")
    return tuple(event_from_proto(e) for e in batch.events)


@dataclass(slots=True)
class _Decoded:
    events: tuple[KVCacheEvent, ...]
    uses_left: int


class WorkerEventDecoder:
    """Decodes worker events once per distinct serialized form per engine, not once per rank.

    Every TP rank reports the same worker events of a step; the first copy is decoded
    (`event_from_proto`) and the result is served to the other ranks from a cache. An entry is
    dropped once `uses` reports took it (the engine's rank count), and the cache holds at most
    `max_entries` entries and `max_bytes` key bytes (oldest dropped first), so a rank that never
    reports only costs a later re-decode; `max_entries=0` decodes every copy (no cache). Decoding is a pure function of the bytes, so a hit
    returns exactly what decoding would.
    """

    __slots__ = ("_bytes", "_entries", "hits", "max_bytes", "max_entries", "misses")

    def __init__(self, max_entries: int = 4096, max_bytes: int = 64 << 20) -> None:
        self._entries: dict[tuple[str, int, bytes], _Decoded] = {}
        self._bytes = 0
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def decode(self, engine_id: str, epoch: int, uses: int, report: pb.StepReport) -> tuple[KVCacheEvent, ...]:
        """The report's worker events (ValueError when one is malformed; nothing is cached)."""
        packed = report.packed_worker_events
        if packed:
            if report.worker_events:
                raise ValueError("a report carries both worker_events and packed_worker_events")
            raw = packed
        else:
            raw = worker_events_key(report)
        if not raw:
            return ()
        key = (engine_id, epoch, raw)
        entry = self._entries.get(key)
        if entry is not None:
            self.hits += 1
            entry.uses_left -= 1
            if entry.uses_left <= 0:
                del self._entries[key]
                self._bytes -= len(raw)
            return entry.events
        self.misses += 1
        events = unpack_worker_events(packed) if packed else tuple(event_from_proto(e) for e in report.worker_events)
        if uses > 1 and self.max_entries and len(raw) <= self.max_bytes:
            self._entries[key] = _Decoded(events, uses - 1)
            self._bytes += len(raw)
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                old = next(iter(self._entries))
                del self._entries[old]
                self._bytes -= len(old[2])
        return events


def merged_event_ranks(report: pb.StepReport, own: int, num_ranks: int) -> tuple[int, ...]:
    """The other ranks whose worker events `report` carries (StepReport.merged_event_ranks);
    ValueError for a rank outside the engine, a repeat, or the sender itself."""
    ranks = report.merged_event_ranks
    return _other_ranks("merged_event_ranks", tuple(ranks), own, num_ranks) if ranks else ()


def merged_transfer_ranks(report: pb.StepReport, own: int, num_ranks: int) -> tuple[int, ...]:
    """The other ranks whose transfer results `report` carries (StepReport.merged_transfer_ranks);
    ValueError for a rank outside the engine, a repeat, the sender itself, or a list on a
    report without transfer results."""
    if not report.merged_transfer_ranks:
        return ()
    ranks = _other_ranks("merged_transfer_ranks", tuple(report.merged_transfer_ranks), own, num_ranks)
    if ranks and not (report.finished_sending or report.finished_recving or report.failed_recving):
        raise ValueError("merged_transfer_ranks without transfer results")
    return ranks


def _other_ranks(name: str, ranks: tuple[int, ...], own: int, num_ranks: int) -> tuple[int, ...]:
    if not ranks:
        return ()
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{name} repeats a rank: {list(ranks)}")
    for r in ranks:
        if r >= num_ranks:
            raise ValueError(f"{name}: rank {r} is not one of the engine's {num_ranks} ranks")
        if r == own:
            raise ValueError(f"{name} names the sender's own rank {own}")
    return ranks


def same_events(published: list[KVCacheEvent], decoded: tuple[KVCacheEvent, ...]) -> bool:
    """Whether `published` is `decoded`, object for object."""
    return len(published) == len(decoded) and all(map(operator.is_, published, decoded))
