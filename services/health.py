"""`pdserve health`: one gRPC health check (the stock grpc.health.v1 service), for container
health checks (Dockerfile's HEALTHCHECK) and scripts.

Exit status 0 when the target reports SERVING for the service asked (the overall status "" by
default), 1 otherwise (NOT_SERVING, unreachable, or no answer within --timeout); the status or the
error goes to stdout. The default target is this host's `PDSERVE_PORT` (the setting that gives the
scheduler's and an engine's gRPC port), else the scheduler's default port 50051: a container that
sets its port through the environment is probed where it listens. Plaintext only: under TLS probe
the plaintext health port (`--health-port`).
"""

from __future__ import annotations

import argparse
import os

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def default_target() -> str:
    return f"127.0.0.1:{os.environ.get('PDSERVE_PORT') or 50051}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None,
                        help="host:port of a pdserve gRPC server (default 127.0.0.1:$PDSERVE_PORT, else :50051)")
    parser.add_argument("--service", default="", help="service name to check (default: the overall status)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")


def check(target: str, service: str = "", timeout: float = 3.0) -> str:
    """The health status name the target reports (SERVING, NOT_SERVING, ...); raises
    grpc.RpcError when it does not answer."""
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def run(args: argparse.Namespace) -> int:
    target = args.target or default_target()
    try:
        status = check(target, args.service, args.timeout)
    except grpc.RpcError as e:
        print(f"{target}: {e.code().name}: {e.details()}")
        return 1
    print(f"{target}: {status}")
    return 0 if status == "SERVING" else 1
