"""The real RocketMQ 5.x Java gRPC client (``rocketmq-client-java`` 5.0.7) as a test driver.

``java/grpcclient`` (``GrpcDriver``) is built by Maven on first use (not part of the aggregator
``java/pom.xml``) and run as one JVM per call: ``produce`` or ``consume`` (SimpleConsumer receive +
ack); its stdout lines are returned.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rmqfast.testing.errors import HarnessError
from rmqfast.testing.maven import DEFAULT_JAVA_DIR, _build_lock, _has_jars, _inputs_digest, _run_maven
from rmqfast.testing.tools import java_executable


def ensure_grpc_driver(java_dir: Path | None = None, *, timeout: float = 1800.0) -> str:
    """The classpath of ``GrpcDriver``, built unless already built from the same pom and source."""
    jd = (java_dir or Path(os.environ.get("RMQFAST_JAVA_DIR", DEFAULT_JAVA_DIR))).resolve()
    root = jd / "grpcclient"
    pom = root / "pom.xml"
    src = root / "src" / "main" / "java" / "GrpcDriver.java"
    if not pom.is_file() or not src.is_file():
        raise HarnessError(f"{root} has no pom.xml or GrpcDriver.java: is this the rmqfast repository's java/ dir?")
    java_executable()  # fail early with a clear message
    target = root / "target"
    with _build_lock(jd):
        stamp = target / "rmqfast-inputs.sha256"
        digest = _inputs_digest([pom, src])
        if not _has_jars(target / "lib") or not stamp.is_file() or stamp.read_text() != digest:
            shutil.rmtree(target, ignore_errors=True)
            _run_maven(["-q", "-f", str(pom), "package"], jd, timeout)
            stamp.write_text(digest)
    return f"{target / 'classes'}{os.pathsep}{target / 'lib'}/*"


@dataclass
class DriverRun:
    lines: list[str]
    stderr: str

    def events(self, kind: str) -> list[list[str]]:
        """Fields of the lines starting with ``kind`` (``SENT``, ``RECV``), split on spaces."""
        return [ln.split(" ")[1:] for ln in self.lines if ln.startswith(kind + " ")]


def run_driver(classpath: str, *args: str, timeout: float = 120.0) -> DriverRun:
    """One ``GrpcDriver`` JVM; raises :class:`HarnessError` (with its stderr tail) when it fails."""
    cmd = [java_executable(), "-Xmx128m", "-XX:TieredStopAtLevel=1", "-cp", classpath, "GrpcDriver", *args]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise HarnessError(f"GrpcDriver {' '.join(args)} did not finish within {timeout:.0f} s") from exc
    if p.returncode != 0:
        raise HarnessError(f"GrpcDriver {' '.join(args)} exited {p.returncode}: {p.stderr[-3000:]}")
    return DriverRun(p.stdout.splitlines(), p.stderr)
