"""A `TransportListener` for transport tests: records finished pulls (and signals the first)
and the pulls it served; accepts every pull request."""

from __future__ import annotations

import threading

from connectors.ucx.handshake import PeerKey
from connectors.ucx.transport import PullRequest, PullResult


class RecordingListener:
    def __init__(self) -> None:
        self.results: list[PullResult] = []
        self.served: list[str] = []
        self.done = threading.Event()

    def on_pull_finished(self, result: PullResult) -> None:
        self.results.append(result)
        self.done.set()

    def on_pull_request(self, request: PullRequest) -> str | None:
        self.served.append(request.request_id)
        return None

    def on_reader_done(self, request_id: str, reader: PeerKey, ok: bool) -> None:
        pass

    def on_renew(self, request_ids: list[str], reader: PeerKey) -> None:
        pass
