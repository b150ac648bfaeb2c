"""tools/compile_bytecode.py (the Makefile's install step): every module that compiles gets its
`.pyc` where the import system looks for it; one that does not is counted, not fatal."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from tools.compile_bytecode import compile_dirs

ROOT = Path(__file__).resolve().parents[3]


def _pyc(path: Path) -> Path:
    return Path(importlib.util.cache_from_source(str(path)))


def test_compiles_what_compiles_and_counts_the_rest(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    good, bad = tmp_path / "pkg" / "good.py", tmp_path / "bad.py"
    good.write_text("X = 1\n")
    bad.write_text("def f[T](x: T) -> T:\n    return x\n" if sys.version_info < (3, 12) else "def (:\n")
    assert compile_dirs([tmp_path]) == (1, 1)
    assert _pyc(good).exists() and not _pyc(bad).exists()


def test_the_command_line_compiles_the_folders_it_is_given_and_exits_0(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text("Y = 2\n")
    (tmp_path / "broken.py").write_text("def (:\n")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "compile_bytecode.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "bytecode: 1 modules" in done.stderr and "1 left to compile at import" in done.stderr
    assert _pyc(tmp_path / "ok.py").exists()
