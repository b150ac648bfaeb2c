"""What a device run carries (bench/device_carry.py): wheels slimmed without what pdserve never
loads (a library kept whole where its only copy is versioned), and a carry over the limit
refused with the reason."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from bench.device_carry import main, measure, slim_wheel


def _wheel(path: Path, names: list[str]) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for name in names:
            z.writestr(name, b"x" * 1000)
        z.writestr("pkg-1.0.dist-info/RECORD", "".join(f"{n},sha256=abc,1000\n" for n in names) +
                   "pkg-1.0.dist-info/RECORD,,\n")


def test_slim_drops_static_headers_perftest_programs_and_duplicate_so_copies(tmp_path: Path) -> None:
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    kept = ["libucx/lib/libucp.so", "libucx/lib/libucp.so.0", "libucx/lib/ucx/libuct_cuda.so",
            "libucx/lib/ucx/libuct_cuda.so.0", "libucx/load.py", "pkg.libs/libzmq-2f02442c.so.5.2.5"]
    dropped = ["libucx/lib/libucp.so.0.0.0", "libucx/lib/libucp.a", "libucx/include/ucp/api/ucp.h",
               "libucx/bin/ucx_perftest", "libucx/lib/ucx/libucx_perftest_cuda.so",
               "libucx/lib/ucx/libuct_cuda.so.0.0.0"]
    _wheel(wheel, kept + dropped)
    before, after = slim_wheel(wheel)
    assert after < before
    with zipfile.ZipFile(wheel) as z:
        assert sorted(n for n in z.namelist() if "dist-info" not in n) == sorted(kept)
        record = z.read("pkg-1.0.dist-info/RECORD").decode()
    assert all(n in record for n in kept) and not any(n in record for n in dropped)
    assert slim_wheel(wheel) == (after, after)  # nothing left to drop: untouched


def test_a_carry_over_the_limit_fails_with_the_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.py").write_bytes(b"x" * 4096)
    wheels = tmp_path / ".whl"
    wheels.mkdir()
    (wheels / "big-1.0-py3-none-any.whl").write_bytes(b"x" * (2 << 20))
    report = measure(tmp_path, wheels, limit_mib=1)
    assert not report["ok"] and report["wheel_bytes"] == 2 << 20 and report["tree_bytes"] >= 4096
    assert main(["measure", "--root", str(tmp_path), "--wheel-dir", str(wheels), "--limit-mib", "1"]) == 1
    out, err = capsys.readouterr()
    assert "OVER the 1 MiB limit" in out and "exceed 1 MiB" in err
    assert main(["measure", "--root", str(tmp_path), "--wheel-dir", str(wheels), "--limit-mib", "48"]) == 0
