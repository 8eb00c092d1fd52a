"""A throw-away Apache RocketMQ cluster (one name server, one broker) on loopback, for tests.

The jars come from Maven Central through ``mvn`` (:mod:`rmqfast.testing.maven`); the JVMs
are started and killed by :mod:`rmqfast.testing.jvm`; admin requests go through
:mod:`rmqfast.testing.remoting`; ports are leased from :mod:`rmqfast.testing.ports`.

Typical use::

    jars = ensure_jars()
    with RocketMQCluster(jars=jars) as cluster:
        cluster.create_topic("T", queues=4)        # optional: autoCreateTopicEnable is on
        ... cluster.namesrv_addr, cluster.broker_addr ...

Facts about the broker this module relies on (RocketMQ 5.3.3 and 4.9.4, Java 17):

* A broker with ``listenPort=P`` also listens on ``P-2`` (the "VIP"/fast channel) and ``P+1``
  (HA); all three must be free. The name server listens on one port.
* The broker registers with the name server right after boot only if the name server is already
  up *and* (5.x) its name-server availability scan has run; otherwise the first registration
  waits for the 10 s periodic one. So the name server is started first, and if the broker has not
  registered ~1 s after "boot success" it is sent UPDATE_BROKER_CONFIG ``brokerPermission=6``
  (unchanged value), which makes it register at once. Side effect: the broker rewrites
  ``broker.conf`` with its full configuration (same values).
* The 5.x client's DefaultLitePullConsumer pulls with LITE_PULL_MESSAGE (361), which a 4.9.x
  broker rejects; push consumers use PULL_MESSAGE (11) with both.
* 5.x creates a self-signed TLS context at startup (~3 s on 2 cores) unless
  ``-Dtls.server.mode=disabled``; we disable it (clients don't use TLS by default).
* 5.x picks its logback config from the classpath (``rmq.logback-test.xml`` first), 4.x from
  ``$ROCKETMQ_HOME/conf/logback_{namesrv,broker}.xml``; we provide both, writing one log file per
  JVM into the work dir.
* 5.x batches transaction "op" records every ``transactionOpBatchInterval`` (3 s default); with a
  short ``transactionTimeOut`` that makes the broker check back committed messages too, so the
  interval is lowered here.
* ``acl=True`` (5.x only) turns on ACL 2.0 authentication and authorization with the local
  (RocksDB) user and ACL stores; :attr:`RocketMQCluster.ADMIN` is the super user created at boot
  (``initAuthenticationUser``), every admin request of this module is signed with it, users and
  ACLs are created with :meth:`RocketMQCluster.create_user` / :meth:`RocketMQCluster.grant`,
  and ``mqadmin`` signs with the credentials in ``$ROCKETMQ_HOME/conf/tools.yml``.  A normal
  user without ACL entries may do nothing; the name server (5.3.x) checks no ACL.
* A graceful broker shutdown (SIGTERM) takes 10-15 s (service joins); :meth:`stop_broker`
  kills by default, which RocketMQ recovers from on restart (the mmapped commit log survives a
  process kill).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from rmqfast.codec.codes import (
    GET_BROKER_CLUSTER_INFO,
    GET_ROUTEINFO_BY_TOPIC,
    SUCCESS,
    TOPIC_NOT_EXIST,
    UPDATE_AND_CREATE_TOPIC,
    UPDATE_BROKER_CONFIG,
)
from rmqfast.testing.errors import ClusterError, HarnessError, ToolMissingError
from rmqfast.testing.jvm import jvm_module_opts, kill_group, spawn_jvm
from rmqfast.testing.logtail import file_tail, read_bytes
from rmqfast.testing.maven import BrokerVersion, JarPaths, ensure_jars
from rmqfast.testing.ports import CLUSTER_RANGE, PortLease, PortsUnavailable, reserve
from rmqfast.testing.remoting import remoting_request
from rmqfast.testing.tools import java_executable

# The cluster, and the names older code imported from this module before the harness was split
# (errors, jars, the Remoting client): they stay importable from here.
__all__ = ["ClusterError", "HarnessError", "JarPaths", "RocketMQCluster", "ToolMissingError", "ensure_jars",
           "remoting_request"]


def _pick_ports() -> tuple[PortLease, int, int]:
    """(lease, namesrv port, broker listen port P) with P-2, P and P+1 reserved too.

    Reserved below the ephemeral range (32768+), so outgoing connections made while the JVMs
    start cannot take them, and locked (:mod:`rmqfast.testing.ports`) against every other
    cluster and proxy our tests start, in this process or another.  A JVM that still cannot
    bind (another program took a port) is a :class:`_PortClash`: ``start`` retries on new ports.
    """
    try:
        lease = reserve([0, 2, 4, 5], CLUSTER_RANGE)  # ns; P-2, P, P+1 with P = base + 4
    except PortsUnavailable as exc:
        raise ClusterError(str(exc)) from None
    return lease, lease.base, lease.base + 4




# ACL 2.0 admin request codes (RequestCode in apache/rocketmq 5.3)
AUTH_CREATE_USER = 3001
AUTH_CREATE_ACL = 3006
AUTH_UPDATE_ACL = 3007

_LOGBACK_XML = """<?xml version="1.0" encoding="UTF-8"?>
<!-- written by rmqfast.testing.cluster: one plain log file per JVM -->
<configuration>
  <appender name="FILE" class="ch.qos.logback.core.FileAppender">
    <file>${rmqfast.log.file}</file>
    <append>true</append>
    <encoder>
      <pattern>%d{yyyy-MM-dd HH:mm:ss.SSS} %-5p [%t] %c{0} - %m%n</pattern>
    </encoder>
  </appender>
  <root level="INFO"><appender-ref ref="FILE"/></root>
</configuration>
"""


_cluster_ids = itertools.count(1)


def _conf_value(v: object) -> str:
    if v is True:
        return "true"
    if v is False:
        return "false"
    return str(v)


class RocketMQCluster:
    """One real name server + one real broker on 127.0.0.1, in a temporary work dir.

    Use as a context manager (or :meth:`start` / :meth:`stop`). On exit both JVMs are killed
    (process groups) and the work dir is removed, unless ``keep_workdir=True`` or the environment
    has ``RMQFAST_KEEP_CLUSTER=1``.

    ``broker_conf`` entries override/extend the generated ``broker.conf`` (values: str, int, bool).
    ``fast_start`` runs the JVMs with C1 only (-XX:TieredStopAtLevel=1): faster startup, lower
    peak throughput; pass ``False`` for benchmarks.
    """

    def __init__(
        self,
        *,
        version: BrokerVersion = "5",
        jars: JarPaths | None = None,
        workdir: Path | str | None = None,
        keep_workdir: bool = False,
        cluster_name: str = "RmqFastCluster",
        broker_name: str = "broker-a",
        broker_heap_mb: int = 256,
        namesrv_heap_mb: int = 128,
        broker_conf: Mapping[str, object] | None = None,
        jvm_opts: Sequence[str] = (),
        fast_start: bool = True,
        start_timeout: float = 90.0,
        acl: bool = False,
        join: RocketMQCluster | None = None,
    ) -> None:
        if version not in ("5", "4"):
            raise ValueError(f"version must be '5' or '4', not {version!r}")
        if acl and version != "5":
            raise ValueError("acl=True needs a 5.x broker (ACL 2.0); 4.9.x plain ACL is not set up here")
        self.acl = acl
        #: another cluster whose name server this one's broker registers with (no name server of its own):
        #: two masters (distinct ``broker_name``) of one cluster, e.g. for failover tests
        self.join = join
        self.version: BrokerVersion = version
        self._jars = jars
        self._workdir_arg = Path(workdir) if workdir is not None else None
        self.keep_workdir = keep_workdir or os.environ.get("RMQFAST_KEEP_CLUSTER") == "1"
        self.cluster_name = cluster_name
        self.broker_name = broker_name
        self.broker_heap_mb = broker_heap_mb
        self.namesrv_heap_mb = namesrv_heap_mb
        self.extra_broker_conf = dict(broker_conf or {})
        self.jvm_opts = list(jvm_opts)
        self.fast_start = fast_start
        self.start_timeout = start_timeout
        self._id = next(_cluster_ids)
        self._workdir: Path | None = None
        self._owns_workdir = False
        self._namesrv: subprocess.Popen[bytes] | None = None
        self._broker: subprocess.Popen[bytes] | None = None
        self._ns_port = 0
        self._broker_port = 0
        self._ports_lease: PortLease | None = None

    #: The ACL 2.0 super user created at boot when ``acl=True`` (access key, secret key).
    ADMIN: tuple[str, str] = ("rmqfast-admin", "rmqfast-admin-secret")

    @property
    def _admin_credentials(self) -> tuple[str, str] | None:
        return self.ADMIN if self.acl else None

    # ------------------------------------------------------------ addresses / paths

    @property
    def namesrv_port(self) -> int:
        return self._ns_port

    @property
    def namesrv_addr(self) -> str:
        """``127.0.0.1:PORT`` of the name server (the joined cluster's, with ``join``)."""
        if self.join is not None:
            return self.join.namesrv_addr
        return f"127.0.0.1:{self._ns_port}"

    @property
    def broker_port(self) -> int:
        return self._broker_port

    @property
    def broker_addr(self) -> str:
        """``127.0.0.1:P``: the address the broker registers with the name server."""
        return f"127.0.0.1:{self._broker_port}"

    @property
    def broker_vip_addr(self) -> str:
        """``127.0.0.1:P-2``: the broker's fast ("VIP") channel, used by clients with vipChannel."""
        return f"127.0.0.1:{self._broker_port - 2}"

    @property
    def broker_ha_port(self) -> int:
        return self._broker_port + 1

    @property
    def ports(self) -> tuple[int, ...]:
        """Every port this cluster listens on."""
        p = self._broker_port
        return (self._ns_port, p - 2, p, p + 1)

    @property
    def workdir(self) -> Path:
        if self._workdir is None:
            raise ClusterError("cluster not started")
        return self._workdir

    @property
    def store_dir(self) -> Path:
        return self.workdir / "store"

    @property
    def log_dir(self) -> Path:
        return self.workdir / "logs"

    @property
    def namesrv_log(self) -> Path:
        return self.log_dir / "namesrv.log"

    @property
    def broker_log(self) -> Path:
        return self.log_dir / "broker.log"

    @property
    def namesrv_stdout(self) -> Path:
        return self.log_dir / "namesrv.out"

    @property
    def broker_stdout(self) -> Path:
        return self.log_dir / "broker.out"

    @property
    def broker_conf_path(self) -> Path:
        return self.workdir / "broker.conf"

    @property
    def jars(self) -> JarPaths:
        if self._jars is None:
            self._jars = ensure_jars(rocketmq4=self.version == "4")
        return self._jars

    @property
    def broker_running(self) -> bool:
        return self._broker is not None and self._broker.poll() is None

    @property
    def namesrv_running(self) -> bool:
        if self.join is not None:
            return self.join.namesrv_running
        return self._namesrv is not None and self._namesrv.poll() is None

    @property
    def broker_pid(self) -> int | None:
        return self._broker.pid if self.broker_running and self._broker else None

    @property
    def namesrv_pid(self) -> int | None:
        return self._namesrv.pid if self.namesrv_running and self._namesrv else None

    def __repr__(self) -> str:
        return (
            f"<RocketMQCluster v{self.version} namesrv={self.namesrv_addr} "
            f"broker={self.broker_addr} running={self.broker_running}>"
        )

    # ------------------------------------------------------------ lifecycle

    def __enter__(self) -> RocketMQCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> RocketMQCluster:
        """Creates the work dir, starts the name server, then the broker; waits until ready."""
        if self._namesrv is not None:
            raise ClusterError("cluster already started")
        jars = self.jars  # may build
        if self.version == "4" and jars.cluster4_lib is None:
            self._jars = jars = ensure_jars(jars.java_dir, rocketmq4=True)
        if self._workdir_arg is not None:
            self._workdir = self._workdir_arg
            self._workdir.mkdir(parents=True, exist_ok=True)
            self._owns_workdir = False
        else:
            self._workdir = Path(tempfile.mkdtemp(prefix=f"rmqfast-cluster{self._id}-"))
            self._owns_workdir = True
        try:
            for attempt in range(5):
                self._ports_lease, self._ns_port, self._broker_port = _pick_ports()
                self._write_files()
                try:
                    if self.join is None:
                        self._start_namesrv()
                    self._start_broker(first=True)
                    return self
                except _PortClash:
                    self._kill_all()
                    self._release_ports()
                    if attempt == 4:
                        raise
                    shutil.rmtree(self.store_dir, ignore_errors=True)
            return self
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Kills both JVMs and removes the work dir (unless kept). Idempotent."""
        self._kill_all()
        self._release_ports()
        if self._workdir is not None and self._owns_workdir and not self.keep_workdir:
            shutil.rmtree(self._workdir, ignore_errors=True)
        self._namesrv = None
        self._broker = None

    def _release_ports(self) -> None:
        if self._ports_lease is not None:
            self._ports_lease.release()
            self._ports_lease = None

    def _kill_all(self) -> None:
        for proc in (self._broker, self._namesrv):
            if proc is not None:
                kill_group(proc)
        for proc in (self._broker, self._namesrv):
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=15)

    def stop_broker(self, *, graceful: bool = False, timeout: float = 30.0) -> None:
        """Stops the broker, keeping its store. ``graceful`` sends SIGTERM first (slow: 10-15 s)."""
        proc = self._broker
        if proc is None or proc.poll() is not None:
            return
        if graceful:
            kill_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_group(proc)
        else:
            kill_group(proc)
        proc.wait(timeout=15)

    def start_broker(self, timeout: float | None = None) -> None:
        """(Re)starts the broker on the same ports and store; waits until it is registered."""
        self._start_broker(timeout)

    def _start_broker(self, timeout: float | None = None, *, first: bool = False) -> None:
        if self.broker_running:
            raise ClusterError("broker already running")
        if not self.namesrv_running:
            raise ClusterError("the name server is not running")
        deadline = time.monotonic() + (timeout or self.start_timeout)
        for port in (self._broker_port - 2, self._broker_port, self._broker_port + 1):
            if first and not _port_bindable(port):
                # reserved and free a moment ago: another program took it, start() moves on
                raise _PortClash(f"broker port {port} was taken before the broker started")
            # a killed broker's sockets are released at once, but wait a little anyway
            while not _port_bindable(port) and time.monotonic() < deadline:
                time.sleep(0.1)
        self._broker = self._spawn("broker")
        self._wait_broker_ready(deadline)

    def stop_namesrv(self) -> None:
        """Kills the name server (the broker keeps running and retries registration)."""
        if self._namesrv is not None and self._namesrv.poll() is None:
            kill_group(self._namesrv)
            self._namesrv.wait(timeout=15)

    def start_namesrv(self, timeout: float | None = None) -> None:
        """(Re)starts the name server on the same port; the broker re-registers within ~10 s."""
        if self.namesrv_running:
            raise ClusterError("name server already running")
        self._start_namesrv(timeout)

    # ------------------------------------------------------------ readiness

    def _start_namesrv(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.start_timeout)
        self._namesrv = self._spawn("namesrv")
        while True:
            self._check_alive(self._namesrv, "name server", self.namesrv_stdout)
            with contextlib.suppress(OSError, ValueError):
                r = remoting_request(self.namesrv_addr, GET_BROKER_CLUSTER_INFO, timeout=2.0)
                if r.code == SUCCESS:
                    return
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"name server at {self.namesrv_addr} not answering after "
                    f"{timeout or self.start_timeout:.0f} s\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def _wait_broker_ready(self, deadline: float) -> None:
        assert self._broker is not None
        booted_at: float | None = None
        last_nudge = 0.0
        while True:
            self._check_alive(self._broker, "broker", self.broker_stdout)
            if self._broker_registered():
                return
            now = time.monotonic()
            if booted_at is None and b"boot success" in read_bytes(self.broker_stdout):
                booted_at = now
            if booted_at is not None and now - booted_at > 1.0 and now - last_nudge > 2.0:
                # 5.x registers at boot only if its name-server availability scan already ran;
                # otherwise it waits for the 10 s periodic registration. Ask it to register now.
                last_nudge = now
                self._nudge_registration()
            if now > deadline:
                raise ClusterError(
                    f"broker {self.broker_addr} not registered with {self.namesrv_addr} in time\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.1)

    def _nudge_registration(self) -> None:
        """UPDATE_BROKER_CONFIG with brokerPermission (unchanged: 6 = read+write) makes the broker
        call registerBrokerAll at once (AdminBrokerProcessor#updateBrokerConfig)."""
        perm = _conf_value(self._broker_conf().get("brokerPermission", 6))
        with contextlib.suppress(OSError, ValueError):
            remoting_request(
                self.broker_addr, UPDATE_BROKER_CONFIG, body=f"brokerPermission={perm}\n".encode(),
                credentials=self._admin_credentials,
            )

    def _broker_registered(self) -> bool:
        try:
            info = remoting_request(self.namesrv_addr, GET_BROKER_CLUSTER_INFO, timeout=2.0)
            if info.code != SUCCESS or self.broker_addr.encode() not in info.body:
                return False
            if not self._auto_create_topics():
                return True
            # clients auto-create topics through TBW102's route: wait until it is published
            return self.topic_route("TBW102") is not None
        except (OSError, ValueError, HarnessError):
            return False

    def _auto_create_topics(self) -> bool:
        return _conf_value(self._broker_conf().get("autoCreateTopicEnable", True)) == "true"

    def _check_alive(self, proc: subprocess.Popen[bytes], what: str, stdout: Path) -> None:
        rc = proc.poll()
        if rc is None:
            return
        out = file_tail(stdout, 80)
        if "Address already in use" in out or "BindException" in out:
            raise _PortClash(f"{what} could not bind its port(s)\n{out}")
        raise ClusterError(f"the {what} exited with code {rc} during startup\n{self.log_tail()}")

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Waits until the broker is registered with the name server (e.g. after restarts)."""
        self._wait_broker_ready(time.monotonic() + timeout)

    # ------------------------------------------------------------ files / commands

    def _broker_conf(self) -> dict[str, object]:
        wd = self.workdir
        conf: dict[str, object] = {
            "brokerClusterName": self.cluster_name,
            "brokerName": self.broker_name,
            "brokerId": 0,
            "brokerRole": "ASYNC_MASTER",
            "brokerIP1": "127.0.0.1",
            "brokerIP2": "127.0.0.1",
            "listenPort": self._broker_port,
            "haListenPort": self._broker_port + 1,
            "namesrvAddr": self.namesrv_addr,
            "storePathRootDir": wd / "store",
            "storePathCommitLog": wd / "store" / "commitlog",
            "autoCreateTopicEnable": True,
            "autoCreateSubscriptionGroup": True,
            "defaultTopicQueueNums": 4,
            "enablePropertyFilter": True,
            "flushDiskType": "ASYNC_FLUSH",
            # small files: tests write little, and sparse 1 GiB files upset some disks
            "mappedFileSizeCommitLog": 32 * 1024 * 1024,
            "mappedFileSizeConsumeQueue": 30000 * 20,
            "maxHashSlotNum": 50000,
            "maxIndexNum": 200000,
            # do not refuse writes on a fullish CI disk (5.x config; 4.x reads system props)
            "diskMaxUsedSpaceRatio": 95,
            "diskSpaceWarningLevelRatio": 98,
            "diskSpaceCleanForciblyRatio": 97,
            # transaction check-back within ~1-2 s of an UNKNOW answer
            "transactionCheckInterval": 500,
            "transactionTimeOut": 1000,
            "transactionOpBatchInterval": 100,
            # tolerate a slow 2-core machine instead of failing fast with "broker busy"
            "waitTimeMillsInSendQueue": 3000,
            "waitTimeMillsInPullQueue": 5000,
            "waitTimeMillsInTransactionQueue": 5000,
            "osPageCacheBusyTimeOutMills": 5000,
        }
        if self.version == "5":
            conf["bindAddress"] = "127.0.0.1"
            conf["mappedFileSizeTimerLog"] = 8 * 1024 * 1024
        if self.acl:
            ak, sk = self.ADMIN
            auth = "org.apache.rocketmq.auth."
            conf.update({
                "authenticationEnabled": True,
                "authorizationEnabled": True,
                "authenticationProvider": auth + "authentication.provider.DefaultAuthenticationProvider",
                "authenticationMetadataProvider": auth + "authentication.provider.LocalAuthenticationMetadataProvider",
                "authorizationProvider": auth + "authorization.provider.DefaultAuthorizationProvider",
                "authorizationMetadataProvider": auth + "authorization.provider.LocalAuthorizationMetadataProvider",
                "initAuthenticationUser": json.dumps({"username": ak, "password": sk}),
                "innerClientAuthenticationCredentials": json.dumps({"accessKey": ak, "secretKey": sk}),
                # users and ACLs are cached 60 s by default: a grant must count at once in tests
                "userCacheRefreshSecond": 1,
                "aclCacheRefreshSecond": 1,
                "statefulAuthenticationCacheExpiredSecond": 1,
                "statefulAuthorizationCacheExpiredSecond": 1,
            })
        conf.update(self.extra_broker_conf)
        return conf

    def _write_files(self) -> None:
        wd = self.workdir
        dirs = ("home/conf", "logs", "store", "conf/namesrv", "conf/broker", "home-ns", "home-br")
        for d in dirs:
            (wd / d).mkdir(parents=True, exist_ok=True)
        # 5.x: first rmq.logback-test.xml on the classpath wins; 4.x: $ROCKETMQ_HOME/conf
        for d in ("conf/namesrv", "conf/broker"):
            (wd / d / "rmq.logback-test.xml").write_text(_LOGBACK_XML)
        for name in ("logback_namesrv.xml", "logback_broker.xml", "logback_tools.xml"):
            (wd / "home" / "conf" / name).write_text(_LOGBACK_XML)
        if self.acl:  # mqadmin (MQAdminStartup) signs with these
            (wd / "home" / "conf" / "tools.yml").write_text(_tools_yml(*self.ADMIN))
        (wd / "namesrv.conf").write_text(
            f"listenPort={self._ns_port}\n"
            + ("bindAddress=127.0.0.1\n" if self.version == "5" else "")
            + f"kvConfigPath={wd / 'home-ns' / 'kvConfig.json'}\n"
            + f"configStorePath={wd / 'home-ns' / 'namesrv.properties'}\n"
        )
        lines = [f"{k}={_conf_value(v)}" for k, v in self._broker_conf().items()]
        header = "# written by rmqfast.testing.cluster\n"
        self.broker_conf_path.write_text(header + "\n".join(lines) + "\n")

    def _jvm_base(self, heap_mb: int, home: Path, log_file: Path) -> list[str]:
        opts = [
            java_executable(),
            "-server",
            f"-Xms{heap_mb}m",
            f"-Xmx{heap_mb}m",
            f"-Xmn{max(16, heap_mb // 2)}m",
            "-XX:MaxDirectMemorySize=256m",
            "-XX:+UseSerialGC",
            "-XX:-OmitStackTraceInFastThrow",
            "-Xss512k",
            "-Dfile.encoding=UTF-8",
            "-Dtls.server.mode=disabled",
            f"-Duser.home={home}",
            f"-Drmqfast.log.file={log_file}",
            f"-Drocketmq.client.logRoot={self.log_dir}",
            f"-Drocketmq.log.root={self.log_dir}",
            "-Drocketmq.broker.diskSpaceWarningLevelRatio=0.98",
            "-Drocketmq.broker.diskSpaceCleanForciblyRatio=0.97",
            *jvm_module_opts(),
        ]
        if self.fast_start:
            opts.append("-XX:TieredStopAtLevel=1")
        return opts + self.jvm_opts

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["ROCKETMQ_HOME"] = str(self.workdir / "home")
        env.pop("JAVA_TOOL_OPTIONS", None)
        return env

    def _spawn(self, role: Literal["namesrv", "broker"]) -> subprocess.Popen[bytes]:
        wd = self.workdir
        cp = self.jars.cluster_classpath(self.version)
        if role == "namesrv":
            cmd = self._jvm_base(self.namesrv_heap_mb, wd / "home-ns", self.namesrv_log) + [
                "-cp",
                f"{wd / 'conf' / 'namesrv'}{os.pathsep}{cp}",
                "org.apache.rocketmq.namesrv.NamesrvStartup",
                "-c",
                str(wd / "namesrv.conf"),
            ]
            out = self.namesrv_stdout
        else:
            cmd = self._jvm_base(self.broker_heap_mb, wd / "home-br", self.broker_log) + [
                "-cp",
                f"{wd / 'conf' / 'broker'}{os.pathsep}{cp}",
                "org.apache.rocketmq.broker.BrokerStartup",
                "-c",
                str(self.broker_conf_path),
            ]
            out = self.broker_stdout
        return spawn_jvm(cmd, cwd=wd, env=self._env(), stdout_path=out)

    def log_tail(self, lines: int = 40) -> str:
        """Tails of the JVM stdout files and logs, for error messages."""
        if self._workdir is None:
            return "<no work dir>"
        parts = []
        for p in (self.namesrv_stdout, self.namesrv_log, self.broker_stdout, self.broker_log):
            if p.exists():
                text = file_tail(p, lines)
                # 5.x prints logback's status lines on stdout: not interesting
                text = "\n".join(x for x in text.splitlines() if "|-INFO in " not in x)
                parts.append(f"----- {p.name} (last {lines} lines) -----\n{text}")
        return "\n".join(parts)

    # ------------------------------------------------------------ admin

    def cluster_info(self) -> bytes:
        """Raw GET_BROKER_CLUSTER_INFO body (fastjson: integer map keys, so not strict JSON)."""
        r = remoting_request(self.namesrv_addr, GET_BROKER_CLUSTER_INFO)
        if r.code != SUCCESS:
            raise ClusterError(f"GET_BROKER_CLUSTER_INFO failed: {r.code} {r.remark}")
        return r.body

    def topic_route(self, topic: str) -> dict[str, object] | None:
        """The name server's route for ``topic`` (parsed JSON), or None if it has none."""
        r = remoting_request(self.namesrv_addr, GET_ROUTEINFO_BY_TOPIC, {"topic": topic})
        if r.code == TOPIC_NOT_EXIST:
            return None
        if r.code != SUCCESS:
            raise ClusterError(f"GET_ROUTEINFO_BY_TOPIC {topic} failed: {r.code} {r.remark}")
        text = r.body.decode("utf-8", "replace")
        try:
            parsed: dict[str, object] = json.loads(text)
        except ValueError:
            # fastjson may write bare integer keys ({0:"addr"}): quote them and retry
            parsed = json.loads(re.sub(r"([{,])(\d+):", r'\1"\2":', text))
        return parsed

    def create_topic(
        self,
        topic: str,
        queues: int = 4,
        *,
        order: bool = False,
        perm: int = 6,
        timeout: float = 15.0,
    ) -> None:
        """Creates/updates ``topic`` on the broker (UPDATE_AND_CREATE_TOPIC, directly to the broker)
        and waits until the name server publishes a route with ``queues`` write queues."""
        r = remoting_request(
            self.broker_addr,
            UPDATE_AND_CREATE_TOPIC,
            {
                "topic": topic,
                "defaultTopic": "TBW102",
                "readQueueNums": queues,
                "writeQueueNums": queues,
                "perm": perm,
                "topicFilterType": "SINGLE_TAG",
                "topicSysFlag": 0,
                "order": order,
            },
            timeout=timeout,
            credentials=self._admin_credentials,
        )
        if r.code != SUCCESS:
            raise ClusterError(f"creating topic {topic} failed: code {r.code} {r.remark}")
        deadline = time.monotonic() + timeout
        while True:
            route = self.topic_route(topic)
            if route is not None:
                qds = route.get("queueDatas")
                if isinstance(qds, list) and any(
                    isinstance(q, dict) and q.get("writeQueueNums") == queues for q in qds
                ):
                    return
            if time.monotonic() > deadline:
                raise ClusterError(f"topic {topic} created but no route with {queues} queues yet")
            time.sleep(0.1)

    def create_user(self, username: str, password: str, user_type: str = "Normal") -> None:
        """ACL 2.0: creates a user (AUTH_CREATE_USER, signed by :attr:`ADMIN`)."""
        body = json.dumps({"username": username, "password": password, "userType": user_type}).encode()
        r = remoting_request(self.broker_addr, AUTH_CREATE_USER, {"username": username}, body,
                             credentials=self._admin_credentials, timeout=15.0)
        if r.code != SUCCESS:
            raise ClusterError(f"creating user {username} failed: code {r.code} {r.remark}")

    def grant(self, username: str, resources: Sequence[str], actions: Sequence[str] = ("Pub", "Sub"),
              decision: str = "Allow") -> None:
        """ACL 2.0: ``username`` may do ``actions`` on ``resources`` ("Topic:T", "Group:G", "Topic:*",
        "Topic:Order*"...): AUTH_CREATE_ACL (AUTH_UPDATE_ACL when the user has an ACL already)."""
        subject = f"User:{username}"
        acl = {"subject": subject, "policies": [{"policyType": "Custom", "entries": [
            {"resource": r, "actions": list(actions), "decision": decision} for r in resources]}]}
        body = json.dumps(acl).encode()
        for code in (AUTH_CREATE_ACL, AUTH_UPDATE_ACL):
            r = remoting_request(self.broker_addr, code, {"subject": subject}, body,
                                 credentials=self._admin_credentials, timeout=15.0)
            if r.code == SUCCESS:
                return
        raise ClusterError(f"granting {list(actions)} on {list(resources)} to {username} failed: "
                           f"code {r.code} {r.remark}")

    def mqadmin(self, *args: str, timeout: float = 120.0, credentials: tuple[str, str] | None = None) -> str:
        """Runs ``org.apache.rocketmq.tools.command.MQAdminStartup`` (mqadmin) with ``args``
        against this cluster, e.g. ``cluster.mqadmin("topicList", "-n", cluster.namesrv_addr)``.
        Returns its stdout; raises ClusterError on a non-zero exit. Takes ~3-5 s (a JVM).

        With ``acl=True`` it signs as :attr:`ADMIN`, or with ``credentials`` when given."""
        cp = self.jars.cluster_classpath(self.version)
        env = self._env()
        if credentials is not None:
            home = Path(tempfile.mkdtemp(prefix="mqadmin-", dir=self.workdir))
            (home / "conf").mkdir()
            (home / "conf" / "tools.yml").write_text(_tools_yml(*credentials))
            for name in ("logback_tools.xml",):
                (home / "conf" / name).write_text(_LOGBACK_XML)
            env["ROCKETMQ_HOME"] = str(home)
        cmd = self._jvm_base(128, self.workdir / "home-br", self.log_dir / "tools.log") + [
            "-cp",
            f"{self.workdir / 'conf' / 'namesrv'}{os.pathsep}{cp}",
            "org.apache.rocketmq.tools.command.MQAdminStartup",
            *args,
        ]
        proc = subprocess.run(
            cmd,
            cwd=self.workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        out = proc.stdout.decode("utf-8", "replace")
        out = "\n".join(x for x in out.splitlines() if not re.search(r"\|-(INFO|WARN) in ", x))
        if proc.returncode != 0:
            raise ClusterError(
                f"mqadmin {' '.join(args)} exited {proc.returncode}\n{out}\n"
                f"{proc.stderr.decode('utf-8', 'replace')[-4000:]}"
            )
        return out


def _tools_yml(access_key: str, secret_key: str) -> str:
    return f"accessKey: {json.dumps(access_key)}\nsecretKey: {json.dumps(secret_key)}\n"


class _PortClash(ClusterError):
    """A JVM could not bind: someone took a port between our check and its bind."""


def _port_bindable(port: int) -> bool:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
        return True
    except OSError:
        return False
    finally:
        s.close()
