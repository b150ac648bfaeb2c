"""Pure parts of services/common/security.py and certs.py: tokens, limits, plaintext policy,
config validation, certificate chains."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec

from services.common.certs import make_local_pki
from services.common.config import EngineConfig, SchedulerConfig, load_config
from services.common.security import (
    ChannelSecurity,
    RateLimiter,
    StreamCounter,
    TokenStore,
    add_client_security_arguments,
    bearer_token,
    check_plaintext,
    client_security_from_args,
    is_loopback,
    parse_token_file,
    peer_address,
    target_host,
)

GOOD = "tok-0123456789abcdef"
EVENTS_ONLY = "evt-0123456789abcdef"


def test_token_file_scopes_comments_and_errors() -> None:
    tokens = parse_token_file(f"# ops tokens\n\n{GOOD}\n{EVENTS_ONLY} events\n", "t")
    assert [t.name for t in tokens] == ["t:3", "t:4"]
    assert tokens[0].scopes == {"generate", "events"} and tokens[1].scopes == {"events"}
    assert all(GOOD not in repr(t) for t in tokens), "the secret itself is never kept"
    with pytest.raises(ValueError, match="at least 16"):
        parse_token_file("short\n")
    with pytest.raises(ValueError, match="unknown scope"):
        parse_token_file(f"{GOOD} root\n")
    with pytest.raises(ValueError, match=":1: expected"):
        parse_token_file(f"{GOOD} generate extra\n")


def test_token_store_checks_every_token(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"{EVENTS_ONLY} events\n")
    store = TokenStore.from_config(str(path), f"{GOOD}, ")
    assert store is not None
    assert store.check(GOOD) is not None and store.check(GOOD).scopes == {"generate", "events"}  # type: ignore[union-attr]
    assert store.check(EVENTS_ONLY).scopes == {"events"}  # type: ignore[union-attr]
    for wrong in ("", GOOD[:-1], GOOD + "x", GOOD.upper()):
        assert store.check(wrong) is None
    assert TokenStore.from_config("", "") is None
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no tokens"):
        TokenStore.from_config(str(empty), "")
    with pytest.raises(ValueError, match="auth_tokens_file: cannot read"):
        TokenStore.from_config(str(tmp_path / "missing"), "")


def test_bearer_token_parsing() -> None:
    assert bearer_token([("authorization", f"Bearer {GOOD}")]) == GOOD
    assert bearer_token([("x", "y"), ("Authorization", f"bearer  {GOOD} ")]) == GOOD
    assert bearer_token([("authorization", f"Basic {GOOD}")]) is None
    assert bearer_token([("authorization", "Bearer ")]) is None
    assert bearer_token(None) is None


def test_rate_limiter_token_bucket() -> None:
    now = [0.0]
    limiter = RateLimiter(rate=2.0, burst=3, clock=lambda: now[0])
    assert [limiter.allow("a") for _ in range(4)] == [True, True, True, False]
    assert limiter.allow("b"), "clients have their own buckets"
    now[0] = 0.5
    assert limiter.allow("a") and not limiter.allow("a")
    now[0] = 100.0
    assert sum(limiter.allow("a") for _ in range(10)) == 3, "refill is capped at the burst"
    with pytest.raises(ValueError, match='rate must be > 0 and burst >= 1'):
        RateLimiter(0, 1)


def test_rate_limiter_memory_is_bounded() -> None:
    limiter = RateLimiter(rate=1.0, burst=1, clock=lambda: 0.0, max_clients=100)
    for i in range(1000):
        limiter.allow(f"c{i}")
    assert len(limiter) <= 100


def test_stream_counter() -> None:
    streams = StreamCounter(2)
    assert streams.acquire("a") and streams.acquire("a") and not streams.acquire("a")
    assert streams.acquire("b")
    streams.release("a")
    assert streams.acquire("a") and streams.total() == 3
    for client in ("a", "a", "b"):
        streams.release(client)
    assert streams.total() == 0 and streams.open("a") == 0
    assert all(StreamCounter(0).acquire("x") for _ in range(100)), "0 means unbounded"


def test_plaintext_policy_and_addresses() -> None:
    for host in ("127.0.0.1", "localhost", "::1", "[::1]", "127.1.2.3"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "10.0.0.1", "scheduler.svc", "::"):
        assert not is_loopback(host), host
    assert target_host("a.b:50052") == "a.b" and target_host("[::1]:5") == "::1" and target_host("h") == "h"
    check_plaintext("host", "127.0.0.1", tls=False, allow_plaintext=False)
    check_plaintext("host", "0.0.0.0", tls=True, allow_plaintext=False)
    check_plaintext("host", "0.0.0.0", tls=False, allow_plaintext=True)
    with pytest.raises(ValueError, match="host: '0.0.0.0' is not a loopback address.*allow_plaintext"):
        check_plaintext("host", "0.0.0.0", tls=False, allow_plaintext=False)
    assert peer_address("ipv4:10.1.2.3:5555") == "10.1.2.3"
    assert peer_address("ipv6:[::1]:5555") == "::1"
    assert peer_address("unix:/tmp/s") == "unix:/tmp/s"


def test_config_security_validation() -> None:
    assert load_config(SchedulerConfig, env={}).allow_plaintext is False
    with pytest.raises(ValueError, match="^host: .*allow_plaintext"):
        load_config(SchedulerConfig, env={}, overrides={"host": "0.0.0.0"})
    load_config(SchedulerConfig, env={"PDSERVE_ALLOW_PLAINTEXT": "true"}, overrides={"host": "0.0.0.0"})
    with pytest.raises(ValueError, match="^scheduler: .*allow_plaintext"):
        load_config(EngineConfig, env={}, overrides={"scheduler": "sched.svc:50052"})
    with pytest.raises(ValueError, match="tls_key, tls_ca: TLS needs"):
        load_config(EngineConfig, env={}, overrides={"tls_cert": "/x.crt"})
    tls = {"tls_cert": "/a", "tls_key": "/b", "tls_ca": "/c", "host": "0.0.0.0"}
    assert load_config(SchedulerConfig, env={}, overrides=tls).tls_cert == "/a", "files are read at bind time"
    with pytest.raises(ValueError, match="at least 16"):
        load_config(SchedulerConfig, env={"PDSERVE_AUTH_TOKENS": "short"})
    with pytest.raises(ValueError, match="rate_limit_burst"):
        load_config(SchedulerConfig, env={}, overrides={"rate_limit_burst": 0})


def test_unreadable_cert_names_the_setting() -> None:
    with pytest.raises(ValueError, match="tls_ca: cannot read /nonexistent/ca.crt"):
        ChannelSecurity(ca="/nonexistent/ca.crt").credentials()


def test_client_flags(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_client_security_arguments(parser)
    assert client_security_from_args(parser.parse_args([])) is None
    token_file = tmp_path / "token"
    token_file.write_text(f"{GOOD} generate\n")
    sec = client_security_from_args(parser.parse_args(["--tls-ca", "ca.crt", "--token-file", str(token_file)]))
    assert sec == ChannelSecurity(ca="ca.crt", token=GOOD)
    assert sec.metadata() == (("authorization", f"Bearer {GOOD}"),)
    with pytest.raises(ValueError, match="go together"):
        client_security_from_args(parser.parse_args(["--tls-ca", "c", "--tls-cert", "x"]))
    with pytest.raises(ValueError, match="need --tls-ca"):
        client_security_from_args(parser.parse_args(["--tls-cert", "x", "--tls-key", "y"]))


def test_local_pki_chains_to_its_ca(tmp_path: Path) -> None:
    pki = make_local_pki(tmp_path / "pki", ["engine-0.example"])
    ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    for path, usage in ((pki.server_cert, x509.ExtendedKeyUsageOID.SERVER_AUTH),
                        (pki.client_cert, x509.ExtendedKeyUsageOID.CLIENT_AUTH)):
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        cert.verify_directly_issued_by(ca)
        assert usage in cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    server = x509.load_pem_x509_certificate(pki.server_cert.read_bytes())
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "engine-0.example"} <= set(san.get_values_for_type(x509.DNSName))
    assert pki.server_key.stat().st_mode & 0o077 == 0, "private keys are private"
    assert isinstance(ca.public_key(), ec.EllipticCurvePublicKey)
    other = make_local_pki(tmp_path / "other")
    with pytest.raises(InvalidSignature, match='^$'):
        x509.load_pem_x509_certificate(other.server_cert.read_bytes()).verify_directly_issued_by(ca)
