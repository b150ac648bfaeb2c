"""`pdserve up` security flags: plaintext stays on loopback unless --tls or --allow-plaintext."""

from __future__ import annotations

import argparse

import pytest

from services import up


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_default_is_plaintext_on_loopback() -> None:
    spec = up.spec_from_args(parse())
    assert spec.host == "127.0.0.1" and not spec.tls and "--allow-plaintext" not in spec.engine_args


def test_non_loopback_needs_tls_or_the_opt_in() -> None:
    with pytest.raises(ValueError, match="add --tls"):
        up.spec_from_args(parse("--host", "0.0.0.0"))
    spec = up.spec_from_args(parse("--host", "0.0.0.0", "--tls", "--tls-dir", "/tmp/x"))
    assert spec.tls and spec.tls_dir == "/tmp/x" and not spec.engine_args
    spec = up.spec_from_args(parse("--host", "0.0.0.0", "--allow-plaintext", "--auth-tokens-file", "t"))
    assert spec.engine_args == ["--allow-plaintext"]
    assert spec.scheduler_args == ["--allow-plaintext", "--auth-tokens-file", "t"]


def test_http_api_port_reaches_the_scheduler_and_prints_as_a_base_url() -> None:
    from services.local_cluster import LocalCluster

    spec = up.spec_from_args(parse())
    assert spec.http_port == 8000
    cluster = LocalCluster(up.spec_from_args(parse("--http-port", "8123")))
    assert cluster.http_url == "http://127.0.0.1:8123/v1"
    argv = cluster._scheduler_component().argv
    assert argv[argv.index("--http-port") + 1] == "8123"
