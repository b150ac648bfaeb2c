"""Generate the protobuf/gRPC Python code, or check that the committed code is current.

`python -m services.common.protogen` regenerates `protos/pdserve/v1/*_pb2*.py` and `*.pyi`;
`--check` regenerates into a temporary directory and exits 1 naming every file that differs,
so CI fails when a .proto was edited without regenerating.

The check compares what the code means, not which tool release stamped it: the version stamps
(`GRPC_GENERATED_VERSION`, protobuf's "Protobuf Python Version" and its runtime-version guard)
are compared without their numbers. The lock (`requirements/`) pins grpcio-tools, and `make
lock` regenerates the code in the same step, so the committed stamps are the locked release's;
a new grpcio-tools release on the index no longer fails the check (it did, on 2026-12-07, with
nothing in the project changed).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parents[2] / "protos"
PROTO_PACKAGE = PROTO_ROOT / "pdserve" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi", "_pb2_grpc.pyi")
# The tool releases stamped into generated code: versions of the generator, not of the API.
_VERSION_STAMPS = (
    re.compile(r"^(GRPC_GENERATED_VERSION = )'[^']*'", re.M),
    re.compile(r"^(# Protobuf Python Version: ).*$", re.M),
    re.compile(r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)[\s\d,]*", re.M),
)


def generate(out_dir: Path, proto_root: Path = PROTO_ROOT) -> None:
    """Runs protoc over every .proto under proto_root into out_dir (mirroring protos/).

    protoc runs in a child process (`python -m grpc_tools.protoc`), not in this one: loading its
    compiler extension into a process that already holds other native libraries (a test run's
    torch, UCX, NIXL, uvloop) crashed it with a segmentation fault."""
    spec = importlib.util.find_spec("grpc_tools")  # dev dependency: the runtime needs none
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("grpc_tools is not installed (the dev extra has it): pip install grpcio-tools")
    package = proto_root / "pdserve" / "v1"
    protos = sorted(str(p.relative_to(proto_root)) for p in package.glob("*.proto"))
    include = str(Path(spec.submodule_search_locations[0]) / "_proto")
    bindir = Path(sys.executable).parent
    args = [
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        f"-I{proto_root}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *protos,
    ]
    done = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"protoc failed (exit {done.returncode}): {done.stderr.strip()}")


def generated_files(root: Path) -> list[Path]:
    pkg = root / "pdserve" / "v1"
    return sorted(p for p in pkg.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def meaning(path: Path) -> str:
    """The file's text with the generator's version stamps blanked (what the drift check compares)."""
    text = path.read_text()
    for stamp in _VERSION_STAMPS:
        text = stamp.sub(r"\1<version>", text)
    return text


def check(proto_root: Path = PROTO_ROOT) -> list[str]:
    """Returns the names of generated files under proto_root that differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        (out / "pdserve" / "v1").mkdir(parents=True)
        generate(out, proto_root)
        fresh = {p.name: p for p in generated_files(out)}
        committed = {p.name: p for p in generated_files(proto_root)}
        drift = sorted(set(fresh) ^ set(committed))
        for name in sorted(set(fresh) & set(committed)):
            if meaning(fresh[name]) != meaning(committed[name]):
                drift.append(name)
        return drift


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed code drifted")
    args = parser.parse_args(argv)
    if args.check:
        drift = check()
        if drift:
            print("generated protobuf code is stale; run `make protos`: " + ", ".join(drift), file=sys.stderr)
            return 1
        print("generated protobuf code is current")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        (out / "pdserve" / "v1").mkdir(parents=True)
        generate(out)
        for p in generated_files(PROTO_ROOT):
            p.unlink()
        for p in generated_files(out):
            shutil.copy(p, PROTO_PACKAGE / p.name)
    print(f"regenerated {PROTO_PACKAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
