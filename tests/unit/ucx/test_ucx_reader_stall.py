"""A reader whose progress thread could not run past a pull's deadline (its process starved of
CPU, or the interpreter lock held by a long call elsewhere: seen for 34 s in a tp 2 vLLM decode
worker on 2 shared cores) collects the data its writer sent meanwhile instead of failing the
pull by timeout: time its progress thread could not run does not count against the deadline
(decision 0039).

Two real UCX workers in one process (shared memory); the stall is a command run on the reader's
progress thread right after its pull went out. About a second.
"""

from __future__ import annotations

import time

import numpy as np
from transport_listener import RecordingListener

from connectors.ucx.handshake import PeerKey
from connectors.ucx.tag_transport import UcxTagTransport
from connectors.ucx.transport import PullOp, Segment

BLOCK = 256 * 1024  # large enough for UCX's rendezvous: the data is read by the reader's progress
NUM_BLOCKS = 4
TIMEOUT_S = 0.3
STALL_S = 1.0


def test_a_pull_whose_reader_stalled_past_its_deadline_completes_with_the_data() -> None:
    source = np.random.default_rng(3).integers(0, 256, NUM_BLOCKS * BLOCK, dtype=np.uint8)
    target = np.zeros_like(source)
    writer_key, reader_key = PeerKey("prefill", 1, 0), PeerKey("decode", 2, 0)
    writer = UcxTagTransport(source, BLOCK, writer_key)
    reader = UcxTagTransport(target, BLOCK, reader_key)
    writer_listener, reader_listener = RecordingListener(), RecordingListener()
    writer.start(writer_listener)
    reader.start(reader_listener)
    try:
        reader.add_peer(writer_key, writer.worker_address)
        reader.pull(PullOp(1, writer_key, "r1", (Segment(0, 0, NUM_BLOCKS),), TIMEOUT_S))
        # Queued behind the pull on the reader's progress thread: the thread stops right after
        # the pull went out, for longer than the pull's timeout, while the writer serves it.
        reader._submit(lambda: time.sleep(STALL_S))  # the stall under test
        assert reader_listener.done.wait(10)
        (result,) = reader_listener.results
        assert writer_listener.served == ["r1"], "the writer got the pull while the reader stalled"
        assert (result.ok, result.reason) == (True, None), result
        assert result.seconds >= STALL_S > TIMEOUT_S
        assert np.array_equal(target, source)
    finally:
        reader.shutdown()
        writer.shutdown()


def test_a_pull_nobody_serves_still_times_out() -> None:
    """The deadline still holds: a writer that never answers fails the pull, about on time."""
    region = np.zeros(NUM_BLOCKS * BLOCK, dtype=np.uint8)
    silent_key, reader_key = PeerKey("prefill", 1, 0), PeerKey("decode", 2, 0)
    silent = UcxTagTransport(region.copy(), BLOCK, silent_key)  # never started: never progresses
    reader = UcxTagTransport(region, BLOCK, reader_key)
    listener = RecordingListener()
    reader.start(listener)
    try:
        reader.add_peer(silent_key, silent.worker_address)
        reader.pull(PullOp(1, silent_key, "r1", (Segment(0, 0, NUM_BLOCKS),), TIMEOUT_S))
        assert listener.done.wait(10)
        (result,) = listener.results
        assert (result.ok, result.reason) == (False, "timeout")
        assert TIMEOUT_S <= result.seconds < TIMEOUT_S + 2
    finally:
        reader.shutdown()
        silent.shutdown()
