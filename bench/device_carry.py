"""What a device run carries, and the wheels made to fit (standard library only: the Makefile
runs it with any python3).

A lent GPU machine gets a copy of the working tree (tracked files and untracked ones git does
not ignore) plus the ignored paths a run names (`.whl`, the wheels `make gpu-check-wheels`
downloads), 64 MiB in all. `measure` prints those bytes and exits 1, with the reason, above
`--limit-mib` (48 by default: a clear margin under 64 for the tree's growth). `slim` rewrites
wheels in place without what pdserve never loads: static libraries, C/C++ headers, UCX's
perftest modules and command-line programs, and the `.so.X.Y.Z` copy of a shared library that
the wheel also holds as `.so` (a wheel cannot hold symlinks, so `libucp.so`, `.so.0` and `.so.0.0.0` are three full copies;
`libucx.load_library` opens `.so`, other libraries link `.so.0` by soname and UCX's module loader
opens modules with its own library's suffix, `.so`). The UCX wheel drops from 41 MB to 12 MB.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

LIMIT_MIB = 48.0
DEVICE_RUN_MIB = 64
_SKIP_DIRS = {".git", ".venv", ".venv-vllm", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache",
              ".hypothesis", "build", ".whl"}
# Members of a wheel pdserve never loads (see the module docstring).
_DROP = re.compile(r"(\.a$|/include/|perftest|/bin/)")
_FULL_VERSION = re.compile(r"^(.*\.so)\.\d+\.\d+\.\d+$")  # libucp.so.0.0.0: dropped where libucp.so is there too


def _dropped(names: list[str]) -> set[str]:
    present = set(names)
    return {n for n in names if _DROP.search(n) or ((m := _FULL_VERSION.match(n)) and m.group(1) in present)}


def tree_files(root: Path) -> list[Path]:
    """The files a device run copies: git's tracked and not-ignored untracked files; without git
    (a copy on the device), every file outside the usual ignored folders."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                             capture_output=True, check=True, timeout=60).stdout
        return [root / name for name in out.decode().split("\0") if name and (root / name).is_file()]
    except (OSError, subprocess.SubprocessError):
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
            files += [Path(dirpath) / f for f in filenames if not f.endswith(".pyc")]
        return files


def measure(root: Path, wheel_dir: Path, limit_mib: float = LIMIT_MIB) -> dict[str, Any]:
    """Bytes of the tree and of the wheels (`*.whl` in `wheel_dir`), against `limit_mib`."""
    tree = sum(p.stat().st_size for p in tree_files(root))
    wheels = sum(p.stat().st_size for p in wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else 0
    mib = (tree + wheels) / 2**20
    ok = mib <= limit_mib
    note = (f"tree {tree / 2**20:.1f} MiB + wheels {wheels / 2**20:.1f} MiB = {mib:.1f} MiB, "
            f"{'within' if ok else 'OVER'} the {limit_mib:g} MiB limit (a device run carries {DEVICE_RUN_MIB} MiB)")
    return {"tree_bytes": tree, "wheel_bytes": wheels, "mib": round(mib, 1), "limit_mib": limit_mib, "ok": ok,
            "note": note}


def slim_wheel(path: Path) -> tuple[int, int]:
    """Rewrites `path` without the `_DROP` members (RECORD kept consistent); (bytes before, after)."""
    before = path.stat().st_size
    with zipfile.ZipFile(path) as src:
        members = src.infolist()
        dropped = _dropped([m.filename for m in members])
        if not dropped:
            return before, before
        tmp = path.with_suffix(".slim")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
            for m in members:
                if m.filename in dropped:
                    continue
                data = src.read(m)
                if m.filename.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines()
                    data = ("\n".join(line for line in lines if line.split(",")[0] not in dropped) + "\n").encode()
                dst.writestr(m, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    os.replace(tmp, path)
    return before, path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.device_carry", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="bytes a device run carries; exit 1 above the limit")
    m.add_argument("--root", default=".")
    m.add_argument("--wheel-dir", default=".whl")
    m.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    s = sub.add_parser("slim", help="rewrite the wheels of a folder without what pdserve never loads")
    s.add_argument("wheel_dir")
    args = parser.parse_args(argv)
    if args.command == "slim":
        for path in sorted(Path(args.wheel_dir).glob("*.whl")):
            before, after = slim_wheel(path)
            if after != before:
                print(f"slimmed {path.name}: {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
        return 0
    report = measure(Path(args.root), Path(args.wheel_dir), args.limit_mib)
    print(f"device run carry: {report['note']}")
    if not report["ok"]:
        print(f"error: the tree and the wheels exceed {args.limit_mib:g} MiB; a device run would not carry them "
              "with a margin (drop wheels the GPU image has, or slim them: python -m bench.device_carry slim)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
