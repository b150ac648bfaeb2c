"""End to end under mTLS + bearer tokens: `LocalCluster(tls=True)` (what `pdserve up --tls`
runs) serves over TLS on every channel; clients, engine-API callers and engine processes without
the cluster's credentials are refused."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from e2e_cluster import start_cluster

from pdserve.v1 import engine_pb2, engine_pb2_grpc
from services import events, generate
from services.client import Client
from services.common.certs import LocalPki, make_local_pki
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.security import ChannelSecurity, open_sync_channel
from services.local_cluster import LocalCluster, free_port

TOKEN = "e2e-token-0123456789abcdef"


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory, "tls-cluster", tls=True, tls_dir=str(tmp_path_factory.mktemp("pki")),
                      auth_tokens=[TOKEN], scheduler_args=["--tls-require-client-cert"])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> LocalPki:
    return make_local_pki(tmp_path_factory.mktemp("foreign"), ca_name="another CA")


def test_generate_over_mtls_with_a_token(tls_cluster: LocalCluster) -> None:
    with Client(tls_cluster.target, security=tls_cluster.client_security) as client:
        result = client.generate("The capital of France is", max_tokens=8, temperature=0.0, ignore_eos=True,
                                 timeout=60)
    assert result.finish_reason == "length" and len(result.token_ids) == 8
    assert result.prefill_engine_id == "prefill-0" and result.decode_engine_id == "decode-0"
    assert result.transferred_tokens > 0, "the KV went over UCX after the mTLS-brokered handshake"
    assert tls_cluster.wait_no_leaks() == {}


def test_client_api_refuses_missing_or_foreign_credentials(tls_cluster: LocalCluster, foreign: LocalPki) -> None:
    pki = tls_cluster.pki
    assert pki is not None
    cases = {
        "plaintext": (ChannelSecurity(token=TOKEN), grpc.StatusCode.UNAVAILABLE),
        "no client certificate": (ChannelSecurity(ca=str(pki.ca_cert), token=TOKEN), grpc.StatusCode.UNAVAILABLE),
        "certificate of another CA": (ChannelSecurity(ca=str(pki.ca_cert), cert=str(foreign.client_cert),
                                                      key=str(foreign.client_key), token=TOKEN),
                                      grpc.StatusCode.UNAVAILABLE),
        "wrong token": (ChannelSecurity(ca=str(pki.ca_cert), cert=str(pki.client_cert), key=str(pki.client_key),
                                        token="not-the-token-0123456789"), grpc.StatusCode.UNAUTHENTICATED),
    }
    for name, (security, code) in cases.items():
        with Client(tls_cluster.target, security=security) as client, pytest.raises(grpc.RpcError, match=f"{code.name}") as e:
            client.generate("Hello", max_tokens=2, timeout=10)
        assert e.value.code() == code, name


def test_http_api_over_https_needs_the_client_certificate_and_a_token(tls_cluster: LocalCluster) -> None:
    """The OpenAI-compatible API shares the client API's TLS (client certificate required here)
    and bearer tokens: 401 without or with a wrong token, a TLS failure without a certificate."""
    import ssl

    import httpx

    pki = tls_cluster.pki
    assert pki is not None and tls_cluster.http_url.startswith("https://")
    with_cert = ssl.create_default_context(cafile=str(pki.ca_cert))
    with_cert.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=tls_cluster.http_url, verify=with_cert, timeout=60) as http:
        for headers in ({}, {"authorization": "Bearer not-the-token-0123456789"}):
            refused = http.post("/completions", json=body, headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        answer = http.post("/completions", json=body, headers={"authorization": f"Bearer {TOKEN}"})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 4
        assert http.get(tls_cluster.http_url.removesuffix("/v1") + "/health").status_code == 200
    without_cert = ssl.create_default_context(cafile=str(pki.ca_cert))
    with httpx.Client(base_url=tls_cluster.http_url, verify=without_cert, timeout=10) as http, \
            pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError),
                          match=r"(?i)certificate|ssl|alert|reset|eof|disconnect"):
        http.get("/models", headers={"authorization": f"Bearer {TOKEN}"}).raise_for_status()
    assert tls_cluster.wait_no_leaks() == {}


def test_engine_api_needs_the_cluster_certificate(tls_cluster: LocalCluster, foreign: LocalPki) -> None:
    pki = tls_cluster.pki
    assert pki is not None
    address = tls_cluster.components["prefill-0"].address
    refused = {
        "plaintext": None,
        "no client certificate": ChannelSecurity(ca=str(pki.ca_cert)),
        "certificate of another CA": ChannelSecurity(ca=str(pki.ca_cert), cert=str(foreign.server_cert),
                                                     key=str(foreign.server_key)),
    }
    for name, security in refused.items():
        with open_sync_channel(address, security, CHANNEL_OPTIONS) as channel, pytest.raises(grpc.RpcError, match="UNAVAILABLE") as e:
            engine_pb2_grpc.EngineStub(channel).Abort(engine_pb2.AbortRequest(request_id="x"), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, name
    # An API client's certificate from the cluster's CA: TLS accepts it, the peer-name check does not.
    client_cert = ChannelSecurity(ca=str(pki.ca_cert), cert=str(pki.client_cert), key=str(pki.client_key))
    with open_sync_channel(address, client_cert, CHANNEL_OPTIONS) as channel, pytest.raises(grpc.RpcError, match="PERMISSION_DENIED") as e:
        engine_pb2_grpc.EngineStub(channel).Abort(engine_pb2.AbortRequest(request_id="x"), timeout=5)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert tls_cluster.inspect("prefill-0").engine_id == "prefill-0"


def test_an_engine_without_credentials_cannot_register(tls_cluster: LocalCluster, tmp_path: Path) -> None:
    """A real decode engine process, started without certificates, never gets registered (so it
    never receives the prefill ranks' handshake metadata)."""
    log = tmp_path / "rogue.log"
    with log.open("wb") as out:
        rogue = subprocess.Popen(
            [sys.executable, "-m", "services.common.cli", "decode", "--engine-id", "rogue",
             "--scheduler", f"127.0.0.1:{tls_cluster.control_port}", "--port", str(free_port()),
             "--torch-threads", "1", "--kv-cache-memory", "32MiB"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "reconnecting" not in log.read_text() and time.monotonic() < deadline and rogue.poll() is None:
            time.sleep(0.5)
        assert "control stream to" in log.read_text(), log.read_text()[-2000:]
        time.sleep(1.0)
        info = tls_cluster.server_info()
        assert (info.num_prefill_engines, info.num_decode_engines) == (1, 1), "the rogue engine registered"
    finally:
        rogue.kill()
        rogue.wait()


def _run_cli(module: object, argv: list[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)  # type: ignore[attr-defined]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = module.run(parser.parse_args(argv))  # type: ignore[attr-defined]
    return rc, out.getvalue(), err.getvalue()


def test_command_line_clients_take_tls_and_token_flags(tls_cluster: LocalCluster, tmp_path: Path) -> None:
    pki = tls_cluster.pki
    assert pki is not None
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    flags = ["--tls-ca", str(pki.ca_cert), "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]
    rc, out, _ = _run_cli(generate, ["--target", tls_cluster.target, "--prompt", "Hi", "--max-tokens", "3",
                                     "--json", *flags, "--token-file", str(token_file)])
    assert rc == 0 and json.loads(out)["usage"]["generated_tokens"] == 3
    rc, _, err = _run_cli(generate, ["--target", tls_cluster.target, "--prompt", "Hi", *flags])
    assert rc == 1 and "UNAUTHENTICATED" in err
    rc, _, err = _run_cli(events, ["--target", tls_cluster.events_target, "--duration", "1", *flags,
                                   "--token-file", str(token_file)])
    assert rc == 0, err
    rc, _, err = _run_cli(events, ["--target", tls_cluster.events_target, "--duration", "1", *flags])
    assert rc == 1 and "UNAUTHENTICATED" in err


def test_tp2_every_rank_registers_over_mtls(tmp_path_factory: pytest.TempPathFactory, tiny_tp_model: Path) -> None:
    """Rank 1 runs in a spawned process: its control stream gets the engine's certificate too
    (otherwise the engine never counts as registered and the cluster never gets ready)."""
    c = start_cluster(tmp_path_factory, "tls-tp2", tp=2, model=str(tiny_tp_model), tls=True)
    try:
        with Client(c.target, security=c.client_security) as client:
            result = client.generate([5, 6, 7, 8] * 6, max_tokens=4, temperature=0.0, ignore_eos=True, timeout=60)
        assert len(result.token_ids) == 4 and result.transferred_tokens > 0
        assert c.wait_no_leaks() == {}
    finally:
        c.stop()
