"""Runs godriver (``godriver/``) with the real Go RocketMQ client, rocketmq-client-go/v2 v2.1.2.

The driver is built on first use with the Go toolchain from the Go module proxy (like the Java
driver with Maven) and cached under ``~/.cache/rmqfast/godriver-<hash of its sources>``, so a
second run (or a second test session) starts at once.  It prints ONE JSON object on stdout;
scenarios and flags are documented in ``godriver/main.go``::

    produce      --topic T --count N --mode sync|batch|ordered [--prefix P]
    consume-push --topic T --group G --expect N [--orderly] [--instance NAME] [--sub "TagA || TagB"]
                 [--stop-file PATH] [--trace-deliveries]   ("CONSUMER_STARTED" on stderr once started)
    consume-pull --topic T --group G --expect N
    retry-dlq    --topic T --group G --expect N --max-reconsume R [--orderly]

Options are keyword arguments (``count=20, orderly=True``; underscores become dashes).
Exit codes: 0 ok, 1 error, 2 send failures, 3 consumer incomplete/timed out, 64 usage.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rmqfast.testing import HarnessError, ToolMissingError

GO_CLIENT_VERSION = "v2.1.2"
SOURCE_DIR = Path(__file__).resolve().parents[2] / "godriver"
_SOURCES = ("go.mod", "go.sum", "main.go")
#: Where ``make system-deps`` (and the Go download page) put the toolchain when it is not on PATH.
_GO_CANDIDATES = ("/usr/local/go/bin/go", "/usr/lib/go/bin/go", "/usr/bin/go")


class GoDriverError(HarnessError):
    """The Go driver failed: non-zero exit, no JSON, or a timeout (``result``: its JSON, if any)."""

    def __init__(self, message: str, *, returncode: int | None, result: dict[str, Any] | None,
                 stderr_tail: str) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.result = result
        self.stderr_tail = stderr_tail


def go_executable() -> str:
    """The ``go`` command, or ToolMissingError saying how to install it."""
    env = os.environ.get("RMQFAST_GO")
    if env:
        return env
    found = shutil.which("go")
    if found:
        return found
    for cand in _GO_CANDIDATES:
        if os.access(cand, os.X_OK):
            return cand
    raise ToolMissingError(
        "the Go toolchain is not installed (needed to build the rocketmq-client-go driver): "
        "run `make system-deps` or `apt-get install golang-go`, or set RMQFAST_GO to the go binary"
    )


def _source_hash() -> str:
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rmqfast"


def ensure_godriver(timeout: float = 900.0) -> Path:
    """The built driver binary: built once per source version (under a lock: parallel sessions)."""
    out = cache_dir() / f"godriver-{_source_hash()}"
    if out.exists():
        return out
    go = go_executable()
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / "godriver.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            return out
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        env = dict(os.environ)
        env.setdefault("GOFLAGS", "-mod=mod")
        env.setdefault("GOTOOLCHAIN", "local")  # never download another toolchain
        try:
            proc = subprocess.run([go, "build", "-o", str(tmp), "."], cwd=SOURCE_DIR, env=env,
                                  capture_output=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            raise HarnessError(f"building the Go driver took over {timeout:.0f} s (module downloads?)") from None
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise HarnessError(
                f"`go build` of {SOURCE_DIR} failed ({proc.returncode}); it needs the Go module proxy "
                f"(GOPROXY) to fetch rocketmq-client-go {GO_CLIENT_VERSION}:\n"
                f"{proc.stderr.decode('utf-8', 'replace')[-3000:]}"
            )
        os.replace(tmp, out)
    return out


def _option_args(options: Mapping[str, object]) -> list[str]:
    out: list[str] = []
    for key, value in options.items():
        if value is None or value is False:
            continue
        name = "-" + key.replace("_", "-")
        out += [name] if value is True else [f"{name}={value}"]
    return out


class GoDriverProcess:
    """A running driver (see :func:`start_godriver`); :meth:`result` waits for its JSON."""

    def __init__(self, cmd: list[str]) -> None:
        self.cmd = cmd
        self.workdir = Path(tempfile.mkdtemp(prefix="rmqfast-godriver-"))
        self.stdout_path = self.workdir / "stdout.json"
        self.stderr_path = self.workdir / "stderr.log"
        env = dict(os.environ)
        env["HOME"] = str(self.workdir)  # the client writes ~/logs/rocketmqlogs and offsets there
        with open(self.stdout_path, "wb") as o, open(self.stderr_path, "wb") as e:
            self._proc = subprocess.Popen(cmd, stdout=o, stderr=e, stdin=subprocess.DEVNULL, env=env,
                                          cwd=self.workdir, start_new_session=True)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def poll(self) -> int | None:
        return self._proc.poll()

    def stderr_tail(self, n: int = 4000) -> str:
        try:
            return self.stderr_path.read_text("utf-8", "replace")[-n:]
        except OSError:
            return ""

    def kill(self) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, 9)
            self._proc.wait()

    def result(self, timeout: float = 120.0, *, check: bool = True) -> dict[str, Any]:
        try:
            rc = self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise GoDriverError(f"Go driver did not finish within {timeout:.0f} s: {self.cmd}",
                                returncode=None, result=None, stderr_tail=self.stderr_tail()) from None
        res: dict[str, Any] | None = None
        for line in reversed(self.stdout_path.read_text("utf-8", "replace").splitlines()):
            line = line.strip()
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    res = json.loads(line)
                    break
        if res is None:
            raise GoDriverError(f"Go driver exited {rc} without a JSON result: {self.cmd}",
                                returncode=rc, result=None, stderr_tail=self.stderr_tail())
        if check and rc != 0:
            raise GoDriverError(f"Go driver exited {rc} ({res.get('error')}): {self.cmd}",
                                returncode=rc, result=res, stderr_tail=self.stderr_tail())
        shutil.rmtree(self.workdir, ignore_errors=True)
        return res


def start_godriver(scenario: str, namesrv: str, **options: object) -> GoDriverProcess:
    """Start the Go driver on ``scenario`` against the name server ``namesrv``."""
    binary = ensure_godriver()
    # connections stay open a second after the work, so that a ConnectionWatch sampling a loaded
    # machine sees a short run's connections too
    options.setdefault("linger_ms", 1000)
    return GoDriverProcess([str(binary), scenario, f"-ns={namesrv}", *_option_args(options)])


def run_godriver(scenario: str, namesrv: str, *, timeout: float = 120.0, check: bool = True,
                 **options: object) -> dict[str, Any]:
    """Run the Go driver to the end and return its JSON (raises GoDriverError on failure)."""
    return start_godriver(scenario, namesrv, **options).result(timeout, check=check)
