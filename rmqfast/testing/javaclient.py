"""Runs RmqDriver (java/driver) with the real RocketMQ Java client, 5.x or 4.9.4.

The driver prints ONE JSON object on stdout (its logs go to stderr). Scenarios and options are
documented in ``java/driver/src/main/java/io/rmqfast/driver/RmqDriver.java``; the common ones::

    produce          --topic T --count N --mode sync|async|oneway|batch|ordered
                     [--tags TagA,TagB] [--shard-keys K] [--body-size B] [--unicode]
    consume-push     --topic T --expect N [--sub "TagA || TagB" | --sql EXPR] [--orderly]
                     [--fail-every K] [--group G] [--timeout-ms MS]
    consume-litepull --topic T --expect N [--sub ... | --sql ...]
    transaction      --topic T --count N [--unknown-every U] [--rollback-every R]
    roundtrip        --topic T --count N --mode M [--consumer push|litepull] [--orderly]
    queues           --topic T

Options can be given as ``*args`` (``"--count", "20"``) or as keyword arguments
(``count=20, orderly=True, sub="TagA || TagB"``; underscores become dashes).

Exit codes: 0 ok, 1 error, 2 send failures, 3 consumer incomplete/timed out, 64 usage.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from rmqfast.testing.errors import HarnessError
from rmqfast.testing.jvm import kill_group, live_procs
from rmqfast.testing.logtail import file_tail
from rmqfast.testing.maven import ROCKETMQ4_VERSION, ROCKETMQ_VERSION, JarPaths, ensure_jars
from rmqfast.testing.tools import java_executable

Client = Literal["5", "4"]
CLIENT_VERSIONS: dict[str, str] = {"5": ROCKETMQ_VERSION, "4": ROCKETMQ4_VERSION}
"""The rocketmq-client version each driver build uses."""

MAIN_CLASS = "io.rmqfast.driver.RmqDriver"


class DriverError(HarnessError):
    """The driver failed: non-zero exit, no JSON, or a timeout.

    ``result`` holds the parsed JSON when the driver printed one (it does even on failure).
    """

    def __init__(
        self,
        message: str,
        *,
        returncode: int | None,
        result: dict[str, Any] | None,
        stderr_tail: str,
        cmd: Sequence[str],
    ) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.result = result
        self.stderr_tail = stderr_tail
        self.cmd = list(cmd)


_log_root: Path | None = None
_log_root_mutex = threading.Lock()
_driver_ids = itertools.count(1)


def _default_log_root() -> Path:
    global _log_root
    with _log_root_mutex:
        if _log_root is None:
            _log_root = Path(tempfile.mkdtemp(prefix="rmqfast-drivers-"))
            if os.environ.get("RMQFAST_KEEP_DRIVER_LOGS") != "1":
                atexit.register(shutil.rmtree, _log_root, True)
        return _log_root


def _option_args(options: Mapping[str, object]) -> list[str]:
    out: list[str] = []
    for key, value in options.items():
        if value is None:
            continue
        name = "--" + key.replace("_", "-")
        if value is True:
            out += [name, "true"]
        elif value is False:
            out += [name, "false"]
        elif isinstance(value, list | tuple):
            out += [name, ",".join(str(v) for v in value)]
        else:
            out += [name, str(value)]
    return out


def driver_command(
    scenario: str,
    namesrv: str,
    client: Client = "5",
    *args: str,
    jars: JarPaths | None = None,
    log_dir: Path | None = None,
    heap_mb: int = 128,
    fast_start: bool = True,
    jvm_opts: Sequence[str] = (),
    **options: object,
) -> list[str]:
    """The ``java ...`` command line that runs one driver scenario."""
    if client not in ("5", "4"):
        raise ValueError(f"client must be '5' or '4', not {client!r}")
    jars = jars or ensure_jars()
    log_dir = log_dir or _default_log_root()
    cmd = [
        java_executable(),
        f"-Xms{min(32, heap_mb)}m",
        f"-Xmx{heap_mb}m",
        "-XX:+UseSerialGC",
        "-Xss512k",
        "-Dfile.encoding=UTF-8",
        f"-Drocketmq.client.logRoot={log_dir}",
        f"-Drocketmq.log.root={log_dir}",
        "-Drocketmq.client.logUseSlf4j=false",
    ]
    if fast_start:
        cmd.append("-XX:TieredStopAtLevel=1")
    cmd += list(jvm_opts)
    cmd += ["-cp", jars.driver_classpath(client), MAIN_CLASS, scenario, "--namesrv", namesrv]
    cmd += list(args)
    cmd += _option_args(options)
    return cmd


def _parse_result(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                parsed = json.loads(line)
            except ValueError:
                continue
            if isinstance(parsed, dict):
                return parsed
    return None


class DriverProcess:
    """A running driver JVM (see :func:`start_driver`). Use :meth:`result` to wait for its JSON."""

    def __init__(self, cmd: list[str], workdir: Path, env: Mapping[str, str] | None = None) -> None:
        self.cmd = cmd
        self.workdir = workdir
        self.stdout_path = workdir / "stdout.json"
        self.stderr_path = workdir / "stderr.log"
        base_env = dict(os.environ)
        base_env.pop("JAVA_TOOL_OPTIONS", None)
        if env:
            base_env.update(env)
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self._proc = subprocess.Popen(
                cmd,
                cwd=workdir,
                env=base_env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        live_procs.add(self._proc)
        self._result: dict[str, Any] | None = None

    @property
    def pid(self) -> int:
        return self._proc.pid

    def poll(self) -> int | None:
        return self._proc.poll()

    def stderr_text(self) -> str:
        try:
            return self.stderr_path.read_text("utf-8", "replace")
        except OSError:
            return ""

    def wait_for_log(self, pattern: str, timeout: float = 30.0) -> str:
        """Waits until a stderr line matches ``pattern`` (regex); returns that line."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            for line in self.stderr_text().splitlines():
                if rx.search(line):
                    return line
            if self._proc.poll() is not None:
                raise DriverError(
                    f"driver exited ({self._proc.returncode}) before logging /{pattern}/",
                    returncode=self._proc.returncode,
                    result=self._read_result(),
                    stderr_tail=file_tail(self.stderr_path, 40),
                    cmd=self.cmd,
                )
            if time.monotonic() > deadline:
                raise DriverError(
                    f"driver did not log /{pattern}/ within {timeout:.0f} s",
                    returncode=None,
                    result=None,
                    stderr_tail=file_tail(self.stderr_path, 40),
                    cmd=self.cmd,
                )
            time.sleep(0.05)

    def wait_started(self, timeout: float = 30.0) -> DriverProcess:
        """For consumer scenarios: waits until the consumer has started (subscribed)."""
        self.wait_for_log(r"CONSUMER_STARTED", timeout)
        return self

    def _read_result(self) -> dict[str, Any] | None:
        try:
            return _parse_result(self.stdout_path.read_text("utf-8", "replace"))
        except OSError:
            return None

    def result(self, timeout: float = 120.0, *, check: bool = True) -> dict[str, Any]:
        """Waits for the driver to exit and returns its JSON. With ``check``, raises
        :class:`DriverError` on a non-zero exit (``error.result`` still has the JSON)."""
        if self._result is not None:
            return self._result
        try:
            rc = self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise DriverError(
                f"driver {self.cmd[self.cmd.index(MAIN_CLASS) + 1]} did not finish within "
                f"{timeout:.0f} s (killed)\n{file_tail(self.stderr_path, 40)}",
                returncode=None,
                result=None,
                stderr_tail=file_tail(self.stderr_path, 40),
                cmd=self.cmd,
            ) from None
        res = self._read_result()
        tail = file_tail(self.stderr_path, 40)
        if res is None:
            raise DriverError(
                f"driver exited with {rc} without printing a JSON result\n{tail}",
                returncode=rc,
                result=None,
                stderr_tail=tail,
                cmd=self.cmd,
            )
        if check and rc != 0:
            raise DriverError(
                f"driver {res.get('scenario')} failed with exit code {rc}: "
                f"{res.get('error') or _summary(res)}\n{tail}",
                returncode=rc,
                result=res,
                stderr_tail=tail,
                cmd=self.cmd,
            )
        self._result = res
        return res

    def kill(self) -> None:
        kill_group(self._proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)

    def __enter__(self) -> DriverProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc.poll() is None:
            self.kill()


def _summary(res: Mapping[str, Any]) -> str:
    keys = (
        "sent_count",
        "failed_count",
        "distinct",
        "expect",
        "timed_out",
        "lost",
        "duplicates",
        "missing",
        "unexpected",
        "not_checked",
    )
    parts = []
    for k in keys:
        if k in res:
            v = res[k]
            if isinstance(v, list) and len(v) > 10:
                v = f"{v[:10]}... ({len(v)})"
            parts.append(f"{k}={v}")
    if "mismatched" in res and res["mismatched"]:
        parts.append(f"mismatched={res['mismatched'][:3]}")
    return ", ".join(parts)


def start_driver(
    scenario: str,
    namesrv: str,
    client: Client = "5",
    *args: str,
    jars: JarPaths | None = None,
    log_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
    heap_mb: int = 128,
    fast_start: bool = True,
    jvm_opts: Sequence[str] = (),
    **options: object,
) -> DriverProcess:
    """Starts a driver JVM and returns at once (for scenarios that must run concurrently,
    e.g. a consumer started before a producer: ``start_driver(...).wait_started()``)."""
    root = log_dir or _default_log_root()
    workdir = root / f"driver{next(_driver_ids):04d}-{scenario}-c{client}"
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = driver_command(
        scenario,
        namesrv,
        client,
        *args,
        jars=jars,
        log_dir=workdir,
        heap_mb=heap_mb,
        fast_start=fast_start,
        jvm_opts=jvm_opts,
        **options,
    )
    return DriverProcess(cmd, workdir, env)


def run_driver(
    scenario: str,
    namesrv: str,
    client: Client = "5",
    *args: str,
    timeout: float = 120.0,
    check: bool = True,
    jars: JarPaths | None = None,
    log_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
    heap_mb: int = 128,
    fast_start: bool = True,
    jvm_opts: Sequence[str] = (),
    **options: object,
) -> dict[str, Any]:
    """Runs one driver scenario to completion and returns its JSON result.

    Raises :class:`DriverError` (with the stderr tail, and the JSON in ``.result`` when there is
    one) if the driver exits non-zero (unless ``check=False``), prints no JSON, or exceeds
    ``timeout`` seconds. Keep the driver's own ``timeout_ms`` option below ``timeout``.
    """
    with start_driver(
        scenario,
        namesrv,
        client,
        *args,
        jars=jars,
        log_dir=log_dir,
        env=env,
        heap_mb=heap_mb,
        fast_start=fast_start,
        jvm_opts=jvm_opts,
        **options,
    ) as proc:
        return proc.result(timeout, check=check)


__all__ = [
    "CLIENT_VERSIONS",
    "Client",
    "DriverError",
    "DriverProcess",
    "driver_command",
    "run_driver",
    "start_driver",
]
