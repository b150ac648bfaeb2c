"""CPU time of this process and all its descendants, per thread, from /proc (Linux).

`bench serve --compare vllm` samples it before and after a system's workload, so each system's
report says which processes and threads used the cores meanwhile (a busy-polling transfer
thread, a proxy, the client itself): the evidence behind an explanation of a slow system.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(path: Path) -> tuple[str, int, float] | None:
    """(comm, ppid, utime + stime in s) of a /proc stat file, None when it vanished."""
    try:
        text = path.read_text()
    except OSError:
        return None
    comm = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    return comm, int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK


def _label(pid: int, comm: str) -> str:
    """The process's name: its comm, or for a Python process the module it runs (`-m x`)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        argv = []
    if comm.startswith("python") and b"-m" in argv and argv.index(b"-m") + 1 < len(argv):
        comm = argv[argv.index(b"-m") + 1].decode(errors="replace")
    return f"{comm}:{pid}"


@dataclass(slots=True)
class ThreadCpu:
    """CPU seconds by (process label, thread name, thread id) of this process tree at one moment."""

    seconds: dict[tuple[str, str, str], float]

    @classmethod
    def sample(cls, root: int | None = None) -> ThreadCpu:
        root = root or os.getpid()
        procs: dict[int, tuple[str, int]] = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit() and (st := _stat(d / "stat")) is not None:
                procs[int(d.name)] = (st[0], st[1])
        tree, frontier = {root}, [root]
        while frontier:
            parent = frontier.pop()
            for pid, (_, ppid) in procs.items():
                if ppid == parent and pid not in tree:
                    tree.add(pid)
                    frontier.append(pid)
        seconds: dict[tuple[str, str, str], float] = {}
        for pid in tree:
            label = _label(pid, procs[pid][0])
            for task in Path(f"/proc/{pid}/task").glob("*"):
                if (st := _stat(task / "stat")) is not None:
                    seconds[(label, st[0], task.name)] = st[2]
        return cls(seconds)

    def since(self, before: ThreadCpu, wall_s: float, top: int = 12) -> dict[str, Any]:
        """What was used between `before` and this sample: cores used in all, per process, and
        the `top` threads (`process/thread name#tid`; a thread born since counts from zero)."""
        used = {k: v - before.seconds.get(k, 0.0) for k, v in self.seconds.items()}
        used = {k: v for k, v in used.items() if v > 0}
        by_proc: dict[str, float] = {}
        for (proc, _, _), v in used.items():
            by_proc[proc] = by_proc.get(proc, 0.0) + v
        wall = max(wall_s, 1e-9)
        return {"cores_used": round(sum(used.values()) / wall, 2),
                "processes_cores": {p: round(v / wall, 3) for p, v in sorted(by_proc.items(), key=lambda x: -x[1])},
                "threads_cores": {f"{p}/{t}#{tid}": round(v / wall, 3)
                                  for (p, t, tid), v in sorted(used.items(), key=lambda x: -x[1])[:top]}}
