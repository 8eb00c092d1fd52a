"""Tails of process output for error messages (Maven, JVMs, the Java driver)."""

from __future__ import annotations

import os
from pathlib import Path


def tail(text: str, lines: int) -> str:
    """The last ``lines`` lines of ``text``."""
    return "\n".join(text.splitlines()[-lines:])


def read_bytes(path: Path) -> bytes:
    """The file's bytes, or b"" when it cannot be read (not written yet)."""
    try:
        return path.read_bytes()
    except OSError:
        return b""


def file_tail(path: Path, lines: int = 40, max_bytes: int = 64 * 1024) -> str:
    """The last ``lines`` lines of a file (reading at most its last ``max_bytes``)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"<cannot read {path}: {e}>"
    return tail(data, lines)
