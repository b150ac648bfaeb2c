"""Two "hosts" on one machine: network namespaces joined by a veth link, processes isolated so
UCX between them can use neither shared memory nor CMA and must go over the network.

`TwoHosts` makes namespaces `<name>-a` and `<name>-b`, a veth pair between them (device
`pdv0` on both sides, 10.<n>.0.1 and 10.<n>.0.2/24) and a second veth from the calling
namespace to host a (`pdc0`, 10.<n>.1.x/24) with routes through host a, so the caller (a test, a
benchmark) reaches either host while UCX on the hosts is confined to the a–b link by
`UCX_NET_DEVICES=pdv0` (`ucx_env`). `host.popen(argv)` runs a command in one host: in its
network namespace, and in fresh IPC, PID, mount (a private tmpfs on /dev/shm) and UTS (hostname
`<name>-a`) namespaces, so UCX sees another machine (different host id, no shared segments, no
process_vm_readv). Needs root, `ip` and `unshare`; `unavailable()` says why not, for a skip.

Everything made is removed by `close()` (deleting a namespace deletes its veth ends).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import IO, Any

LINK_DEVICE = "pdv0"
_CLIENT_DEVICE = "pdc0"
# Runs the command as a child of the namespace's init shell (not as PID 1, so it takes SIGTERM
# like any process), after mounting a private /dev/shm and naming the host.
_WRAP = 'mount -t tmpfs -o size=1g tmpfs /dev/shm && hostname "$0" && "$@" & wait $!'


def unavailable() -> str | None:
    """Why two hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (ip netns, unshare --mount)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"needs the {tool} command"
    probe = f"pdprobe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    try:
        run = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--ipc", "--pid", "--fork", "--mount",
                              "--uts", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm && hostname probe"],
                             capture_output=True, text=True, timeout=20)
        if run.returncode != 0:
            return f"unshare --ipc --pid --mount --uts failed: {run.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class Host:
    """One namespaced host: its name, its address on the a–b link and what runs in it."""

    name: str
    netns: str
    address: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def command(self, argv: list[str]) -> list[str]:
        """`argv` wrapped to run inside this host."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--ipc", "--pid", "--fork", "--mount", "--uts",
                "sh", "-c", _WRAP, self.name, *argv]

    def popen(self, argv: list[str], *, env: dict[str, str] | None = None, stdout: IO[Any] | int | None = None,
              stderr: IO[Any] | int | None = None) -> subprocess.Popen[bytes]:
        """Starts `argv` in this host (its own session, so `stop` ends the whole chain)."""
        proc = subprocess.Popen(self.command(argv), env=env, stdout=stdout, stderr=stderr, start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 60.0) -> str:
        """Runs `argv` in this host to its end; its stdout (RuntimeError with stderr on failure)."""
        done = subprocess.run(self.command(argv), env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{self.name}: {argv[:3]}... exited {done.returncode}: {done.stderr[-2000:]}")
        return done.stdout

    def kill(self, proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
        """Signals every process of `proc`'s chain (the command and its namespace's init)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to everything started here, SIGKILL to what outlives `grace`."""
        for proc in self.procs:
            if proc.poll() is None:
                self.kill(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill(proc)
                proc.wait(5)
        self.procs.clear()


class TwoHosts:
    """Hosts a and b joined by one veth link (see the module docstring). A context manager."""

    def __init__(self, name: str | None = None, subnet: int | None = None) -> None:
        problem = unavailable()
        if problem is not None:
            raise RuntimeError(f"two hosts cannot be made here: {problem}")
        pid = os.getpid()
        self.name = name or f"pdh{pid % 100000}"
        n = subnet if subnet is not None else 100 + pid % 150
        self.a = Host(f"{self.name}-a", f"{self.name}-a", f"10.{n}.0.1")
        self.b = Host(f"{self.name}-b", f"{self.name}-b", f"10.{n}.0.2")
        self._client_net = f"10.{n}.1"
        self._made: list[str] = []
        try:
            self._make(n)
        except Exception:
            self.close()
            raise

    @property
    def ucx_env(self) -> dict[str, str]:
        """UCX settings that keep the data plane on the a–b link (its only device there)."""
        return {"UCX_NET_DEVICES": LINK_DEVICE}

    def _ip(self, *args: str, netns: str | None = None) -> None:
        argv = ["ip", *(["-n", netns] if netns else []), *args]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")

    def _make(self, n: int) -> None:
        a, b = self.a.netns, self.b.netns
        for ns in (a, b):
            self._ip("netns", "add", ns)
            self._made.append(ns)
            self._ip("link", "set", "lo", "up", netns=ns)
        # The a–b link: the same device name on both sides (one UCX_NET_DEVICES for both).
        self._ip("link", "add", f"{self.name}x", "netns", a, "type", "veth", "peer", "name", f"{self.name}y",
                 "netns", b)
        self._ip("link", "set", f"{self.name}x", "name", LINK_DEVICE, netns=a)
        self._ip("link", "set", f"{self.name}y", "name", LINK_DEVICE, netns=b)
        for host in (self.a, self.b):
            self._ip("addr", "add", f"{host.address}/24", "dev", LINK_DEVICE, netns=host.netns)
            self._ip("link", "set", LINK_DEVICE, "up", netns=host.netns)
        # The caller's way in: a veth to host a, which forwards to b.
        self._ip("link", "add", f"{self.name}c", "type", "veth", "peer", "name", f"{self.name}z", "netns", a)
        self._made.append(f"link:{self.name}c")
        self._ip("link", "set", f"{self.name}z", "name", _CLIENT_DEVICE, netns=a)
        self._ip("addr", "add", f"{self._client_net}.1/24", "dev", f"{self.name}c")
        self._ip("link", "set", f"{self.name}c", "up")
        self._ip("addr", "add", f"{self._client_net}.2/24", "dev", _CLIENT_DEVICE, netns=a)
        self._ip("link", "set", _CLIENT_DEVICE, "up", netns=a)
        self._ip("route", "add", f"10.{n}.0.0/24", "via", f"{self._client_net}.2")
        self._ip("route", "add", f"{self._client_net}.0/24", "via", self.a.address, netns=b)
        subprocess.run(["ip", "netns", "exec", a, "sysctl", "-qw", "net.ipv4.ip_forward=1"], check=True)

    def close(self) -> None:
        for host in (self.a, self.b):
            host.stop()
        for made in reversed(self._made):
            if made.startswith("link:"):
                subprocess.run(["ip", "link", "del", made[5:]], capture_output=True)
            else:
                subprocess.run(["ip", "netns", "del", made], capture_output=True)
        self._made.clear()

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
