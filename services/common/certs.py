"""Throwaway certificates for local clusters (`pdserve up --tls`) and tests.

`make_local_pki(directory)` writes a fresh CA and one leaf certificate that serves as both server
and client identity of every component (names: localhost, 127.0.0.1, ::1 and the given extra
hosts), plus a separate client certificate for callers of the client API:

    ca.crt                 the CA every component trusts
    server.crt, server.key every component's identity (serverAuth + clientAuth, CN `pdserve`:
                           what `tls_peer_name` admits on the control and Engine API ports)
    client.crt, client.key a client identity (clientAuth only, CN `pdserve-client`)

Keys are EC P-256 and never leave `directory` (mode 0600). These certificates are for one
machine and short-lived (default 7 days); production installs bring their own (Helm: a Secret
or cert-manager).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

COMPONENT_NAME = "pdserve"
CLIENT_NAME = "pdserve-client"


@dataclass(frozen=True, slots=True)
class LocalPki:
    """Paths of the files `make_local_pki` wrote."""

    directory: Path
    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdserve local"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def make_ca(common_name: str = "pdserve local CA", days: int = 7) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed CA certificate and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def issue(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, common_name: str, hosts: Iterable[str], *,
          server: bool = True, client: bool = True, days: int = 7) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A leaf certificate signed by the CA, valid for `hosts` (DNS names or IP addresses)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
    builder = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
    hosts = list(hosts)
    if hosts:
        builder = builder.add_extension(_san(hosts), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def make_local_pki(directory: str | Path, hosts: Iterable[str] = (), *, days: int = 7,
                   ca_name: str = "pdserve local CA") -> LocalPki:
    """Writes a fresh CA, a component identity and a client identity into `directory`."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key = make_ca(ca_name, days)
    names = ["localhost", "127.0.0.1", "::1", *hosts]
    server_cert, server_key = issue(ca_cert, ca_key, COMPONENT_NAME, names, days=days)
    client_cert, client_key = issue(ca_cert, ca_key, CLIENT_NAME, [], server=False, days=days)
    pki = LocalPki(d, d / "ca.crt", d / "ca.key", d / "server.crt", d / "server.key", d / "client.crt",
                   d / "client.key")
    _write_cert(pki.ca_cert, ca_cert)
    _write_key(pki.ca_key, ca_key)
    _write_cert(pki.server_cert, server_cert)
    _write_key(pki.server_key, server_key)
    _write_cert(pki.client_cert, client_cert)
    _write_key(pki.client_key, client_key)
    return pki
