"""A Spark standalone cluster on loopback: one Master and one Worker from the installed pyspark.

Both daemons are started with pyspark's own ``bin/spark-class`` (``org.apache.spark.deploy.master
.Master`` and ``...worker.Worker``), so the cluster runs the very Spark version the report uses,
offline (pyspark ships its jars).  Every port is the operating system's choice (``--port 0``,
``--webui-port 0``; the master's REST submission server, on a fixed port 6066 by default, is
off), everything binds 127.0.0.1, and the configuration directory is an empty one of its own, so
no ``spark-env.sh`` or ``spark-defaults.conf`` of the machine is read.

    with StandaloneCluster(tmp_path) as cluster:
        subprocess.run(["rmqfast", "analyze", ..., "--master", cluster.master_url], env=cluster.client_env())

Start-up waits on the daemons' own log lines ("Starting Spark master at spark://...",
"Successfully registered with master"), bounded by ``start_timeout``; a daemon that exits
first fails the start with the tail of its log.  ``stop()`` sends SIGTERM to each daemon's
process group (the Worker kills its executors on TERM), SIGKILL after ``stop_timeout``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from rmqfast.testing.errors import ClusterError, ToolMissingError
from rmqfast.testing.jvm import kill_group, spawn_jvm
from rmqfast.testing.logtail import file_tail, read_bytes

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
_MASTER_URL = re.compile(rb"Starting Spark master at (spark://127\.0\.0\.1:\d+)")
_REGISTERED = re.compile(rb"Successfully registered with master")
_EXECUTOR = re.compile(rb"Asked to launch executor (app-[\w-]+)/\d+")


def spark_class() -> Path:
    """pyspark's ``bin/spark-class`` (ToolMissingError without pyspark or Java)."""
    try:
        import pyspark
    except ImportError as exc:
        raise ToolMissingError(f"pyspark is not installed ({exc}); pip install 'rmqfast[analytics]'") from None
    path = Path(pyspark.__file__).parent / "bin" / "spark-class"
    if not path.is_file():
        raise ToolMissingError(f"{path} is missing: this pyspark has no launcher scripts (a pip install has them)")
    return path


class StandaloneCluster:
    """Spark Master + one Worker (``cores``, ``memory``) under ``workdir``; see the module doc."""

    def __init__(self, workdir: Path, *, cores: int = 2, memory: str = "1g", daemon_memory: str = "512m",
                 start_timeout: float = 180.0, stop_timeout: float = 30.0) -> None:
        self.workdir = Path(workdir)
        self.cores = cores
        self.memory = memory
        self.daemon_memory = daemon_memory
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.master_log = self.workdir / "master.log"
        self.worker_log = self.workdir / "worker.log"
        self.master_url = ""
        self._procs: list[subprocess.Popen[bytes]] = []

    def _env(self, **extra: str) -> dict[str, str]:
        conf = self.workdir / "conf"
        conf.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        for name in ("SPARK_HOME", "SPARK_MASTER_OPTS", "SPARK_WORKER_OPTS", "SPARK_DAEMON_JAVA_OPTS"):
            env.pop(name, None)  # the installed pyspark's own home, none of the machine's settings
        env.update(SPARK_CONF_DIR=str(conf), SPARK_LOCAL_IP="127.0.0.1", SPARK_DAEMON_MEMORY=self.daemon_memory,
                   SPARK_LOG_DIR=str(self.workdir), SPARK_PID_DIR=str(self.workdir), **extra)
        return env

    def _spawn(self, cls: str, args: list[str], log: Path, **env: str) -> subprocess.Popen[bytes]:
        cmd = ["bash", str(spark_class()), cls, "--host", "127.0.0.1", "--port", "0", "--webui-port", "0", *args]
        proc = spawn_jvm(cmd, cwd=self.workdir, env=self._env(**env), stdout_path=log)
        self._procs.append(proc)
        return proc

    def _wait_for(self, proc: subprocess.Popen[bytes], log: Path, pattern: re.Pattern[bytes], what: str,
                  deadline: float) -> re.Match[bytes]:
        wake = threading.Event()
        while True:
            m = pattern.search(read_bytes(log))
            if m:
                return m
            if proc.poll() is not None:
                raise ClusterError(f"the Spark {what} exited ({proc.returncode}) before it was up; "
                                   f"its log {log} ends:\n{file_tail(log)}")
            if time.monotonic() > deadline:
                raise ClusterError(f"the Spark {what} was not up within {self.start_timeout:.0f} s "
                                   f"(a loaded machine? raise start_timeout); its log {log} ends:\n{file_tail(log)}")
            wake.wait(0.2)  # a log line is the only sign the daemon gives: look again shortly

    def start(self) -> StandaloneCluster:
        """Start the Master, then the Worker, and wait until the Worker registered."""
        if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
            raise ToolMissingError("java is not on PATH and JAVA_HOME is unset: Spark needs Java 17 or 21")
        self.workdir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.start_timeout
        try:
            master = self._spawn(MASTER_CLASS, [], self.master_log,
                                 SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false")
            m = self._wait_for(master, self.master_log, _MASTER_URL, "master", deadline)
            self.master_url = m.group(1).decode()
            work = self.workdir / "work"
            work.mkdir(exist_ok=True)
            worker = self._spawn(WORKER_CLASS, ["--cores", str(self.cores), "--memory", self.memory,
                                                "--work-dir", str(work), self.master_url], self.worker_log)
            self._wait_for(worker, self.worker_log, _REGISTERED, "worker", deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def client_env(self) -> dict[str, str]:
        """Environment for a driver on this machine: loopback, and executors running this Python."""
        env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
        env.pop("SPARK_HOME", None)
        return env

    def applications(self) -> list[str]:
        """Ids of the applications the Worker launched an executor for (from its log)."""
        return [m.decode() for m in _EXECUTOR.findall(read_bytes(self.worker_log))]

    def stop(self) -> None:
        """TERM both daemons' process groups (worker first), KILL what is left after ``stop_timeout``."""
        procs, self._procs = self._procs[::-1], []
        for p in procs:
            kill_group(p, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                kill_group(p, signal.SIGKILL)
                p.wait()

    def __enter__(self) -> StandaloneCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
