"""The README's commands, as written, for the tests that run them (tests/e2e/test_readme_up.py,
tests/vllm/test_vllm_readme.py): a default that fails is caught by running the command a user
copies, not the components with the tests' own settings."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def readme_commands(prefix: str) -> list[str]:
    """Every README code line that starts with `prefix` (e.g. ".venv/bin/pdserve "), trailing
    `# comment` removed, in README order."""
    commands, in_code = [], False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code and line.startswith(prefix):
            words = shlex.split(line, comments=True)
            commands.append(shlex.join(words))
    return commands


@dataclass
class Up:
    """`pdserve up` as a background process in its own session; output collected in a file."""

    command: str
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float) -> None:
        out = self.log.open("wb")
        self.proc = subprocess.Popen(shlex.split(self.command), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                     env={**os.environ, **self.env}, start_new_session=True)
        out.close()
        deadline = time.monotonic() + timeout
        while "Ctrl-C stops everything" not in self.output():
            assert self.proc.poll() is None, f"{self.command} exited {self.proc.returncode}:\n{self.output()[-4000:]}"
            assert time.monotonic() < deadline, f"{self.command} not up in {timeout:.0f} s:\n{self.output()[-4000:]}"
            time.sleep(0.5)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        """Ctrl-C, as a user stops it; returns its exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.wait()


def run(command: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(shlex.split(command), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def engine_pid(engine_id: str, parent: int) -> int:
    """The pid of the engine process that `parent` (a `pdserve up`) started with `--engine-id
    engine_id` (its session leader); another cluster's engine of the same name is not it."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"--engine-id" in argv \
                and argv[argv.index(b"--engine-id") + 1:][:1] == [engine_id.encode()]:
            if os.getpgid(int(proc.name)) == int(proc.name):
                return int(proc.name)
    raise LookupError(f"no process with --engine-id {engine_id} started by pid {parent}")
