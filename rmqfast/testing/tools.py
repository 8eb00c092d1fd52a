"""The programs the harness needs from the machine: ``java`` (17+) and ``mvn`` (3.6+)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from rmqfast.testing.errors import ToolMissingError


def _find(env_var: str, name: str, install: str, *also: Path) -> str:
    """``$env_var`` if set (must be executable), else the first of ``also`` that is a file, else
    ``name`` on PATH; ToolMissingError saying how to install it otherwise."""
    explicit = os.environ.get(env_var)
    if explicit:
        if not shutil.which(explicit):
            raise ToolMissingError(f"{env_var}={explicit!r} is not an executable")
        return explicit
    for candidate in also:
        if candidate.is_file():
            return str(candidate)
    found = shutil.which(name)
    if not found:
        raise ToolMissingError(f"{name} not found: install {install} or set {env_var}")
    return found


def java_executable() -> str:
    """``$RMQFAST_JAVA``, else ``$JAVA_HOME/bin/java``, else ``java`` on PATH."""
    home = os.environ.get("JAVA_HOME")
    return _find("RMQFAST_JAVA", "java",
                 "a JDK 17+ (Debian: apt-get install -y openjdk-17-jdk-headless) or set JAVA_HOME",
                 *([Path(home) / "bin" / "java"] if home else []))


def mvn_executable() -> str:
    """``$RMQFAST_MVN``, else ``mvn`` on PATH."""
    return _find("RMQFAST_MVN", "mvn", "Maven 3.6+ (Debian: apt-get install -y maven)")
