"""Where an engine finds the scheduler replicas: the engine's `--scheduler` setting.

    127.0.0.1:50052                       one scheduler
    10.0.0.1:50052,10.0.0.2:50052         every replica, listed
    dns:pdserve-scheduler-control:50052   every address the name resolves to (a Kubernetes
                                          headless Service), resolved again periodically

Items may be mixed (`a:1,dns:b:2`). `parse_scheduler_targets` raises ValueError with the reason
for a malformed setting; `resolve_targets` turns the items into `host:port` targets (a name that
does not resolve contributes none: its replicas are not there yet).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass

DNS_PREFIX = "dns:"

Resolver = Callable[[str, int], list[str]]


@dataclass(frozen=True, slots=True)
class SchedulerTarget:
    """One item of the setting: a fixed `host:port`, or (dns) every address of `host`."""

    host: str
    port: int
    dns: bool = False

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_scheduler_targets(spec: str) -> list[SchedulerTarget]:
    """The items of a `--scheduler` setting, in order, duplicates dropped."""
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        raise ValueError("scheduler: empty; give host:port, a comma list of them, or dns:NAME:PORT")
    out: list[SchedulerTarget] = []
    for item in items:
        target = _parse_item(item)
        if target not in out:
            out.append(target)
    return out


def _parse_item(item: str) -> SchedulerTarget:
    dns = item.startswith(DNS_PREFIX)
    rest = item[len(DNS_PREFIX):] if dns else item
    if rest.startswith("["):
        host, sep, port = rest[1:].partition("]:")
    else:
        host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        form = "dns:NAME:PORT" if dns else "host:port"
        raise ValueError(f"scheduler: {item!r} is not {form}")
    return SchedulerTarget(host, int(port), dns)


def system_resolver(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (sorted), [] when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return sorted({str(info[4][0]) for info in infos})


def resolve_targets(targets: list[SchedulerTarget], resolver: Resolver = system_resolver) -> list[str]:
    """The `host:port` of every replica the items name now (dns items resolved), in order."""
    out: list[str] = []
    for t in targets:
        hosts = resolver(t.host, t.port) if t.dns else [t.host]
        for host in hosts:
            address = SchedulerTarget(host, t.port).address
            if address not in out:
                out.append(address)
    return out
