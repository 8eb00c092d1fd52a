"""The Java side of the harness, built by Maven: RocketMQ's jars and the RmqDriver classes.

:func:`ensure_jars` runs ``mvn package`` on ``java/`` (cluster jars from Maven Central, and the
``RmqDriver`` traffic generator compiled against rocketmq-client 5.x and 4.9.4) once, and skips
Maven while its inputs (the poms and the driver's sources) are unchanged.  Builds of one
``java/`` folder are serialised across processes (pytest-xdist workers) by a file lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rmqfast.testing.errors import HarnessError, MavenBuildError
from rmqfast.testing.logtail import tail
from rmqfast.testing.tools import java_executable, mvn_executable

ROCKETMQ_VERSION = "5.3.3"
"""Version of the name server/broker (java/cluster/pom.xml) and of the 5.x driver build."""
ROCKETMQ4_VERSION = "4.9.4"
"""Version of the optional 4.x broker (profile ``rocketmq4``) and of the 4.x driver build."""

BrokerVersion = Literal["5", "4"]

DEFAULT_JAVA_DIR = Path(__file__).resolve().parents[2] / "java"


@dataclass(frozen=True)
class JarPaths:
    """Where the built Java artifacts are. ``cluster4_lib`` is set when the 4.x broker is built."""

    java_dir: Path
    cluster_lib: Path
    driver5_classes: Path
    driver5_lib: Path
    driver4_classes: Path
    driver4_lib: Path
    cluster4_lib: Path | None = None

    def cluster_classpath(self, version: BrokerVersion = "5") -> str:
        """Classpath (wildcard form) of the name server/broker/tools jars."""
        if version == "4":
            if self.cluster4_lib is None:
                raise HarnessError("the 4.x broker was not built: call ensure_jars(rocketmq4=True)")
            return f"{self.cluster4_lib}/*"
        return f"{self.cluster_lib}/*"

    def driver_classpath(self, client: str) -> str:
        """Classpath of RmqDriver built against client ``"5"`` or ``"4"``."""
        if client == "5":
            return f"{self.driver5_classes}{os.pathsep}{self.driver5_lib}/*"
        if client == "4":
            return f"{self.driver4_classes}{os.pathsep}{self.driver4_lib}/*"
        raise ValueError(f"client must be '5' or '4', not {client!r}")


def _jar_paths(java_dir: Path, with4: bool) -> JarPaths:
    drv = java_dir / "driver" / "target"
    return JarPaths(
        java_dir=java_dir,
        cluster_lib=java_dir / "cluster" / "target" / "lib",
        driver5_classes=drv / "client5" / "classes",
        driver5_lib=drv / "client5" / "lib",
        driver4_classes=drv / "client4" / "classes",
        driver4_lib=drv / "client4" / "lib",
        cluster4_lib=(java_dir / "cluster" / "target" / "lib4") if with4 else None,
    )


def _inputs_digest(paths: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(str(p).encode())
        h.update(b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def _main_inputs(java_dir: Path) -> list[Path]:
    files = [
        java_dir / "pom.xml",
        java_dir / "cluster" / "pom.xml",
        java_dir / "driver" / "pom-client5.xml",
        java_dir / "driver" / "pom-client4.xml",
    ]
    files += sorted((java_dir / "driver" / "src").rglob("*.java"))
    return files


def _has_jars(d: Path) -> bool:
    return d.is_dir() and any(d.glob("*.jar"))


def _run_maven(args: Sequence[str], cwd: Path, timeout: float) -> None:
    cmd = [mvn_executable(), "-B", "-Dstyle.color=never", *args]
    started = time.monotonic()
    try:
        proc = subprocess.run(
            cmd,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode("utf-8", "replace") if isinstance(e.stdout, bytes) else ""
        raise MavenBuildError(
            f"`{' '.join(cmd)}` (in {cwd}) did not finish within {timeout:.0f} s.\n"
            f"Last output:\n{tail(out, 40)}\n"
            "Check that Maven Central is reachable (or ~/.m2 is populated) and retry."
        ) from None
    out = proc.stdout.decode("utf-8", "replace")
    if proc.returncode != 0:
        raise MavenBuildError(
            f"`{' '.join(cmd)}` (in {cwd}) failed with exit code {proc.returncode} after "
            f"{time.monotonic() - started:.0f} s.\nLast output:\n{tail(out, 60)}\n"
            "What to do: check Maven Central is reachable (repo.maven.apache.org) and that the "
            "versions in java/**/pom.xml exist there; re-run the command by hand for the full log."
        )


@contextlib.contextmanager
def _build_lock(java_dir: Path) -> Iterator[None]:
    """Serialises builds of one java dir across processes (e.g. pytest-xdist workers)."""
    tag = hashlib.sha256(str(java_dir.resolve()).encode()).hexdigest()[:16]
    lock_path = Path(tempfile.gettempdir()) / f"rmqfast-mvn-{tag}.lock"
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


_ensured: dict[tuple[Path, bool], JarPaths] = {}
_ensure_mutex = threading.Lock()


def ensure_jars(
    java_dir: Path | None = None,
    *,
    rocketmq4: bool = False,
    force: bool = False,
    timeout: float = 1800.0,
) -> JarPaths:
    """Builds java/ (cluster jars + both driver builds) unless already built from the same inputs.

    ``rocketmq4=True`` also builds the 4.9.x broker (``mvn -Procketmq4`` into
    ``cluster/target/lib4``). Raises :class:`ToolMissingError` without java/mvn and
    :class:`MavenBuildError` (with Maven's output tail) when the build fails. A first build on an
    empty ``~/.m2`` downloads ~150 MB from Maven Central.
    """
    jd = (java_dir or Path(os.environ.get("RMQFAST_JAVA_DIR", DEFAULT_JAVA_DIR))).resolve()
    key = (jd, rocketmq4)
    with _ensure_mutex:
        if not force and key in _ensured:
            return _ensured[key]
        if not (jd / "pom.xml").is_file():
            raise HarnessError(f"{jd} has no pom.xml: is this the rmqfast repository's java/ dir?")
        java_executable()  # fail early with a clear message
        paths = _jar_paths(jd, rocketmq4)
        with _build_lock(jd):
            stamp = jd / "cluster" / "target" / "rmqfast-inputs.sha256"
            digest = _inputs_digest(_main_inputs(jd))
            outputs_ok = (
                _has_jars(paths.cluster_lib)
                and _has_jars(paths.driver5_lib)
                and _has_jars(paths.driver4_lib)
                and (paths.driver5_classes / "io/rmqfast/driver/RmqDriver.class").is_file()
                and (paths.driver4_classes / "io/rmqfast/driver/RmqDriver.class").is_file()
            )
            if force or not outputs_ok or not stamp.is_file() or stamp.read_text() != digest:
                # stale jars of another version would end up on the classpath: start clean
                for d in (paths.cluster_lib, paths.driver5_lib, paths.driver4_lib):
                    shutil.rmtree(d, ignore_errors=True)
                stamp.unlink(missing_ok=True)
                _run_maven(["-q", "-f", str(jd / "pom.xml"), "package"], jd, timeout)
                stamp.parent.mkdir(parents=True, exist_ok=True)
                stamp.write_text(digest)
            if rocketmq4:
                assert paths.cluster4_lib is not None
                stamp4 = jd / "cluster" / "target" / "rmqfast-inputs4.sha256"
                digest4 = _inputs_digest([jd / "cluster" / "pom.xml"])
                if (
                    force
                    or not _has_jars(paths.cluster4_lib)
                    or not stamp4.is_file()
                    or stamp4.read_text() != digest4
                ):
                    shutil.rmtree(paths.cluster4_lib, ignore_errors=True)
                    stamp4.unlink(missing_ok=True)
                    _run_maven(
                        ["-q", "-f", str(jd / "cluster" / "pom.xml"), "-Procketmq4", "package"],
                        jd,
                        timeout,
                    )
                    stamp4.write_text(digest4)
        _ensured[key] = paths
        return paths
