"""Ordering transfers after vLLM's compute, without a GPU: `ComputeFence` records an event on the
device's current stream (a stand-in for `torch.cuda` here; none at all on the CPU), and the UCX
connector waits for a pin's fence on the transport thread before it accepts the first pull of
those blocks — and only then."""

from __future__ import annotations

from typing import Any

import torch

from connectors.ucx.handshake import PeerKey
from connectors.ucx.transport import PullRequest, Segment
from connectors.ucx.worker import UcxWorkerConnector
from connectors.vllm.kv_region import ComputeFence


class FakeEvent:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def record(self, stream: Any) -> None:
        self.log.append(f"record on {stream}")

    def synchronize(self) -> None:
        self.log.append("synchronize")

    def query(self) -> bool:
        return "synchronize" in self.log


class FakeCuda:
    def __init__(self) -> None:
        self.log: list[str] = []

    def Event(self) -> FakeEvent:  # noqa: N802 (torch.cuda's name)
        return FakeEvent(self.log)

    def current_stream(self, device: torch.device) -> str:
        return f"stream of {device}"


class FakeTransport:
    worker_address = b"fake"

    def start(self, listener: Any) -> None:
        self.listener = listener

    def expect_activity(self, seconds: float) -> None:
        pass

    def shutdown(self) -> None:
        pass


def test_no_fence_on_the_cpu_and_an_event_on_vllms_stream_on_cuda() -> None:
    assert ComputeFence.record(torch.device("cpu")) is None
    cuda = FakeCuda()
    fence = ComputeFence.record(torch.device("cuda", 1), cuda=cuda)
    assert fence is not None and cuda.log == ["record on stream of cuda:1"]
    assert not fence.done()
    fence.wait()
    assert cuda.log == ["record on stream of cuda:1", "synchronize"] and fence.done()


def test_the_first_pull_of_pinned_blocks_waits_for_their_fence() -> None:
    connector = UcxWorkerConnector(engine_id="p", epoch=1, tp_rank=0, tp_size=1, num_kv_heads=2,
                                   compatibility_hash="h")
    connector.register_kv_caches(torch.zeros(8, 2, 2, 2, 4, 8), transport=FakeTransport())  # type: ignore[arg-type]
    order: list[str] = []

    class Fence:
        def wait(self) -> None:
            order.append("waited")

    connector.expect_send("r", [1, 2], ready=Fence())
    pull = PullRequest(1, "r", "p", 1, (Segment(1, 0, 2),), PeerKey("d", 2, 0))
    assert connector.on_pull_request(pull) is None and order == ["waited"]
    assert connector.on_pull_request(PullRequest(2, "r", "p", 1, (Segment(1, 0, 2),), PeerKey("d", 2, 0))) is None
    assert order == ["waited"]  # done once; later readers do not wait again
    connector.expect_send("s", [3])  # no fence (CPU): nothing to wait for
    assert connector.on_pull_request(PullRequest(3, "s", "p", 1, (Segment(3, 0, 1),), PeerKey("d", 2, 0))) is None
    assert order == ["waited"]
