"""Engine registry: engines, their ranks, epochs, addresses, handshake metadata, load, health.

Pure and synchronous (plain dataclasses in and out, an injectable clock); the Control servicer
converts protobuf at the edge and acts on what the methods return.

Contracts:
- An engine's expected rank set is fixed at registration: tp_size x pp_size ranks, taken from
  the first Hello of an epoch. Later Hellos of that epoch must agree (role, sizes, address).
- A Hello with a new epoch for a known engine id fences the old epoch: its ranks are dropped,
  the epoch goes on a fenced list (a Hello or report from it is refused from then on), and the
  caller is told so it can fail the old epoch's transfers over and drop its index entries.
- A refused registration (`RegistrationError`) changes no state.
- The cluster's compatibility hash is the configured one, or else the one of the engines
  registered now (the first engine sets it; when every engine is gone the next one may set a new
  one). Block size and hash seed, when a Hello states them, must equal the scheduler's.
- A rank is alive while it is connected and was heard from within its engine's heartbeat
  timeout: `heartbeat_timeout_s`, or `multirank_cpu_heartbeat_timeout_s` for an engine of more
  than one rank whose Hellos say device kind "cpu" (its ranks' control threads share the host's
  cores and each process's interpreter with that engine's compute, and wake late under load).
  `expire()` declares silent ranks dead; an engine with a dead, missing or disconnected rank,
  or that is draining, is not routable.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when a handshake is read (msgpack and the head map are not needed before)
    from connectors.ucx.handshake import KVRegionLayout

PROTOCOL_VERSION = 1


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"  # a decode engine that computes its own prompts (docs/decisions/0044)

    @property
    def side(self) -> Role:
        """Which leg the role serves: PREFILL, or DECODE (decode and mixed engines)."""
        return Role.PREFILL if self is Role.PREFILL else Role.DECODE


class RegistrationErrorKind(enum.StrEnum):
    INVALID = "invalid"            # malformed Hello -> INVALID_ARGUMENT
    INCOMPATIBLE = "incompatible"  # mismatch with the cluster -> FAILED_PRECONDITION


class RegistrationError(ValueError):
    """A Hello the registry refuses; `kind` selects the gRPC status, the message is the reason."""

    def __init__(self, kind: RegistrationErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class RankId:
    engine_id: str
    tp_rank: int
    pp_rank: int = 0


@dataclass(frozen=True, slots=True)
class RankHello:
    """A rank's registration, as the registry sees it (converted from the proto Hello)."""

    engine_id: str
    role: Role
    epoch: int
    tp_rank: int
    tp_size: int
    compatibility_hash: str
    engine_address: str
    handshake_metadata: bytes = b""
    pp_rank: int = 0
    pp_size: int = 1
    protocol_version: int = PROTOCOL_VERSION
    last_sent_seq: int = 0
    block_size: int | None = None
    hash_seed: str | None = None
    dtype: str | None = None
    device_kind: str | None = None
    role_epoch: int = 0

    @property
    def rank_id(self) -> RankId:
        return RankId(self.engine_id, self.tp_rank, self.pp_rank)


@dataclass(frozen=True, slots=True)
class LoadInfo:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_pinned: int = 0
    num_free_blocks: int = 0


@dataclass(slots=True)
class RankState:
    hello: RankHello
    conn_id: int
    connected: bool = True
    dead: bool = False
    last_seen: float = 0.0
    last_applied_seq: int = 0


@dataclass(slots=True)
class EngineState:
    engine_id: str
    role: Role
    epoch: int
    tp_size: int
    pp_size: int
    address: str
    ranks: dict[RankId, RankState] = field(default_factory=dict)
    load: LoadInfo = field(default_factory=LoadInfo)
    draining: bool = False
    # The model's KV heads, from the first rank's UCX handshake metadata (0: not known); with
    # tp_size it says whose KV this engine can read or serve (connectors.head_map).
    num_kv_heads: int = 0
    # KV bytes of one block over all ranks (a rank's region block bytes x tp; 0: not known).
    kv_block_bytes: int = 0
    # The engine's role generation: 0 at start, +1 per in-place role change (SetRole). The
    # engine's own word (Hello, rank 0's heartbeats) sets it and `role`; see `follow_role`.
    role_epoch: int = 0
    # pdserve's own engine (its KV region is in pdserve's layout, not a vLLM one): it pins a
    # peer fetch between two steps, computing nothing (decision 0049). False: vLLM, or unknown.
    native_engine: bool = False

    def expected_ranks(self) -> list[RankId]:
        return [RankId(self.engine_id, tp, pp) for pp in range(self.pp_size) for tp in range(self.tp_size)]

    @property
    def complete(self) -> bool:
        """Every expected rank has registered (in this epoch)."""
        return len(self.ranks) == self.tp_size * self.pp_size

    @property
    def healthy(self) -> bool:
        return self.complete and all(r.connected and not r.dead for r in self.ranks.values())

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining

    @property
    def leader(self) -> RankId:
        """The rank that drives the engine loop and receives KVReady / ReleaseBlocks."""
        return RankId(self.engine_id, 0, 0)


@dataclass(frozen=True, slots=True)
class Registration:
    """The outcome of an accepted Hello."""

    engine: EngineState
    rank: RankState
    # Epoch of the same engine id that this Hello fenced, if any.
    fenced_epoch: int | None
    # Ranks of the fenced epoch (their streams must be closed).
    fenced_ranks: tuple[RankId, ...] = ()
    # True when this rank was not registered in this epoch before (first Hello, not a reconnect).
    new_rank: bool = True
    # The fenced incarnation itself (its ranks, role and sizes), if any.
    fenced_engine: EngineState | None = None


def _check_hello_shape(h: RankHello) -> None:
    def bad(msg: str) -> RegistrationError:
        return RegistrationError(RegistrationErrorKind.INVALID, msg)

    if not h.engine_id or len(h.engine_id) > 256:
        raise bad("hello: engine_id must be 1..256 characters")
    if h.epoch == 0:
        raise bad("hello: epoch must be a non-zero random 64-bit id")
    if h.tp_size < 1 or h.pp_size < 1 or h.tp_size * h.pp_size > 4096:
        raise bad(f"hello: tp_size ({h.tp_size}) and pp_size ({h.pp_size}) must be >= 1")
    if not 0 <= h.tp_rank < h.tp_size or not 0 <= h.pp_rank < h.pp_size:
        raise bad(f"hello: rank tp={h.tp_rank} pp={h.pp_rank} outside tp_size={h.tp_size} pp_size={h.pp_size}")
    if not h.compatibility_hash:
        raise bad("hello: compatibility_hash is empty")
    if not h.engine_address or ":" not in h.engine_address:
        raise bad(f"hello: engine_address must be host:port, got {h.engine_address!r}")
    if len(h.handshake_metadata) > 1 << 20:
        raise bad("hello: handshake_metadata larger than 1 MiB")


class EngineRegistry:
    """All registered engines of the cluster (see the module docstring for the contracts)."""

    def __init__(self, *, block_size: int, hash_seed: str, compatibility_hash: str = "",
                 heartbeat_timeout_s: float = 5.0, multirank_cpu_heartbeat_timeout_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if heartbeat_timeout_s <= 0 or multirank_cpu_heartbeat_timeout_s < 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0 and multirank_cpu_heartbeat_timeout_s >= 0, got "
                             f"{heartbeat_timeout_s}, {multirank_cpu_heartbeat_timeout_s}")
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.pinned_compatibility_hash = compatibility_hash
        self.heartbeat_timeout_s = heartbeat_timeout_s
        # 0: multi-rank CPU engines get heartbeat_timeout_s like the others.
        self.multirank_cpu_heartbeat_timeout_s = multirank_cpu_heartbeat_timeout_s or heartbeat_timeout_s
        self.clock = clock
        self.engines: dict[str, EngineState] = {}
        # Bumped by every change that can change which engines are routable (a rank registered,
        # disconnected, dead or alive again, an engine removed, draining toggled): these all go
        # through this class's methods, so `routable` keeps its answer until the next one.
        self._version = 0
        self._routable: dict[Role, tuple[int, list[EngineState]]] = {}
        self.fenced: dict[str, set[int]] = {}
        self._next_conn = 0

    # -- registration ------------------------------------------------------------------------

    def cluster_compatibility_hash(self) -> str | None:
        if self.pinned_compatibility_hash:
            return self.pinned_compatibility_hash
        for engine in self.engines.values():
            for rank in engine.ranks.values():
                return rank.hello.compatibility_hash
        return None

    def _hash_difference(self, h: RankHello) -> str:
        """What differs, where the Hellos say it in clear (dtype, device kind); else the list."""
        for engine in self.engines.values():
            for rank in engine.ranks.values():
                theirs = rank.hello
                for name in ("dtype", "device_kind"):
                    mine, other = getattr(h, name), getattr(theirs, name)
                    if mine is not None and other is not None and mine != other:
                        return (f"{name} {mine} != {other} of engine {theirs.engine_id}: every engine of a cluster "
                                f"must run one {name.replace('_', ' ')} (--dtype / --device)")
                break
        return "model, dtype, device kind, KV layout, KV transport (--kv-transport), block size or hash seed differ"

    def check(self, h: RankHello) -> None:
        """Raises RegistrationError when `h` would be refused; changes nothing."""
        _check_hello_shape(h)
        incompatible = RegistrationErrorKind.INCOMPATIBLE
        if h.protocol_version != PROTOCOL_VERSION:
            raise RegistrationError(incompatible, f"protocol version {h.protocol_version} != scheduler's "
                                                  f"{PROTOCOL_VERSION}")
        if h.block_size is not None and h.block_size != self.block_size:
            raise RegistrationError(incompatible, f"block_size {h.block_size} != scheduler's {self.block_size}")
        if h.hash_seed is not None and h.hash_seed != self.hash_seed:
            raise RegistrationError(incompatible, f"hash seed {h.hash_seed!r} != scheduler's {self.hash_seed!r}: "
                                                  "block hashes would never match")
        if h.epoch in self.fenced.get(h.engine_id, ()):
            raise RegistrationError(incompatible, f"engine {h.engine_id} epoch {h.epoch:#x} was fenced by a newer epoch")
        expected = self.cluster_compatibility_hash()
        current = self.engines.get(h.engine_id)
        fencing = current is not None and current.epoch != h.epoch
        if expected is not None and h.compatibility_hash != expected and not (fencing and self._sole_engine(h.engine_id)):
            raise RegistrationError(incompatible, f"compatibility hash {h.compatibility_hash} != cluster's {expected} "
                                                  f"({self._hash_difference(h)})")
        if current is not None and not fencing:
            # The role may differ: it changes in place (a reconnecting rank states its current one).
            if (current.tp_size, current.pp_size) != (h.tp_size, h.pp_size):
                raise RegistrationError(RegistrationErrorKind.INVALID,
                                        f"hello: engine {h.engine_id} epoch {h.epoch:#x} registered as "
                                        f"{current.role} tp={current.tp_size} pp={current.pp_size}; this rank says "
                                        f"{h.role} tp={h.tp_size} pp={h.pp_size}")

    def _sole_engine(self, engine_id: str) -> bool:
        return not self.pinned_compatibility_hash and list(self.engines) == [engine_id]

    def register(self, h: RankHello) -> Registration:
        """Registers one rank (see the module contracts). Raises RegistrationError, changing nothing."""
        self.check(h)
        fenced_epoch: int | None = None
        fenced_ranks: tuple[RankId, ...] = ()
        fenced_engine: EngineState | None = None
        current = self.engines.get(h.engine_id)
        if current is not None and current.epoch != h.epoch:
            fenced_epoch, fenced_ranks, fenced_engine = current.epoch, tuple(current.ranks), current
            self.fenced.setdefault(h.engine_id, set()).add(current.epoch)
            del self.engines[h.engine_id]
            current = None
        if current is None:
            current = EngineState(h.engine_id, h.role, h.epoch, h.tp_size, h.pp_size, h.engine_address,
                                  role_epoch=h.role_epoch)
            self.engines[h.engine_id] = current
        elif h.role_epoch > current.role_epoch:
            current.role, current.role_epoch = h.role, h.role_epoch
        self._next_conn += 1
        self._version += 1
        previous = current.ranks.get(h.rank_id)
        rank = RankState(h, self._next_conn, last_seen=self.clock(),
                         last_applied_seq=previous.last_applied_seq if previous else 0)
        current.ranks[h.rank_id] = rank
        if not current.num_kv_heads:
            region = _region_of(h.handshake_metadata)
            if region is not None:
                current.num_kv_heads = region.num_kv_heads
                current.kv_block_bytes = region.block_nbytes * current.tp_size
                current.native_engine = region.native
        if h.tp_rank == 0 and h.pp_rank == 0:
            current.address = h.engine_address
        return Registration(current, rank, fenced_epoch, fenced_ranks, new_rank=previous is None,
                            fenced_engine=fenced_engine)

    def disconnect(self, rank_id: RankId, conn_id: int) -> bool:
        """Marks a rank's stream closed, unless a newer stream of that rank replaced it."""
        rank = self.rank(rank_id)
        if rank is None or rank.conn_id != conn_id:
            return False
        rank.connected = False
        self._version += 1
        return True

    def remove_engine(self, engine_id: str) -> EngineState | None:
        """Forgets an engine (its epoch is fenced: it must come back with a new epoch)."""
        engine = self.engines.pop(engine_id, None)
        if engine is not None:
            self.fenced.setdefault(engine_id, set()).add(engine.epoch)
            self._version += 1
        return engine

    def follow_role(self, engine_id: str, role: Role, role_epoch: int) -> Role | None:
        """Takes the role an engine states (rank 0's heartbeat) when its generation is newer than
        the one known; returns the old role when it changed, else None. The engine is the source
        of truth, so every scheduler replica converges on it whichever replica asked."""
        engine = self.engines.get(engine_id)
        if engine is None or role_epoch <= engine.role_epoch:
            return None
        old = engine.role
        engine.role, engine.role_epoch = role, role_epoch
        self._version += 1
        return old

    # -- liveness and load ---------------------------------------------------------------------

    def touch(self, rank_id: RankId, conn_id: int) -> bool:
        """Records that a rank was heard from; False when the stream is stale (fenced/replaced)."""
        rank = self.rank(rank_id)
        if rank is None or rank.conn_id != conn_id:
            return False
        rank.last_seen = self.clock()
        if rank.dead:
            rank.dead = False
            self._version += 1
        return True

    def update_load(self, engine_id: str, load: LoadInfo, draining: bool) -> None:
        engine = self.engines.get(engine_id)
        if engine is not None:
            engine.load = load
            if engine.draining != draining:
                engine.draining = draining
                self._version += 1

    def heartbeat_timeout(self, engine: EngineState) -> float:
        """How long a rank of `engine` may be silent (see the module contracts)."""
        if engine.tp_size * engine.pp_size > 1 and any(r.hello.device_kind == "cpu" for r in engine.ranks.values()):
            return self.multirank_cpu_heartbeat_timeout_s
        return self.heartbeat_timeout_s

    @property
    def max_heartbeat_timeout_s(self) -> float:
        """The longest timeout any engine may get."""
        return max(self.heartbeat_timeout_s, self.multirank_cpu_heartbeat_timeout_s)

    def expire(self, stalled_since: Callable[[float], float] | None = None) -> list[RankId]:
        """Declares dead every live rank silent for longer than its engine's heartbeat timeout.

        `stalled_since(t)`, when given, is how long the scheduler itself could not read its
        streams after `t` (its loop stalled, see `LoopStalls`): that time is not the rank's
        silence, so a rank whose beats waited unread is not declared dead for it."""
        now = self.clock()
        newly_dead: list[RankId] = []
        for engine in self.engines.values():
            timeout = self.heartbeat_timeout(engine)
            for rank_id, rank in engine.ranks.items():
                if rank.dead or now - rank.last_seen <= timeout:
                    continue
                if stalled_since is not None and now - rank.last_seen - stalled_since(rank.last_seen) <= timeout:
                    continue
                rank.dead = True
                newly_dead.append(rank_id)
        if newly_dead:
            self._version += 1
        return newly_dead

    # -- sequence numbers ----------------------------------------------------------------------

    def accept_seq(self, rank_id: RankId, conn_id: int, seq: int) -> bool:
        """True when report `seq` of this rank is new and must be applied (it is then recorded);
        False for a duplicate (seq <= last applied) or a stale stream."""
        rank = self.rank(rank_id)
        if rank is None or rank.conn_id != conn_id or seq <= rank.last_applied_seq:
            return False
        rank.last_applied_seq = seq
        return True

    # -- queries -------------------------------------------------------------------------------

    def rank(self, rank_id: RankId) -> RankState | None:
        engine = self.engines.get(rank_id.engine_id)
        return engine.ranks.get(rank_id) if engine is not None else None

    def engine(self, engine_id: str, epoch: int | None = None) -> EngineState | None:
        """The engine, if registered (and, when `epoch` is given, in that epoch)."""
        engine = self.engines.get(engine_id)
        if engine is None or (epoch is not None and engine.epoch != epoch):
            return None
        return engine

    @property
    def version(self) -> int:
        """Changes whenever an engine's registration, routability, draining, epoch or shape
        (TP size, KV heads) may have changed; equal versions mean none of these did."""
        return self._version

    def by_role(self, role: Role) -> list[EngineState]:
        """Engines serving `role`: PREFILL or DECODE name a side (DECODE includes mixed engines),
        MIXED only the mixed ones."""
        return [e for e in self.engines.values() if _serves(e.role, role)]

    def routable(self, role: Role) -> list[EngineState]:
        """The complete, healthy, non-draining engines serving `role` (as `by_role`; a new list each call). Kept
        between registry changes: every request asks twice, and the full answer walks every
        rank of every engine (1,024 ranks at cluster scale)."""
        hit = self._routable.get(role)
        if hit is None or hit[0] != self._version:
            hit = (self._version, [e for e in self.engines.values() if _serves(e.role, role) and e.routable])
            self._routable[role] = hit
        return list(hit[1])

    def ranks(self, role: Role | None = None) -> Iterator[RankState]:
        for engine in self.engines.values():
            if role is None or _serves(engine.role, role):
                yield from engine.ranks.values()


def _serves(engine_role: Role, asked: Role) -> bool:
    return engine_role == asked if asked is Role.MIXED else engine_role.side == asked


def _region_of(handshake_metadata: bytes) -> KVRegionLayout | None:
    """The KV region a rank's handshake metadata describes; None when absent or unreadable."""
    if not handshake_metadata:
        return None
    from connectors.ucx.handshake import UcxHandshakeMetadata

    try:
        return UcxHandshakeMetadata.decode(handshake_metadata).region
    except ValueError:
        return None
