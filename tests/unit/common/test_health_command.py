"""`pdserve health` (the images' HEALTHCHECK) against a real gRPC server's stock health service:
exit 0 only while the server reports SERVING; NOT_SERVING and no server exit 1."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from services import health
from services.common.grpc_server import ServiceServer
from services.local_cluster import free_port


def check(target: str) -> int:
    return health.run(argparse.Namespace(target=target, service="", timeout=3.0))


async def test_exit_status_follows_the_health_service(capsys: pytest.CaptureFixture[str]) -> None:
    server = ServiceServer(["pdserve.v1.Generation"])
    port = server.bind("127.0.0.1", 0)
    await server.start()
    target = f"127.0.0.1:{port}"
    try:
        assert await asyncio.to_thread(check, target) == 1
        assert "NOT_SERVING" in capsys.readouterr().out
        await server.set_serving(True)
        assert await asyncio.to_thread(check, target) == 0
        assert f"{target}: SERVING" in capsys.readouterr().out
    finally:
        await server.stop(0)
    assert await asyncio.to_thread(check, f"127.0.0.1:{free_port()}") == 1
    assert "UNAVAILABLE" in capsys.readouterr().out


def test_default_target_is_the_port_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_PORT", raising=False)
    assert health.default_target() == "127.0.0.1:50051"
    monkeypatch.setenv("PDSERVE_PORT", "50060")
    assert health.default_target() == "127.0.0.1:50060"
