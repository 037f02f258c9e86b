"""pdserve: `python -m pdserve` is the `pdserve` command (pdserve/cli.py)."""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("pdserve")
except metadata.PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"
