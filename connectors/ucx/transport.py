"""The KV transport interface: moves runs of KV blocks between ranks for the UCX connector.

The connector (`connectors/ucx/worker.py`, its sides `pull_side.py` and `serve_side.py`) does
the bookkeeping — requests, leases, results, stats; a transport only moves bytes and delivers protocol events. `UcxTagTransport`
(tagged messages, the writer sends on the reader's request) is the one implementation today;
an RMA backend (NIXL READ, or UCX get with remote keys in the handshake) implements the same
interface, with `pull` reading directly and `on_pull_request` called only for validation
hooks it can support.

Threading contract: every method may be called from any thread; listener callbacks run on the
transport's own progress thread and must not block (take a lock, update state, return).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

from connectors.ucx.handshake import PeerKey


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of consecutive blocks on both sides: one message (or one RMA descriptor).

    With `num_heads` > 0 only KV heads [remote_head, remote_head + num_heads) of the remote
    rank's local heads are read, into local heads [local_head, local_head + num_heads) (ranks
    of different TP sizes): in the NHL2BD layout that range is one contiguous piece per block
    (heads outermost in a block), so the segment moves as `num_blocks` messages (see
    `pieces`). `num_heads` == 0 moves whole blocks (the heads of both ranks are the same)."""

    remote_block: int
    local_block: int
    num_blocks: int
    remote_head: int = 0
    local_head: int = 0
    num_heads: int = 0


@dataclass(frozen=True, slots=True)
class HeadGeometry:
    """One rank's block layout as far as head ranges go (NHL2BD): blocks of `num_local_heads`
    contiguous heads, each `head_nbytes` bytes (its K and V of every layer)."""

    num_local_heads: int
    head_nbytes: int

    @property
    def block_nbytes(self) -> int:
        return self.num_local_heads * self.head_nbytes


def pieces(seg: Segment, geometry: HeadGeometry, *, remote: bool) -> list[tuple[int, int]]:
    """(byte offset, byte length) of the messages `seg` moves, in wire order, on one side:
    the remote side's offsets (`remote=True`, the writer) or the local side's. Both sides list
    the same number of pieces of the same lengths (their per-head block sizes are equal): one
    for whole blocks, else one per block (the head range of a block is contiguous; consecutive
    blocks' ranges are not, unless the range is the whole block on both sides)."""
    block_nbytes = geometry.block_nbytes
    first = seg.remote_block if remote else seg.local_block
    if seg.num_heads == 0:
        return [(first * block_nbytes, seg.num_blocks * block_nbytes)]
    head = seg.remote_head if remote else seg.local_head
    length = seg.num_heads * geometry.head_nbytes
    skip = head * geometry.head_nbytes
    return [((first + b) * block_nbytes + skip, length) for b in range(seg.num_blocks)]


class BlockAddressing(Protocol):
    """Where blocks and heads lie in a region that is not NHL2BD (`connectors.kv_layout.StridedKVLayout`,
    vLLM's own KV in place): a segment moves as `pieces(seg, remote=...)`, the same count of
    the same lengths on both sides."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_local_heads(self) -> int: ...

    def pieces(self, seg: Segment, *, remote: bool) -> list[tuple[int, int]]: ...

    def num_pieces(self, seg: Segment) -> int: ...


def num_pieces(seg: Segment) -> int:
    """How many messages `seg` moves (see `pieces`)."""
    return 1 if seg.num_heads == 0 else seg.num_blocks


def coalesce(remote_block_ids: list[int], local_block_ids: list[int]) -> list[Segment]:
    """Pairs remote and local ids position by position into maximal runs consecutive on both sides."""
    if len(remote_block_ids) != len(local_block_ids):
        raise ValueError(f"{len(remote_block_ids)} remote blocks for {len(local_block_ids)} local blocks")
    segments: list[Segment] = []
    for remote, local in zip(remote_block_ids, local_block_ids, strict=True):
        last = segments[-1] if segments else None
        if last and remote == last.remote_block + last.num_blocks and local == last.local_block + last.num_blocks:
            segments[-1] = Segment(last.remote_block, last.local_block, last.num_blocks + 1)
        else:
            segments.append(Segment(remote, local, 1))
    return segments


def split_segments(segments: tuple[Segment, ...], max_blocks: int) -> list[tuple[Segment, ...]]:
    """`segments` in order, cut into groups of at most `max_blocks` blocks each (a segment
    crossing a cut becomes two, head ranges kept): the pulls of a chunked read."""
    if max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    out: list[tuple[Segment, ...]] = []
    group: list[Segment] = []
    room = max_blocks
    for seg in segments:
        at = 0
        while at < seg.num_blocks:
            take = min(seg.num_blocks - at, room)
            group.append(dataclasses.replace(seg, remote_block=seg.remote_block + at,
                                             local_block=seg.local_block + at, num_blocks=take))
            at += take
            room -= take
            if room == 0:
                out.append(tuple(group))
                group, room = [], max_blocks
    if group:
        out.append(tuple(group))
    return out


@dataclass(frozen=True, slots=True)
class PullOp:
    """One decode rank's read of one request's blocks from one prefill rank."""

    xfer_id: int
    peer: PeerKey  # the writer
    request_id: str  # the writer's request id
    segments: tuple[Segment, ...]
    timeout_s: float
    # One pull of a chunked read (the request's blocks from this writer in several pulls): its
    # end does not end the reader's read, `KVTransport.release` does.
    chunked: bool = False


@dataclass(frozen=True, slots=True)
class PullRequest:
    """What the writer's transport received: a reader asking for blocks of a request."""

    xfer_id: int
    request_id: str
    engine_id: str  # the writer engine the reader believes it talks to
    epoch: int  # ... and its epoch
    segments: tuple[Segment, ...]
    reader: PeerKey


@dataclass(frozen=True, slots=True)
class PullResult:
    """The end of a `PullOp`, success or failure, delivered exactly once."""

    xfer_id: int
    ok: bool
    reason: str | None  # None on success; e.g. timeout, refused:<why>, peer_gone, bad_message
    done_segments: tuple[Segment, ...]  # segments whose bytes fully arrived
    num_bytes: int
    seconds: float
    transport: str = ""  # the UCX transport that carried it (connectors/ucx/ep_info.py); "" if not known


class TransportListener(Protocol):
    """Callbacks from a transport to its connector; run on the transport thread."""

    def on_pull_request(self, request: PullRequest) -> str | None:
        """Writer side: validate a pull; None accepts (the transport sends), a string refuses."""

    def on_reader_done(self, request_id: str, reader: PeerKey, ok: bool) -> None:
        """Writer side: a reader finished with a request (after every send of it completed)."""

    def on_renew(self, request_ids: list[str], reader: PeerKey) -> None:
        """Writer side: a live reader still wants these requests' blocks (lease renewal)."""

    def on_pull_finished(self, result: PullResult) -> None:
        """Reader side: a `PullOp` ended."""

    # Optional, writer side:
    # - `source_segments(request, resume) -> tuple[Segment, ...] | str | None`, called after
    #   `on_pull_request` accepted: where the request's blocks lie in the registered region when
    #   that is not the blocks' own place (a host staging pool), or a reason refusing the pull
    #   (e.g. `unknown_request`: unpinned in between), or None: they are being staged and
    #   `resume(segments | reason)` follows exactly once, from any thread.
    # - `on_serve_ended(request_id, reader, xfer_id, ok, last)`: one accepted pull ended (sent
    #   and `done`, refused after acceptance, or its reader dropped); `last`: the reader's read
    #   ended with it (an unchunked pull). Replaces `on_reader_done` where present.
    # - `on_reader_released(request_id, reader)`: a reader ended its chunked read (or was
    #   dropped in the middle of one); may repeat for one read, counts once.


class KVTransport(ABC):
    """Moves KV block runs between ranks' registered regions."""

    @property
    @abstractmethod
    def worker_address(self) -> bytes:
        """What peers need to reach this rank (goes into the handshake metadata)."""

    @abstractmethod
    def start(self, listener: TransportListener) -> None:
        """Starts progress; events go to `listener` from then on."""

    @abstractmethod
    def add_peer(self, key: PeerKey, address: bytes) -> None:
        """Connects to a peer ahead of its first transfer; idempotent."""

    @abstractmethod
    def remove_peer(self, key: PeerKey) -> None:
        """Fails every pull from that peer (reason peer_gone) and closes its endpoint."""

    @abstractmethod
    def pull(self, op: PullOp) -> None:
        """Starts reading `op.segments` from `op.peer` into the local region; the result arrives
        through `on_pull_finished` within `op.timeout_s` (plus one progress tick)."""

    @abstractmethod
    def abandon(self, xfer_id: int) -> None:
        """Stops a pull without a result: later data for it is drained, never written."""

    def expect_activity(self, seconds: float) -> None:  # noqa: B027
        """Hint: a peer will probably contact us within `seconds` (e.g. a reader of blocks just
        pinned); a polling transport may poll instead of sleeping until then."""

    @abstractmethod
    def renew(self, peer: PeerKey, request_ids: list[str]) -> None:
        """Tells a writer the reader is alive and still wants these requests."""

    def release(self, peer: PeerKey, request_id: str) -> None:  # noqa: B027
        """Ends this reader's chunked read of `request_id` at `peer` (every pull of it ended).
        Only transports that serve chunked reads (`UcxTagTransport`) are given chunked pulls."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stops progress and closes endpoints; idempotent."""
