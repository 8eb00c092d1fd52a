"""Apache RocketMQ Proxy (``rocketmq-proxy`` 5.3.3 from Maven Central) in front of a test cluster.

The benchmarks put it beside rmqfast, in front of the same broker, to compare the two proxies
with the same clients.  It runs in *cluster* mode (a separate JVM that reaches the brokers over
Remoting, as deployed in production), with both of its client listeners on loopback ports leased
from :mod:`rmqfast.testing.ports`:

* ``remoting_port`` (``remotingListenPort``): RocketMQ 4.x/5.x Remoting clients use it as their
  *name server* address; the proxy answers route requests with its own address
  (``remotingAccessAddr``), so every later request of the client goes to it as well;
* ``grpc_port`` (``grpcServerPort``): the ``apache.rocketmq.v2.MessagingService`` gRPC API of
  the 5.x clients.

Configuration (``ProxyConfig``, read as JSON from ``-pc FILE``; ``-pm cluster -n NAMESRV`` on
the command line win over the file): ``rocketMQClusterName`` names the cluster the proxy routes
to, ``localServeAddr``/``remotingAccessAddr`` are pinned to 127.0.0.1 (by default the proxy
publishes the machine's first non-loopback address to its clients).

JVM: a 1 GB heap with the serial collector, like the test broker (Apache's ``runserver.sh`` asks
for 4 GB and G1, sized for a dedicated host; on this 2-core machine the proxy's allocation rate
makes young collections rare and short either way), C2 enabled unless ``fast_start``.  The
proxy's own thread pools keep Apache's defaults (``ProxyConfig``).

Two properties of 5.3.3 matter when benchmarking it:

* ``RemotingProtocolServer``'s constructor registers its Remoting processors *before* it creates
  their executors, so every Remoting request (sends, pulls, heartbeats, routes) runs on the
  remoting server's 4-thread ``NettyServerPublicExecutor`` and ``remotingSendMessageThreadPoolNums``
  and the other ``remoting*ThreadPoolNums`` settings have no effect (fixed upstream after 5.3.3,
  apache/rocketmq#8233).  Sends are forwarded asynchronously, so 4 threads are not a send limit;
  no configuration changes it;
* ``AbstractRemotingActivity.writeResponse`` drops a response, silently, when the client's channel
  is not writable, i.e. when more than Netty's default high water mark (64 KiB) is waiting to be
  written to it.  A push consumer pulling 8 queues in batches of 32 x 1 KiB gets several ~36 KB
  responses at once: with the default marks most are dropped and the consumer waits for its 30 s
  pull timeout (101 msg/s consumed, the proxy idle).  The harness raises the marks
  (``write_buffer_water_mark``, 4 MiB / 2 MiB by default, ``-Dcom.rocketmq.remoting.write.buffer.
  {high,low}.water.mark``, read by ``NettySystemConfig`` for every Remoting server and client of
  the JVM) so that the Remoting channel to a client behaves as it does for the broker's own
  consumers; ``None`` keeps Netty's defaults;
* a fresh proxy runs its send path interpreted or C1-compiled; measured from cold on a loaded
  machine it gave 650 msg/s and then 1,900 and 2,800 msg/s in the following runs (16 threads of
  sync sends): benchmarks warm it up first (``rmqfast bench --real`` does).

On a loaded machine its startup can fail when the name server answers a route request after the
client's 3 s timeout (``create system broadcast topic ... failed``); :meth:`ApacheProxy.start`
then starts it again, like after a lost port.

The jars are built once by Maven from ``java/apacheproxy/pom.xml`` (not part of ``java/pom.xml``,
so the other tests never download it) into ``java/apacheproxy/target/lib``.

Typical use::

    with RocketMQCluster() as cluster, ApacheProxy(cluster.namesrv_addr,
                                                   cluster_name=cluster.cluster_name) as apx:
        run_driver("produce", apx.remoting_addr, topic="T", count=10)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from rmqfast.testing.errors import ClusterError, HarnessError
from rmqfast.testing.jvm import jvm_module_opts, kill_group, spawn_jvm
from rmqfast.testing.logtail import file_tail, read_bytes
from rmqfast.testing.maven import DEFAULT_JAVA_DIR, ROCKETMQ_VERSION, _build_lock, _has_jars, _inputs_digest, _run_maven
from rmqfast.testing.ports import CLUSTER_RANGE, PortLease, PortsUnavailable, is_bind_error, reserve
from rmqfast.testing.tools import java_executable

__all__ = ["APACHE_PROXY_VERSION", "ApacheProxy", "ensure_apache_proxy_jars"]

APACHE_PROXY_VERSION = ROCKETMQ_VERSION
"""Version of ``org.apache.rocketmq:rocketmq-proxy`` (java/apacheproxy/pom.xml)."""

MAIN_CLASS = "org.apache.rocketmq.proxy.ProxyStartup"
_STARTED = b"rocketmq-proxy startup successfully"
_STARTUP_TIMEOUT = "create system broadcast topic"
"""Its startup's exit when a name server request timed out on a loaded machine: worth another start."""

_LOGBACK_XML = """<?xml version="1.0" encoding="UTF-8"?>
<!-- written by rmqfast.testing.apacheproxy: one plain log file -->
<configuration>
  <appender name="FILE" class="ch.qos.logback.core.FileAppender">
    <file>${rmqfast.log.file}</file>
    <append>true</append>
    <encoder><pattern>%d{yyyy-MM-dd HH:mm:ss.SSS} %-5p [%t] %c{0} - %m%n</pattern></encoder>
  </appender>
  <root level="WARN"><appender-ref ref="FILE"/></root>
  <logger name="RocketmqProxy" level="INFO"/>
</configuration>
"""


def ensure_apache_proxy_jars(java_dir: Path | None = None, *, timeout: float = 1800.0) -> Path:
    """The folder of ``rocketmq-proxy`` and its runtime dependencies, built by Maven unless already
    built from the same pom (first build: ~100 MB from Maven Central)."""
    jd = (java_dir or Path(os.environ.get("RMQFAST_JAVA_DIR", DEFAULT_JAVA_DIR))).resolve()
    pom = jd / "apacheproxy" / "pom.xml"
    if not pom.is_file():
        raise HarnessError(f"{pom} is missing: is this the rmqfast repository's java/ dir?")
    java_executable()  # fail early with a clear message
    lib = jd / "apacheproxy" / "target" / "lib"
    with _build_lock(jd):
        stamp = jd / "apacheproxy" / "target" / "rmqfast-inputs.sha256"
        digest = _inputs_digest([pom])
        if not _has_jars(lib) or not stamp.is_file() or stamp.read_text() != digest:
            shutil.rmtree(lib, ignore_errors=True)
            stamp.unlink(missing_ok=True)
            _run_maven(["-q", "-f", str(pom), "package"], jd, timeout)
            stamp.write_text(digest)
    return lib


class ApacheProxy:
    """One Apache RocketMQ Proxy JVM (cluster mode) on 127.0.0.1; a context manager.

    ``fast_start`` runs the JVM with C1 only (faster startup, lower peak throughput): keep it for
    tests, pass ``False`` for benchmarks.  ``config`` entries are added to ``rmq-proxy.json``.
    ``write_buffer_water_mark`` is (high, low) in bytes for its Netty channels (see the module text).
    """

    bind_attempts = 5

    def __init__(
        self,
        namesrv_addr: str,
        *,
        cluster_name: str = "RmqFastCluster",
        heap_mb: int = 512,
        fast_start: bool = True,
        start_timeout: float = 120.0,
        config: dict[str, object] | None = None,
        write_buffer_water_mark: tuple[int, int] | None = (4 << 20, 2 << 20),
        jvm_opts: Sequence[str] = (),
        java_dir: Path | None = None,
    ) -> None:
        self.namesrv_addr = namesrv_addr
        self.cluster_name = cluster_name
        self.heap_mb = heap_mb
        self.fast_start = fast_start
        self.start_timeout = start_timeout
        self.extra_config = dict(config or {})
        self.write_buffer_water_mark = write_buffer_water_mark
        self.jvm_opts = list(jvm_opts)
        self.java_dir = java_dir
        self.workdir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._lease: PortLease | None = None
        self.remoting_port = 0
        self.grpc_port = 0

    # ------------------------------------------------------------ addresses

    @property
    def remoting_addr(self) -> str:
        """``127.0.0.1:PORT`` of the Remoting listener: the *name server* address for Remoting clients."""
        return f"127.0.0.1:{self.remoting_port}"

    @property
    def grpc_addr(self) -> str:
        """``127.0.0.1:PORT`` of the gRPC listener (``apache.rocketmq.v2.MessagingService``)."""
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self.pid is not None

    @property
    def stdout_path(self) -> Path:
        assert self.workdir is not None, "not started"
        return self.workdir / "proxy.out"

    @property
    def log_path(self) -> Path:
        assert self.workdir is not None, "not started"
        return self.workdir / "proxy.log"

    def __repr__(self) -> str:
        return f"<ApacheProxy remoting={self.remoting_addr} grpc={self.grpc_addr} running={self.running}>"

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> ApacheProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> ApacheProxy:
        """Builds the jars if needed, starts the JVM, waits until both listeners accept."""
        if self._proc is not None:
            raise ClusterError("Apache proxy already started")
        lib = ensure_apache_proxy_jars(self.java_dir)
        self.workdir = Path(tempfile.mkdtemp(prefix="rmqfast-apacheproxy-"))
        try:
            for attempt in range(self.bind_attempts):
                try:
                    self._lease = reserve([0, 1], CLUSTER_RANGE)
                except PortsUnavailable as exc:
                    raise ClusterError(str(exc)) from None
                self.remoting_port, self.grpc_port = self._lease.ports
                self._write_files()
                self._proc = spawn_jvm(self._command(lib), cwd=self.workdir, env=self._env(),
                                       stdout_path=self.stdout_path)
                try:
                    self._wait_ready(time.monotonic() + self.start_timeout)
                    return self
                except _BindFailed:
                    self._kill()
                    if attempt == self.bind_attempts - 1:
                        raise
            return self
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Kills the JVM (process group), releases the ports, removes the work dir. Idempotent."""
        self._kill()
        if self.workdir is not None and os.environ.get("RMQFAST_KEEP_CLUSTER") != "1":
            shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir = None

    def _kill(self) -> None:
        if self._proc is not None:
            kill_group(self._proc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=15)
            self._proc = None
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    # ------------------------------------------------------------ files / command

    def proxy_config(self) -> dict[str, object]:
        """The ``rmq-proxy.json`` this proxy runs with."""
        conf: dict[str, object] = {
            "rocketMQClusterName": self.cluster_name,
            "proxyClusterName": self.cluster_name,
            "proxyMode": "cluster",
            "namesrvAddr": self.namesrv_addr,
            "remotingListenPort": self.remoting_port,
            "grpcServerPort": self.grpc_port,
            "localServeAddr": "127.0.0.1",
            "remotingAccessAddr": "127.0.0.1",
            # a jstack of every pool each minute, and pool status every 3 s, are log noise here
            "enablePrintJstack": False,
            "printThreadPoolStatusInMillis": 3_600_000,
        }
        conf.update(self.extra_config)
        return conf

    def _write_files(self) -> None:
        wd = self.workdir
        assert wd is not None
        for d in ("home/conf", "classpath", "user-home", "logs"):
            (wd / d).mkdir(parents=True, exist_ok=True)
        (wd / "classpath" / "rmq.logback-test.xml").write_text(_LOGBACK_XML)
        text = json.dumps(self.proxy_config(), indent=2)
        (wd / "home" / "conf" / "rmq-proxy.json").write_text(text)

    def _command(self, lib: Path) -> list[str]:
        wd = self.workdir
        assert wd is not None
        cmd = [
            java_executable(), "-server", f"-Xms{self.heap_mb}m", f"-Xmx{self.heap_mb}m",
            "-XX:MaxDirectMemorySize=256m", "-XX:+UseSerialGC", "-XX:-OmitStackTraceInFastThrow", "-Xss512k",
            "-Dfile.encoding=UTF-8", "-Dtls.server.mode=disabled",
            f"-Duser.home={wd / 'user-home'}", f"-Drmqfast.log.file={self.log_path}",
            f"-Drocketmq.client.logRoot={wd / 'logs'}", f"-Drocketmq.log.root={wd / 'logs'}",
            *jvm_module_opts(),
        ]
        if self.fast_start:
            cmd.append("-XX:TieredStopAtLevel=1")
        if self.write_buffer_water_mark is not None:
            high, low = self.write_buffer_water_mark
            cmd += [f"-Dcom.rocketmq.remoting.write.buffer.high.water.mark={high}",
                    f"-Dcom.rocketmq.remoting.write.buffer.low.water.mark={low}"]
        cmd += self.jvm_opts
        cmd += ["-cp", f"{wd / 'classpath'}{os.pathsep}{lib}/*", MAIN_CLASS,
                "-pc", str(wd / "home" / "conf" / "rmq-proxy.json"), "-pm", "cluster", "-n", self.namesrv_addr]
        return cmd

    def _env(self) -> dict[str, str]:
        assert self.workdir is not None
        env = dict(os.environ)
        env["RMQ_PROXY_HOME"] = str(self.workdir / "home")
        env["ROCKETMQ_HOME"] = str(self.workdir / "home")
        env.pop("JAVA_TOOL_OPTIONS", None)
        return env

    # ------------------------------------------------------------ readiness

    def _wait_ready(self, deadline: float) -> None:
        assert self._proc is not None
        while True:
            rc = self._proc.poll()
            if rc is not None:
                out = file_tail(self.stdout_path, 80)
                if is_bind_error(out) or _STARTUP_TIMEOUT in out:
                    raise _BindFailed(out)
                raise ClusterError(f"the Apache RocketMQ proxy exited with code {rc} during startup\n{self.log_tail()}")
            if _STARTED in read_bytes(self.stdout_path) and _accepts(self.remoting_port) and _accepts(self.grpc_port):
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"the Apache RocketMQ proxy did not start within {self.start_timeout:.0f} s\n"
                                   f"{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self, lines: int = 40) -> str:
        """Tails of the JVM's stdout and log file, for error messages."""
        if self.workdir is None:
            return "<not started>"
        parts = []
        for p in (self.stdout_path, self.log_path):
            if p.exists():
                text = "\n".join(x for x in file_tail(p, lines).splitlines() if "|-INFO in " not in x)
                parts.append(f"----- {p.name} (last {lines} lines) -----\n{text}")
        return "\n".join(parts)


class _BindFailed(ClusterError):
    """The JVM could not bind a port it was given (another program took it after the lease), or its
    startup timed out on a name server request: a new start may succeed."""


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False
