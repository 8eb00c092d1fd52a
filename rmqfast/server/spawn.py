"""How the supervisor starts its child processes (workers, deliver processes).

``python -m pkg.mod`` puts the current directory first on ``sys.path``: a ``rmqfast/`` folder
in the directory the proxy was started from (a source checkout, a writable state directory)
would be imported by every child instead of the supervisor's package -- version skew, a silent
fall-back to the pure-Python codec, or code run as the proxy's user.  So children are started

* with ``-P`` (Python 3.11: the current directory is not added to ``sys.path``),
* with ``PYTHONPATH`` led by the directory that holds the supervisor's own ``rmqfast`` package
  (absolute; relative entries of an inherited ``PYTHONPATH`` are made absolute against the
  supervisor's directory, as the supervisor itself resolved them), and
* in a fixed working directory: the supervisor's private runtime directory (mode 0700).

Each worker reports its ``rmqfast`` version, codec implementation and package directory in its
``ready`` status message; :func:`identity_mismatch` compares them with the supervisor's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import rmqfast


def package_dir() -> str:
    """The directory of the ``rmqfast`` package this process runs (symlinks resolved)."""
    return os.path.realpath(os.path.dirname(rmqfast.__file__))


def identity() -> dict[str, str]:
    """What a child must share with the supervisor: version, codec twin, package directory."""
    from rmqfast.codec import IMPLEMENTATION

    return {"version": rmqfast.__version__, "codec": IMPLEMENTATION, "package": package_dir()}


def identity_mismatch(reported: dict[str, object]) -> str:
    """Why a child's reported identity differs from this process's ('' when it matches)."""
    mine = identity()
    diffs = []
    for key in ("version", "codec", "package"):
        theirs = reported.get(key)
        if theirs is None:
            diffs.append(f"{key}: not reported (the worker runs an older or foreign rmqfast)")
        elif str(theirs) != mine[key]:
            diffs.append(f"{key}: worker {theirs!s}, supervisor {mine[key]}")
    return "; ".join(diffs)


def child_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``PYTHONPATH`` led by the supervisor's package parent (absolute entries only)."""
    root = os.path.dirname(package_dir())
    entries = [root]
    for entry in env.get("PYTHONPATH", "").split(os.pathsep):
        if entry:
            entry = os.path.abspath(entry)
            if entry not in entries:
                entries.append(entry)
    out = dict(env)
    out["PYTHONPATH"] = os.pathsep.join(entries)
    out.pop("PYTHONSTARTUP", None)  # only read by interactive interpreters, but never wanted here
    return out


def child_command(module: str, *args: str) -> list[str]:
    """``python -P -m module args...`` with the supervisor's interpreter."""
    return [sys.executable, "-P", "-m", module, *args]


def child_cwd(runtime: Path) -> str:
    """The working directory of every child: the supervisor's private runtime directory."""
    return str(runtime)
