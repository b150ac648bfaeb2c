"""The ports a process bound, written down for whoever started it.

A launcher (`pdserve up`, `LocalCluster`, the benchmarks) cannot know a free port in advance: a
port it finds free is bound seconds later by another process, and any process on the machine may
take it meanwhile (the old `free_port` collided about once in 250 cluster starts). So every
component binds its own ports — the one it was given, or one the OS picks where it was given 0
— and, with `ports_file` set, appends what it bound to that file, one JSON object per line:

    {"setting": "control_port", "port": 41377, "rank": null, "pid": 4242}

`setting` is the config setting the port belongs to (`port`, `control_port`, `events_port`,
`http_port`, `health_port`, `metrics_port`); `rank` is the TP rank for per-rank listeners (an
engine's /metrics), else null. Each line is one `write` to a file opened for appending, so lines
of an engine's rank processes never interleave. `read_ports` returns the last line per (setting,
rank); a launcher that restarts a component empties its file first.

Listeners whose port 0 means "off" (`http_port`, `metrics_port`, `health_port`) bind a port the
OS picks only when named in `ephemeral_ports` (`listen_port`). A port that cannot be bound is
`PortInUse`: the process exits with `EXIT_PORT_IN_USE` naming the setting and the port, and a
supervisor does not restart it into the same failure.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass
from pathlib import Path

# The exit status of a component that could not bind a port it was given (sysexits' EX_UNAVAILABLE
# is taken by nothing else in pdserve; 2 is a usage error, 1 a crash).
EXIT_PORT_IN_USE = 69
# Port settings whose 0 turns the listener off unless named in `ephemeral_ports`.
OPTIONAL_LISTENERS = frozenset({"http_port", "metrics_port", "health_port"})


class PortInUse(OSError):
    """A listener could not bind the port it was given."""

    def __init__(self, setting: str, host: str, port: int, reason: str = "address already in use") -> None:
        super().__init__(errno.EADDRINUSE, f"cannot bind {setting} {port} on {host}: {reason}")
        self.setting, self.host, self.port = setting, host, port


def parse_ephemeral(value: str, allowed: frozenset[str] = OPTIONAL_LISTENERS) -> frozenset[str]:
    """The settings of a comma list; ValueError naming one that is not an optional listener."""
    names = frozenset(n.strip() for n in value.split(",") if n.strip())
    unknown = sorted(names - allowed)
    if unknown:
        raise ValueError(f"ephemeral_ports: {', '.join(unknown)} is not one of {', '.join(sorted(allowed))}")
    return names


def listen_port(setting: str, port: int, ephemeral: str) -> int | None:
    """The port an optional listener binds: None when it is off (0 and not ephemeral), 0 when the
    OS picks, else `port`."""
    if port:
        return port
    return 0 if setting in parse_ephemeral(ephemeral) else None


@dataclass(frozen=True, slots=True)
class PortsFile:
    """Appends the ports this process bound to `path` (nothing when `path` is empty)."""

    path: str

    def report(self, setting: str, port: int, rank: int | None = None) -> None:
        if not self.path or not port:
            return
        line = json.dumps({"setting": setting, "port": port, "rank": rank, "pid": os.getpid()}) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def read_ports(path: str | Path) -> dict[tuple[str, int | None], int]:
    """(setting, rank) -> port, as last reported; {} while the file does not exist. A torn last
    line (read while it was written) is skipped."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return {}
    ports: dict[tuple[str, int | None], int] = {}
    for line in text.splitlines():
        try:
            entry = json.loads(line)
            ports[(str(entry["setting"]), entry["rank"])] = int(entry["port"])
        except (ValueError, KeyError, TypeError):
            continue
    return ports
