"""A (re)started scheduler replica's side of convergence: take a snapshot of the prefix index
from a peer replica (`KVEvents.Subscribe(snapshot=true)` on its events port) and install it
(`IndexConvergence`) until every engine is complete, then report ready.

Contract of `PeerSnapshots.run` (a task on the scheduler's loop):
- tries the peers in order (`peers`: a comma list and/or `dns:NAME:PORT`, the replicas'
  KVEvents endpoints; the replica's own address, recognised by the scheduler id in the
  snapshot, is skipped); a peer that is unreachable or not converged itself (UNAVAILABLE) is
  passed over. The first snapshot taken is installed; with none, engines heard from their
  first report are still complete.
- again every `retry_interval_s` while engines are missing (a peer lags, an engine has not
  reconnected yet), until converged or `timeout_s` has passed (then `finish`: ready with what
  it has, logged).
- a peer that refuses this replica's credentials (UNAUTHENTICATED, PERMISSION_DENIED) is logged
  at ERROR (once per peer and status) and kept in `refused`; while no peer gave a snapshot and
  one refused, the replica does not converge, not even at the timeout: it stays not ready (a
  misconfigured token must not serve with an empty index), and keeps asking.

Replica-to-replica calls authenticate as any KVEvents client does (`peer_security`): the
replica's certificate under TLS (mTLS when peers require client certificates), and a bearer token
when tokens guard the API: `peer_token_file`, else the first token with the `events` scope in
`auth_tokens_file` / `auth_tokens`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path

import grpc

from connectors.kv_events import BlockStored, event_from_proto
from pdserve.v1 import kv_events_pb2 as pb
from pdserve.v1 import kv_events_pb2_grpc
from services.common.config import SchedulerConfig
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.scheduler_targets import parse_scheduler_targets, resolve_targets
from services.common.security import (
    SCOPE_EVENTS,
    ChannelSecurity,
    component_channel_security,
    configured_token_entries,
    open_channel,
)
from services.scheduler.convergence import EngineSnapshot, IndexConvergence, PeerSnapshot

logger = logging.getLogger(__name__)

DEFAULT_RETRY_INTERVAL_S = 0.5
REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def peer_token(config: SchedulerConfig) -> str:
    """The bearer token a replica presents to its peers (see the module docstring); "" when no
    tokens are configured. ValueError when tokens guard KVEvents but none can be presented."""
    if config.peer_token_file:
        try:
            words = Path(config.peer_token_file).read_text().split()
        except OSError as e:
            raise ValueError(f"peer_token_file: cannot read {config.peer_token_file}: {e.strerror}") from None
        if not words:
            raise ValueError(f"peer_token_file: {config.peer_token_file} is empty")
        return words[0]
    for _, secret, scopes in configured_token_entries(config.auth_tokens_file, config.auth_tokens):
        if not scopes or SCOPE_EVENTS in scopes:
            return secret
    if config.auth_tokens_file or config.auth_tokens.strip():
        raise ValueError("peers: no configured token has the events scope, so this replica could not take a "
                         "peer's snapshot; set peer_token_file or give a token the events scope")
    return ""


def peer_security(config: SchedulerConfig) -> ChannelSecurity | None:
    """How a replica dials its peers' KVEvents: its certificate (TLS, client identity) and its
    peer token; None: plaintext without a token."""
    security = component_channel_security(config)
    token = peer_token(config)
    if not token:
        return security
    return dataclasses.replace(security, token=token) if security is not None else ChannelSecurity(token=token)


class SnapshotReader:
    """Builds a `PeerSnapshot` from a snapshot's stream messages (pure)."""

    def __init__(self) -> None:
        self.snapshot: PeerSnapshot | None = None
        self.done = False

    def feed(self, msg: pb.EventStreamMessage) -> None:
        """One message; ValueError when the stream is not a snapshot."""
        if msg.HasField("notice"):
            n = msg.notice
            if n.kind == pb.StreamNotice.SNAPSHOT_BEGIN:
                self.snapshot = PeerSnapshot(n.scheduler_id, {
                    p.engine_id: EngineSnapshot(p.engine_id, p.epoch, p.position) for p in n.positions})
            elif n.kind == pb.StreamNotice.SNAPSHOT_END:
                if self.snapshot is None:
                    raise ValueError("SNAPSHOT_END before SNAPSHOT_BEGIN")
                self.done = True
            return
        if self.snapshot is None or not msg.HasField("batch"):
            raise ValueError("a batch before SNAPSHOT_BEGIN")
        b = msg.batch
        engine = self.snapshot.engines.get(b.engine_id)
        if engine is None or engine.epoch != b.epoch:
            return  # an engine the notice did not name (it left meanwhile): nothing to install
        for e in b.events:
            event = event_from_proto(e)
            if isinstance(event, BlockStored):
                engine.blocks.setdefault(event.medium, []).extend(event.block_hashes)


async def fetch_snapshot(target: str, security: ChannelSecurity | None, timeout_s: float = 30.0) -> PeerSnapshot:
    """The peer's snapshot (grpc.RpcError when it cannot give one: unreachable, not converged)."""
    reader = SnapshotReader()
    async with open_channel(target, security, CHANNEL_OPTIONS) as channel:
        call = kv_events_pb2_grpc.KVEventsStub(channel).Subscribe(
            pb.SubscribeRequest(snapshot=True), timeout=timeout_s,
            metadata=security.metadata() if security is not None else ())
        try:
            async for msg in call:
                reader.feed(msg)
                if reader.done:
                    break
        finally:
            call.cancel()
    if reader.snapshot is None or not reader.done:
        raise ValueError(f"peer {target}: the stream ended before the snapshot did")
    return reader.snapshot


class PeerSnapshots:
    """See the module docstring."""

    def __init__(self, convergence: IndexConvergence, peers: str, scheduler_id: str, *,
                 security: ChannelSecurity | None = None, timeout_s: float = 30.0,
                 retry_interval_s: float = DEFAULT_RETRY_INTERVAL_S) -> None:
        self.convergence = convergence
        self.targets = parse_scheduler_targets(peers) if peers.strip() else []
        self.scheduler_id = scheduler_id
        self.security = security
        self.timeout_s = timeout_s
        self.retry_interval_s = retry_interval_s
        self.num_snapshots = 0
        self.missing: list[str] = []
        self.refused: dict[str, str] = {}  # peer address -> "STATUS: details" of its last refusal

    async def run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self.convergence.converged:
            snapshot = await self._any_peer()
            if snapshot is None and self.refused:
                # Refused, not absent: converging with an empty index would serve it as complete.
                await asyncio.sleep(self.retry_interval_s)
                continue
            self.missing = self.convergence.install(snapshot)
            if self.convergence.converged:
                return
            if time.monotonic() >= deadline:
                self.convergence.finish(f"after {self.timeout_s:.0f} s engines still missing: "
                                        f"{', '.join(sorted(set(self.missing)))}")
                return
            await asyncio.sleep(self.retry_interval_s)

    async def _any_peer(self) -> PeerSnapshot | None:
        loop = asyncio.get_running_loop()
        addresses = await loop.run_in_executor(None, resolve_targets, self.targets)
        for address in addresses:
            try:
                snapshot = await fetch_snapshot(address, self.security)
            except grpc.aio.AioRpcError as e:
                self._failed(address, e)
                continue
            except (grpc.RpcError, ValueError, OSError) as e:
                logger.debug("no snapshot from peer %s: %s", address, e)
                continue
            self.refused.pop(address, None)
            if snapshot.scheduler_id == self.scheduler_id:
                continue  # this replica itself (listed in the peers' DNS name)
            self.num_snapshots += 1
            return snapshot
        return None

    def _failed(self, address: str, e: grpc.aio.AioRpcError) -> None:
        if e.code() not in REFUSED:
            self.refused.pop(address, None)
            logger.debug("no snapshot from peer %s: %s %s", address, e.code().name, e.details())
            return
        why = f"{e.code().name}: {e.details()}"
        if self.refused.get(address) != why:
            logger.error("peer replica %s refused this replica's snapshot request (%s): it stays not ready "
                         "until a peer accepts its credentials (peer_token_file, auth_tokens_file, TLS)",
                         address, why)
        self.refused[address] = why
