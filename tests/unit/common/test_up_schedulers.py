"""`pdserve up --schedulers N`: N replicas on the base ports + 10·i, every engine connected to
each, every replica's endpoints printed; a bad count is refused before anything starts."""

from __future__ import annotations

import argparse

import pytest

from services import up
from services.local_cluster import LocalCluster


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_replicas_take_offset_ports_and_every_engine_names_each(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("--schedulers", "2")
    cluster = LocalCluster(up.spec_from_args(args))
    first, second = cluster.replicas
    assert (first.name, first.port, first.control_port, first.events_port, first.http_port) == \
        ("scheduler", 50051, 50052, 50053, 8000)
    assert (second.name, second.port, second.control_port, second.events_port, second.http_port) == \
        ("scheduler-1", 50061, 50062, 50063, 8010)
    argv = cluster._engine_component("prefill", 0).argv
    assert argv[argv.index("--scheduler") + 1] == "127.0.0.1:50052,127.0.0.1:50062"
    assert cluster.targets == "127.0.0.1:50051,127.0.0.1:50061"
    sched = cluster._scheduler_component(second).argv
    assert sched[sched.index("--port") + 1] == "50061" and sched[sched.index("--http-port") + 1] == "8010"
    up.print_endpoints(cluster, args, "")
    out = capsys.readouterr().out
    assert "--target 127.0.0.1:50051,127.0.0.1:50061" in out
    for endpoint in ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8010/v1", "127.0.0.1:50053", "127.0.0.1:50063",
                     "127.0.0.1:50062"):
        assert endpoint in out


def test_one_scheduler_is_the_default_and_a_bad_count_is_refused() -> None:
    cluster = LocalCluster(up.spec_from_args(parse()))
    assert [r.name for r in cluster.replicas] == ["scheduler"]
    argv = cluster._engine_component("decode", 0).argv
    assert argv[argv.index("--scheduler") + 1] == "127.0.0.1:50052"
    for bad in ("0", "9"):
        with pytest.raises(ValueError, match="--schedulers must be in"):
            up.spec_from_args(parse("--schedulers", bad))


def test_each_replica_binds_its_own_zmq_endpoints(capsys: pytest.CaptureFixture[str]) -> None:
    """`--zmq-endpoint` names replica 0's; replica i's tcp ports are + 10·i (an ipc path gets
    "-i"), so the second replica does not fail to bind the first one's."""
    args = parse("--schedulers", "2", "--zmq-endpoint", "tcp://127.0.0.1:5557",
                 "--zmq-replay-endpoint", "ipc:///tmp/pdserve-replay")
    cluster = LocalCluster(up.spec_from_args(args))
    argvs = [cluster._scheduler_component(r).argv for r in cluster.replicas]
    assert [(a[a.index("--zmq-endpoint") + 1], a[a.index("--zmq-replay-endpoint") + 1]) for a in argvs] == [
        ("tcp://127.0.0.1:5557", "ipc:///tmp/pdserve-replay"), ("tcp://127.0.0.1:5567", "ipc:///tmp/pdserve-replay-1")]
    up.print_endpoints(cluster, args, "")
    out = capsys.readouterr().out
    assert "pdserve events --zmq tcp://127.0.0.1:5567 --zmq-replay ipc:///tmp/pdserve-replay-1" in out
    plain = LocalCluster(up.spec_from_args(parse()))
    assert "--zmq-endpoint" not in plain._scheduler_component(plain.replicas[0]).argv
