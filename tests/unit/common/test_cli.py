import subprocess
import sys

import pytest

from services.common.cli import SUBCOMMANDS, main


def test_top_level_help(capsys) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_subcommand_has_help(name: str, capsys) -> None:
    with pytest.raises(SystemExit, match='^0$') as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    assert f"pdserve {name}" in capsys.readouterr().out


def test_unknown_command_exits_2(capsys) -> None:
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_installed_entry_point_runs() -> None:
    proc = subprocess.run([sys.executable, "-m", "services.common.cli", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "commands:" in proc.stdout
