"""A listening port picks up rotated certificate files at the next TLS handshake."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.certs import make_local_pki
from services.common.grpc_server import CHANNEL_OPTIONS, ServiceServer
from services.common.security import ChannelSecurity, ServerSecurity, open_channel


async def check(port: int, security: ChannelSecurity) -> grpc.StatusCode:
    async with open_channel(f"127.0.0.1:{port}", security, CHANNEL_OPTIONS) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


_FILES = ("ca.crt", "server.crt", "server.key")


def _live_pki(tmp_path: Path) -> tuple[Path, Path, Path, ServerSecurity]:
    """Two PKIs (old, new: another CA) and a `live` directory serving the old one's files."""
    old, new = make_local_pki(tmp_path / "old"), make_local_pki(tmp_path / "new", ca_name="rotated CA")
    live = tmp_path / "live"
    live.mkdir()
    for name in _FILES:
        shutil.copy(old.directory / name, live / name)
    security = ServerSecurity(str(live / "server.crt"), str(live / "server.key"), str(live / "ca.crt"),
                              require_client_cert=True)
    return old.directory, new.directory, live, security


def _half_rotate(live: Path) -> None:
    """A half-written rotation: the key changed (new mtime) but cannot be loaded."""
    (live / "server.key").write_text("not a key")
    os.utime(live / "server.key", ns=(1, 1))


def _rotate(live: Path, to: Path) -> None:
    for name in _FILES:
        shutil.copy(to / name, live / name)


async def test_rotated_files_are_served_without_a_restart(tmp_path: Path) -> None:
    old, new, live, security = _live_pki(tmp_path)
    server = ServiceServer(["pdserve.v1.Generation"])
    port = server.bind("127.0.0.1", 0, security)
    await server.start()

    def client(pki_dir: Path) -> ChannelSecurity:
        return ChannelSecurity(ca=str(pki_dir / "ca.crt"), cert=str(pki_dir / "client.crt"),
                               key=str(pki_dir / "client.key"))

    try:
        assert await check(port, client(old)) == grpc.StatusCode.OK
        assert await check(port, client(new)) == grpc.StatusCode.UNAVAILABLE
        _half_rotate(live)  # the old files stay in use
        assert await check(port, client(old)) == grpc.StatusCode.OK
        _rotate(live, new)
        assert await check(port, client(new)) == grpc.StatusCode.OK
        assert await check(port, client(old)) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


def test_unreadable_files_fail_at_bind_with_the_setting_named(tmp_path: Path) -> None:
    pki = make_local_pki(tmp_path)
    with pytest.raises(ValueError, match="tls_cert: cannot read .*missing.crt"):
        ServerSecurity(str(tmp_path / "missing.crt"), str(pki.server_key), str(pki.ca_cert), True).credentials()


async def test_scheduler_redials_engines_after_its_certificate_rotates(tmp_path: Path) -> None:
    """The scheduler's engine channels carry its client certificate, fixed at creation: after the
    files change, the next call gets a new channel (and the old one is retired, not cut)."""
    from types import SimpleNamespace

    from services.scheduler.engine_channels import EngineChannels

    pki = make_local_pki(tmp_path)
    channels = EngineChannels(ChannelSecurity(ca=str(pki.ca_cert), cert=str(pki.server_cert),
                                              key=str(pki.server_key)))
    engine = SimpleNamespace(engine_id="prefill-0", address="127.0.0.1:1")
    try:
        first = channels.stub(engine)  # type: ignore[arg-type]
        assert channels.stub(engine) is first  # type: ignore[arg-type]
        os.utime(pki.server_cert, ns=(1, 1))
        rotated = channels.stub(engine)  # type: ignore[arg-type]
        assert rotated is not first and len(channels._retired) == 1
        assert channels.stub(engine) is rotated  # type: ignore[arg-type]
    finally:
        await channels.close()


async def _tls_handshake(port: int, pki_dir: Path) -> bool:
    """Whether a client holding `pki_dir`'s CA and client identity completes a mutual-TLS
    exchange with the server on `port` (the server writes one byte after its handshake)."""
    import asyncio
    import ssl

    client = ssl.create_default_context(cafile=str(pki_dir / "ca.crt"))
    client.load_cert_chain(str(pki_dir / "client.crt"), str(pki_dir / "client.key"))
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
    except (ssl.SSLError, ConnectionError):
        return False
    try:
        return await asyncio.wait_for(reader.read(1), 5) == b"k"
    except (ssl.SSLError, ConnectionError):
        return False
    finally:
        writer.close()


async def test_the_http_ports_ssl_context_serves_rotated_files_too(tmp_path: Path) -> None:
    # The HTTP API's TLS (ServerSecurity.ssl_context), on a plain asyncio TLS server, by IP
    # address: no SNI is sent, so the per-handshake check must not depend on it.
    import asyncio

    old, new, live, security = _live_pki(tmp_path)

    async def answer(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"k")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=security.ssl_context())
    port = server.sockets[0].getsockname()[1]
    try:
        assert await _tls_handshake(port, old)
        assert not await _tls_handshake(port, new)
        _half_rotate(live)  # the old files stay in use
        assert await _tls_handshake(port, old)
        _rotate(live, new)
        assert await _tls_handshake(port, new)
        assert not await _tls_handshake(port, old)
    finally:
        server.close()
        await server.wait_closed()


def test_unloadable_files_fail_the_ssl_context_with_the_setting_named(tmp_path: Path) -> None:
    pki = make_local_pki(tmp_path)
    with pytest.raises(ValueError, match="tls_cert, tls_key: cannot load .*missing.crt"):
        ServerSecurity(str(tmp_path / "missing.crt"), str(pki.server_key), str(pki.ca_cert), True).ssl_context()
    with pytest.raises(ValueError, match="tls_ca: cannot load .*missing-ca.crt"):
        ServerSecurity(str(pki.server_cert), str(pki.server_key), str(tmp_path / "missing-ca.crt"), True).ssl_context()
