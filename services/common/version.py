"""The installed pdserve version (one source: the distribution metadata)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pdserve")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+unknown"
