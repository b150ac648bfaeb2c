"""`pdserve events` against a real KVEvents server (gRPC) and a real ZMQ publisher."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import pytest
import zmq

from connectors.kv_events import BlockStored, KVEventBatch
from services import events as events_cli
from services.common.config import SchedulerConfig
from services.common.grpc_server import ServiceServer
from services.scheduler.events import EventRepublisher
from services.scheduler.events.plane import EventPlane
from services.scheduler.events.servicer import SERVICE_NAME
from services.scheduler.events.zmq_publisher import ZmqEventPublisher
from services.scheduler.prefix_index import InMemoryPrefixIndex


def stored(h: int, medium: str = "GPU") -> KVEventBatch:
    return KVEventBatch(1.0, [BlockStored((h,), None, (), 4, medium=medium)])


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    events_cli.add_arguments(parser)
    return parser.parse_args(argv)


async def test_grpc_json_lines_with_replay_and_filters() -> None:
    plane = EventPlane.from_config(SchedulerConfig(event_ring_size=2))
    server = ServiceServer([SERVICE_NAME])
    plane.add_to_server(server.server)
    port = server.bind("127.0.0.1", 0)
    await server.start()
    try:
        for i in range(4):
            plane.republisher.publish("p0", 5, stored(i, "GPU" if i % 2 else "CPU"))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.common.cli", "events", "--target", f"127.0.0.1:{port}",
            "--from-seq", "0", "--medium", "GPU", "--limit", "2", "--duration", "20",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        # Publish the live batch only once the CLI has subscribed (after its snapshot was taken).
        for _ in range(300):
            if plane.republisher.stats().num_subscribers:
                break
            await asyncio.sleep(0.05)
        plane.republisher.publish("p0", 5, stored(9))
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err.decode()
        lines = [json.loads(x) for x in out.decode().splitlines()]
        # seq 0 left the ring of 2: snapshot (GPU entries only), then live
        assert lines[0]["notice"] == "SNAPSHOT_BEGIN" and "older" in lines[0]["reason"]
        assert lines[1]["snapshot"] is True and lines[1]["engine_id"] == "p0" and lines[1]["epoch"] == 5
        assert sorted(lines[1]["events"][0]["block_hashes"]) == [1, 3]
        assert lines[2] == {"notice": "SNAPSHOT_END", "next_seq": 4, "reason": ""}
        assert lines[3]["seq"] == 4 and lines[3]["events"][0]["type"] == "BlockStored"
        assert lines[3]["events"][0]["medium"] == "GPU" and lines[3]["events"][0]["block_hashes"] == [9]
    finally:
        await server.stop(None)


def test_zmq_replay_then_live_without_duplicates(capsys: pytest.CaptureFixture[str]) -> None:
    ctx = zmq.Context()
    rp = EventRepublisher(InMemoryPrefixIndex())
    pub = ZmqEventPublisher(rp, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="", context=ctx)
    pub.start()
    try:
        for i in range(3):
            rp.publish("p0", 1, stored(i))
        args = parse(["--zmq", pub.bound_endpoint, "--zmq-replay", pub.bound_replay_endpoint,
                      "--from-seq", "1", "--limit", "2", "--json"])
        assert events_cli.run(args) == 0
        lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert [x["seq"] for x in lines] == [1, 2]
        (event,) = lines[0]["events"]
        assert {k: event[k] for k in ("type", "block_hashes", "parent_block_hash", "medium", "block_size")} == {
            "type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "medium": "GPU", "block_size": 4}
    finally:
        pub.close()
        ctx.destroy(linger=0)


def test_zmq_snapshot_then_live(capsys: pytest.CaptureFixture[str]) -> None:
    ctx = zmq.Context()
    rp = EventRepublisher(InMemoryPrefixIndex())
    pub = ZmqEventPublisher(rp, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="t", context=ctx)
    pub.start()
    try:
        for i in range(3):
            rp.publish("p0", 1, stored(i))
        args = parse(["--zmq", pub.bound_endpoint, "--zmq-replay", pub.bound_replay_endpoint, "--snapshot",
                      "--limit", "1", "--duration", "20"])
        assert events_cli.run(args) == 0
        begin, snap, end = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert begin == {"notice": "SNAPSHOT_BEGIN", "next_seq": 3, "endpoint": pub.bound_endpoint}
        assert snap["snapshot"] is True and snap["seq"] == 2 and snap["topic"] == "t"
        assert sorted(snap["events"][0]["block_hashes"]) == [0, 1, 2]
        assert end == {"notice": "SNAPSHOT_END", "next_seq": 3, "endpoint": pub.bound_endpoint}
    finally:
        pub.close()
        ctx.destroy(linger=0)


def test_bad_arguments_are_refused() -> None:
    for argv, message in ((["--from-seq", "-1"], "--from-seq must be >= 0"),
                          (["--zmq-replay", "tcp://127.0.0.1:1"], "--zmq-replay needs --zmq"),
                          (["--limit", "-2"], "--limit and --duration must be >= 0"),
                          (["--snapshot", "--from-seq", "3"], "--snapshot: not with --from-seq"),
                          (["--zmq", "tcp://a:1,tcp://b:1"], "with several replicas needs --snapshot"),
                          (["--zmq", "tcp://a:1,tcp://b:1", "--zmq-replay", "tcp://a:2", "--snapshot"],
                           "one --zmq-replay endpoint per --zmq endpoint")):
        with pytest.raises(ValueError, match=message):
            events_cli.run(parse(argv))
