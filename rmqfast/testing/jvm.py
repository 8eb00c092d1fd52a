"""JVM processes of the harness: starting a JVM that dies with us, killing it (and its group).

Every JVM is started in its own process group; :func:`kill_group` kills the group, and at exit
every JVM still running is killed.  On Linux a JVM started from the main thread also gets
PR_SET_PDEATHSIG, so it does not outlive a test run that is itself killed with SIGKILL.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

#: Every JVM the harness started (and the Java driver's), killed at exit if still running.
live_procs: weakref.WeakSet[subprocess.Popen[bytes]] = weakref.WeakSet()


def kill_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the process group of ``proc`` (a JVM and any children it forked)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


@atexit.register
def _kill_leftovers() -> None:
    for p in list(live_procs):
        kill_group(p)


def _load_prctl() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# resolved in the parent: nothing may be imported between fork and exec
_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _preexec() -> None:  # pragma: no cover - runs in the child
    os.setsid()
    # die with the parent (thread) even if it is SIGKILLed
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)  # type: ignore[operator]


def spawn_jvm(
    cmd: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    stdout_path: Path,
) -> subprocess.Popen[bytes]:
    """Starts a JVM in its own process group, stdout+stderr appended to ``stdout_path``.

    On Linux the child gets PR_SET_PDEATHSIG when started from the main thread (the signal is
    tied to the creating *thread*), so JVMs do not outlive a killed test run.
    """
    out = open(stdout_path, "ab")
    try:
        use_pdeathsig = _PRCTL is not None and (
            threading.current_thread() is threading.main_thread()
        )
        proc = subprocess.Popen(
            list(cmd),
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=_preexec if use_pdeathsig else None,
            start_new_session=not use_pdeathsig,
        )
    finally:
        out.close()
    live_procs.add(proc)
    return proc


def jvm_module_opts() -> list[str]:
    """The --add-opens/--add-exports every RocketMQ JVM needs on Java 17."""
    # RocketMQ (4.x especially) reaches into NIO internals to unmap files.
    return [
        "--add-opens=java.base/java.nio=ALL-UNNAMED",
        "--add-opens=java.base/sun.nio.ch=ALL-UNNAMED",
        "--add-exports=java.base/sun.nio.ch=ALL-UNNAMED",
        "--add-opens=java.base/java.lang=ALL-UNNAMED",
        # 4.9.x MappedFile.clean() calls jdk.internal.ref.Cleaner#clean reflectively (on restart
        # after a kill, IndexService.load destroys the last index file: without this it aborts)
        "--add-exports=java.base/jdk.internal.ref=ALL-UNNAMED",
        "--add-opens=java.base/jdk.internal.ref=ALL-UNNAMED",
    ]
