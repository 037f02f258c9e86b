"""Reading the files a user names (a deploy YAML, a tuner profile): one message for one that
cannot be read."""

from __future__ import annotations

import pathlib


def read_text(path: str | pathlib.Path, error: type[Exception]) -> str:
    """The text of the file at `path`; one that cannot be read raises `error`, naming the file and
    why."""
    try:
        return pathlib.Path(path).read_text()
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror or e}") from None
