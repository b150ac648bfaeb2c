"""pip's install settings as uv's environment variables (the Makefile installs with `uv pip`).

uv does not read pip's configuration, so a machine whose pip is set up to find wheels in local
folders or extra indexes (`pip config list`: find-links, index-url, extra-index-url, constraint,
cert, timeout) would lose them. This prints the same settings as `NAME=value` assignments for
`env` on one line, plus `UV_INDEX_STRATEGY=unsafe-best-match` (pip's rule: the best version
across every index, not the first index that has the name). Where pip has no such settings it
prints only that, and uv uses PyPI as pip would. Standard library only: it runs with the system
Python before any venv exists.

Usage: `python3 tools/uv_args.py [PYTHON]` (PYTHON: the interpreter whose pip is asked; default
this one).
"""

from __future__ import annotations

import shlex
import subprocess
import sys

# pip's configuration sections, highest precedence first (environment variables, then the
# install command's section, then global), as pip itself resolves one key.
SECTIONS = (":env:", "install", "global")
# pip key -> (uv variable, the separator of its list); pip splits these values on whitespace.
LISTS = {"index-url": ("UV_INDEX_URL", " "), "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
         "find-links": ("UV_FIND_LINKS", ","), "constraint": ("UV_CONSTRAINT", " ")}
SCALARS = {"cert": "SSL_CERT_FILE", "default-timeout": "UV_HTTP_TIMEOUT", "timeout": "UV_HTTP_TIMEOUT"}


def pip_config(python: str) -> dict[str, str]:
    """`section.key` -> value, as `pip config list` prints it ({} where pip cannot say)."""
    try:
        out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             check=False).stdout
    except OSError as e:
        print(f"uv_args: cannot ask {python}'s pip for its settings ({e}); uv uses PyPI", file=sys.stderr)
        return {}
    config: dict[str, str] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            config[key.strip()] = value.strip().strip("'\"")
    return config


def resolve(config: dict[str, str], key: str) -> str | None:
    """The value pip uses for `key` (the highest-precedence section that sets it)."""
    for section in SECTIONS:
        value = config.get(f"{section}.{key}")
        if value is not None:
            return value
    return None


def uv_env(config: dict[str, str]) -> dict[str, str]:
    env = {"UV_INDEX_STRATEGY": "unsafe-best-match"}
    for key, (name, sep) in LISTS.items():
        if values := (resolve(config, key) or "").split():
            env[name] = sep.join(values)
    for key, name in SCALARS.items():
        if (value := resolve(config, key)) and name not in env:
            env[name] = value
    return env


def main(argv: list[str]) -> int:
    config = pip_config(argv[1] if len(argv) > 1 else sys.executable)
    print(" ".join(shlex.quote(f"{name}={value}") for name, value in uv_env(config).items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
