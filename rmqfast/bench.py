"""The benchmark: direct vs HAProxy vs rmqfast, side by side, in one run.

``python -m rmqfast.bench [--short]`` (also ``rmqfast bench``, ``make bench``).

What runs
---------
* ``bench/nullbroker.c``: a broker that stores nothing and answers every send, pull and
  heartbeat at once, as a broker would.  It is the ceiling ("direct") and the upstream of the
  proxies.
* ``bench/loadgen.c``: Java-shaped SEND_MESSAGE_V2 (and PULL_MESSAGE) traffic over many
  connections, closed loop (N requests in flight per connection) or open loop (fixed rate,
  latency from the scheduled send time).  It prints one JSON object per run.
* Targets: ``direct`` (loadgen -> nullbroker), ``haproxy`` (``mode tcp``, nbthread 2; full
  mode also ``haproxy-1t``, nbthread 1), ``rmqfast`` (``rmqfast serve``, 2 workers, one static
  broker endpoint, compiled scanner) and ``rmqfast-pure`` (same with
  ``RMQFAST_NO_EXTENSIONS=1``).

The two C tools are compiled with ``gcc -O2`` into ``build/bench/`` on first use (the binary
name carries a hash of the sources and flags, so an edit rebuilds).  HAProxy is Debian's
package, installed with apt-get when missing (``--no-install`` to skip that target instead).

Method: every target is started once and stays up.  Each round runs every scenario against
every target, the target order rotating from one scenario and round to the next, with a
warm-up before each measured window and a pause until the target is idle again after it.
Medians over rounds are reported, with ratios and the issue's targets.  CPU time of the
target's processes (from /proc) is recorded per run, as CPU cores used and CPU microseconds
per request, because on a 2-core machine the load generator, the null broker and the proxy
share the same cores: a proxy that needs less CPU per message leaves more for the rest.

Results: one JSON object per line in ``results/bench/bench-<time>-<commit>.jsonl``:
``kind`` = ``run`` (one loadgen run), ``rss`` (per worker after the run), ``summary``
(medians per scenario and target) and ``check`` (one issue target, met or not).  Every line
carries ``run_id`` and ``machine`` (cpu model, cores, kernel, python and tool versions, git
commit), so a Spark job can read the folder as is.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import IO, Any, Protocol

from rmqfast import __version__
from rmqfast.testing.proxy import ProxyProcess

REPO = Path(__file__).resolve().parent.parent
BENCH_SRC = REPO / "bench"
DEFAULT_BUILD_DIR = REPO / "build" / "bench"
DEFAULT_RESULTS_DIR = Path("results") / "bench"
SCHEMA = "rmqfast-bench/1"
CFLAGS = ["-O2", "-g", "-std=gnu11", "-Wall", "-Wextra"]
TOOL_LIBS = {"loadgen": ["-lm"], "nullbroker": ["-pthread"]}

#: What the null broker puts in every pull answer (16 store records of 1 KiB).
PULL_MSGS = 16
PULL_BODY = 1024


class BenchError(RuntimeError):
    """The benchmark cannot run (tool missing, build failed, target would not start)."""


# Tools ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tools:
    loadgen: Path
    nullbroker: Path
    cc_version: str


def _cc() -> str:
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        raise BenchError(f"C compiler {cc!r} not found; install it (apt-get install gcc) or set CC")
    return cc


def build_tools(build_dir: Path | None = None) -> Tools:
    """Compile ``bench/loadgen.c`` and ``bench/nullbroker.c`` unless already built."""
    if not (BENCH_SRC / "loadgen.c").is_file():
        raise BenchError(f"{BENCH_SRC / 'loadgen.c'} not found; the bench needs a source checkout of rmqfast")
    build_dir = build_dir or DEFAULT_BUILD_DIR
    build_dir.mkdir(parents=True, exist_ok=True)
    cc = _cc()
    cc_version = subprocess.run([cc, "-dumpfullversion"], capture_output=True, text=True).stdout.strip()
    header = (BENCH_SRC / "remoting.h").read_bytes()
    built: dict[str, Path] = {}
    for name, libs in TOOL_LIBS.items():
        src = BENCH_SRC / f"{name}.c"
        key = hashlib.sha256(
            src.read_bytes() + header + " ".join([cc, cc_version, *CFLAGS, *libs]).encode()
        ).hexdigest()[:12]
        out = build_dir / f"{name}-{key}"
        if not out.exists():
            tmp = build_dir / f".{out.name}.{os.getpid()}.tmp"
            cmd = [cc, *CFLAGS, "-o", str(tmp), str(src), *libs]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                tmp.unlink(missing_ok=True)
                raise BenchError(f"building {name} failed: {' '.join(cmd)}\n{proc.stderr}")
            os.replace(tmp, out)  # atomic: a concurrent build never sees half a binary
            for stale in build_dir.glob(f"{name}-*"):  # builds of earlier sources
                if stale != out:
                    stale.unlink(missing_ok=True)
        built[name] = out
    return Tools(built["loadgen"], built["nullbroker"], cc_version)


# Scenarios -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    conns: int
    inflight: int = 1
    rate: float = 0.0  # > 0: open loop at this many requests/s in total
    body: int = 1024
    topics: int = 8
    pull_pct: int = 0
    what: str = ""

    @property
    def open_loop(self) -> bool:
        return self.rate > 0

    def loadgen_args(self) -> list[str]:
        return ["--conns", str(self.conns), "--inflight", str(self.inflight), "--rate", f"{self.rate:g}",
                "--body", str(self.body), "--topics", str(self.topics), "--pull-pct", str(self.pull_pct)]


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("send-16x32", 16, 32, what="1 KiB sends, 16 connections x 32 in flight (throughput)"),
        Scenario("send-64x1", 64, 1, what="1 KiB sends, 64 connections x 1 in flight (sync clients)"),
        Scenario("open-60k", 16, rate=60000, what="1 KiB sends, open loop at 60,000/s over 16 connections (latency)"),
        Scenario("pull-16x4", 16, 4, pull_pct=100,
                 what=f"pulls answered with {PULL_MSGS} x {PULL_BODY} B records, 16 connections x 4 in flight"),
    )
}


@dataclass(frozen=True)
class Mode:
    rounds: int
    warmup: float
    duration: float
    scenarios: tuple[str, ...]
    targets: tuple[str, ...]


SHORT = Mode(1, 0.5, 2.0, ("send-16x32", "send-64x1", "open-60k"), ("direct", "haproxy", "rmqfast", "rmqfast-pure"))
FULL = Mode(3, 2.0, 8.0, tuple(SCENARIOS), ("direct", "haproxy", "haproxy-1t", "rmqfast", "rmqfast-pure"))
ALL_TARGETS = ("direct", "haproxy", "haproxy-1t", "rmqfast", "rmqfast-pure")


# /proc helpers ---------------------------------------------------------------------------------

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, all its threads; (0, 0) if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0, 0.0
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
    return int(fields[11]) / _CLK_TCK, int(fields[12]) / _CLK_TCK


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process in KiB, from /proc/PID/status."""
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def _total_cpu(pids: Sequence[int]) -> tuple[float, float]:
    user = system = 0.0
    for pid in pids:
        u, s = cpu_seconds(pid)
        user += u
        system += s
    return user, system


def machine_cpu() -> dict[str, float]:
    """CPU seconds of the whole machine so far, from /proc/stat: ``task`` (user, nice,
    system: time charged to processes), ``irq`` (irq + softirq, e.g. loopback TCP receive
    work, which the kernel charges to no process) and ``steal`` (taken by the hypervisor)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]] + [0] * 8
    # user nice system idle iowait irq softirq steal
    return {"task": (v[0] + v[1] + v[2]) / _CLK_TCK, "irq": (v[5] + v[6]) / _CLK_TCK, "steal": v[7] / _CLK_TCK}


def wait_idle(pids: Sequence[int], timeout: float = 15.0, threshold: float = 0.05) -> None:
    """Wait until the processes use less than ``threshold`` of a core (a proxy draining the
    backlog of an overloaded open-loop run must not steal CPU from the next run)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = sum(_total_cpu(pids))
        time.sleep(0.1)
        if sum(_total_cpu(pids)) - before < threshold * 0.1:
            return


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"{proc.args!r} exited with {proc.returncode} before listening on {port}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise BenchError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def _stop(proc: subprocess.Popen[Any] | None, timeout: float = 10.0) -> None:
    """SIGTERM one process we started (by its pid), SIGKILL if it does not exit."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# The null broker -------------------------------------------------------------------------------


class NullBroker:
    """``bench/nullbroker`` on a free loopback port; ``with NullBroker(tools) as nb: nb.port``."""

    def __init__(self, tools: Tools, *, threads: int = 1, pull_msgs: int = PULL_MSGS,
                 pull_body: int = PULL_BODY) -> None:
        self.cmd = [str(tools.nullbroker), "--port", "0", "--threads", str(threads),
                    "--pull-msgs", str(pull_msgs), "--pull-body", str(pull_body)]
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.final_stats: dict[str, Any] = {}

    def start(self) -> NullBroker:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "listening 127.0.0.1:PORT"
        if not line.startswith("listening "):
            _stop(self.proc)
            raise BenchError(f"nullbroker did not start: {line!r}")
        self.port = int(line.rsplit(":", 1)[1])
        return self

    @property
    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc else []

    def stop(self) -> None:
        if self.proc is None:
            return
        _stop(self.proc)
        assert self.proc.stdout is not None
        out = self.proc.stdout.read().strip()
        self.proc.stdout.close()
        if out:
            with contextlib.suppress(ValueError):
                self.final_stats = json.loads(out.splitlines()[-1])

    def __enter__(self) -> NullBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# Targets -----------------------------------------------------------------------------------------


class Target(Protocol):
    name: str

    @property
    def port(self) -> int: ...

    def pids(self) -> list[int]: ...

    def info(self) -> dict[str, Any]: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


class DirectTarget:
    """The load generator talks to the null broker itself: the ceiling."""

    def __init__(self, broker: NullBroker) -> None:
        self.name = "direct"
        self.broker = broker

    @property
    def port(self) -> int:
        return self.broker.port

    def pids(self) -> list[int]:
        return []  # the null broker's CPU is recorded for every target anyway

    def info(self) -> dict[str, Any]:
        return {}

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


def ensure_haproxy(install: bool) -> str | None:
    """Path of haproxy; installs Debian's package with apt-get if missing and allowed."""
    exe = shutil.which("haproxy") or (shutil.which("haproxy", path="/usr/sbin:/sbin"))
    if exe or not install:
        return exe
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        print("bench: haproxy is not installed and cannot be installed here (needs root and apt-get)", file=sys.stderr)
        return None
    print("bench: installing haproxy with apt-get ...", file=sys.stderr, flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", "haproxy"]
    if subprocess.run(cmd, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"bench: apt-get install haproxy failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
            return None
    return shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/sbin")


def haproxy_version(exe: str) -> str:
    out = subprocess.run([exe, "-v"], capture_output=True, text=True).stdout
    return out.splitlines()[0].strip() if out else ""


class HAProxyTarget:
    """HAProxy in TCP mode in front of the null broker, from a generated config."""

    def __init__(self, exe: str, upstream_port: int, nbthread: int, name: str) -> None:
        self.name = name
        self.exe = exe
        self.nbthread = nbthread
        self.upstream_port = upstream_port
        self._port = 0
        self.workdir = Path(tempfile.mkdtemp(prefix="rmqfast-bench-haproxy-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def port(self) -> int:
        return self._port

    @staticmethod
    def maxconn() -> int:
        # HAProxy wants 2 fds per connection and refuses to start if it cannot raise its fd
        # limit that far; the bench needs at most a few hundred connections.
        import resource

        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        return max(256, min(10000, (hard - 200) // 2)) if hard != resource.RLIM_INFINITY else 10000

    def config(self) -> str:
        # Plain L4 relay, defaults otherwise (no splicing, 16 KiB buffers): what a team would
        # put in front of a broker.  Long client/server timeouts: pulls are held for 15 s.
        return f"""global
    nbthread {self.nbthread}
    maxconn {self.maxconn()}

defaults
    mode tcp
    timeout connect 5s
    timeout client 5m
    timeout server 5m

listen rocketmq
    bind 127.0.0.1:{self._port}
    server nullbroker 127.0.0.1:{self.upstream_port}
"""

    def start(self) -> None:
        self._port = free_port()
        cfg = self.workdir / "haproxy.cfg"
        cfg.write_text(self.config())
        self._log = open(self.workdir / "haproxy.log", "ab")
        # -db: foreground, one process (threads inside), so its pid is all the CPU there is.
        self.proc = subprocess.Popen([self.exe, "-f", str(cfg), "-db"], stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_port(self._port, self.proc)
        except BenchError as exc:
            log = (self.workdir / "haproxy.log").read_text(errors="replace")[-2000:]
            raise BenchError(f"{self.name}: {exc}\n{log}") from None

    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc else []

    def info(self) -> dict[str, Any]:
        return {"nbthread": self.nbthread, "version": haproxy_version(self.exe)}

    def stop(self) -> None:
        _stop(self.proc)
        if self._log:
            self._log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


class BenchProxy(ProxyProcess):
    """``rmqfast serve`` with one static broker endpoint (``--broker``) to the null broker.

    The port block ProxyProcess reserves holds namesrv (base), admin (base + 1), the
    endpoint's VIP channel (base + 2) and the endpoint (base + 4); the automatic range is
    disabled, so no name-server traffic is needed.
    """

    def __init__(self, broker_port: int, *, workers: int, pure: bool) -> None:
        env = {"RMQFAST_NO_EXTENSIONS": "1" if pure else "0"}
        super().__init__([f"127.0.0.1:{broker_port}"], workers=workers, range_size=3, env=env)
        self.upstream = f"127.0.0.1:{broker_port}"

    @property
    def endpoint_port(self) -> int:
        return self.port_range[1]  # a property: start() moves to new ports if one was taken

    def argv(self) -> list[str]:
        # ProxyProcess's command plus the --broker flags.
        return [*super().argv(), "--broker", f"127.0.0.1:{self.endpoint_port}={self.upstream}",
                "--broker-port-range", ""]

    def codecs(self) -> set[str]:
        """The scanner implementation each worker reported at start ("compiled"/"python")."""
        return {str(r["codec"]) for r in self.log_records() if r.get("msg") == "worker ready" and "codec" in r}


class RmqfastTarget:
    def __init__(self, broker_port: int, *, workers: int, pure: bool, name: str) -> None:
        self.name = name
        self.pure = pure
        self.broker_port = broker_port
        self.workers = workers
        self.proxy: BenchProxy | None = None
        self._workers: list[int] = []

    @property
    def port(self) -> int:
        assert self.proxy is not None
        return self.proxy.endpoint_port

    def start(self) -> None:
        # Created here, not in __init__: ProxyProcess picks its port block when constructed,
        # and two proxies constructed before either binds would get the same block.
        self.proxy = BenchProxy(self.broker_port, workers=self.workers, pure=self.pure)
        self.proxy.start()
        deadline = time.monotonic() + 10
        codecs: set[str] = set()
        while time.monotonic() < deadline:  # the log line may lag readiness a little
            codecs = self.proxy.codecs()
            if len(codecs) == 1 and len(self.proxy.worker_pids()) == self.workers:
                break
            time.sleep(0.1)
        want = "python" if self.pure else "compiled"
        if codecs != {want}:
            self.stop()
            hint = "" if self.pure else " (is the Cython extension built? pip install -e .)"
            raise BenchError(
                f"{self.name}: workers run the {sorted(codecs) or 'unknown'} scanner, expected {want}{hint}")
        self._workers = self.proxy.worker_pids()

    def worker_pids(self) -> list[int]:
        return list(self._workers)

    def pids(self) -> list[int]:
        sup = [self.proxy.proc.pid] if self.proxy and self.proxy.proc else []
        return sup + self._workers

    def info(self) -> dict[str, Any]:
        return {"workers": len(self._workers), "codec": "python" if self.pure else "compiled"}

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.__exit__()
            self.proxy = None


# One run -------------------------------------------------------------------------------------------


def run_loadgen(tools: Tools, port: int, sc: Scenario, *, warmup: float, duration: float,
                cpu_groups: dict[str, Sequence[int]] | None = None) -> dict[str, Any]:
    """Run the load generator once and return its JSON.

    With ``cpu_groups`` (name -> pids), ``cpu`` is added: per group the user and system CPU
    seconds spent during the measured window (sampled when the warm-up ends and when loadgen
    exits) and the cores that makes.
    """
    cmd = [str(tools.loadgen), "--port", str(port), *sc.loadgen_args(),
           "--warmup", f"{warmup:g}", "--duration", f"{duration:g}"]
    groups = cpu_groups or {}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(warmup)
    t0 = time.monotonic()
    cpu0 = {name: _total_cpu(pids) for name, pids in groups.items()}
    machine0 = machine_cpu()
    try:
        out, err = proc.communicate(timeout=warmup + duration + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise BenchError(f"loadgen did not finish: {' '.join(cmd)}") from None
    window = time.monotonic() - t0
    cpu1 = {name: _total_cpu(pids) for name, pids in groups.items()}
    machine1 = machine_cpu()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        raise BenchError(f"loadgen printed no result (exit {proc.returncode}): {' '.join(cmd)}\n{err}")
    result: dict[str, Any] = json.loads(lines[-1])
    if proc.returncode != 0 or "error" in result:
        raise BenchError(f"loadgen failed (exit {proc.returncode}): {result.get('error', err)}")
    cpu: dict[str, Any] = {"window_s": round(window, 3)}
    ours = result["cpu_user_s"] + result["cpu_sys_s"]
    for name in groups:
        user = cpu1[name][0] - cpu0[name][0]
        system = cpu1[name][1] - cpu0[name][1]
        ours += user + system
        cpu[name] = {"user_s": round(user, 3), "sys_s": round(system, 3),
                     "cores": round((user + system) / window, 3) if window > 0 else 0.0}
    cpu["loadgen"] = {"user_s": result["cpu_user_s"], "sys_s": result["cpu_sys_s"],
                      "cores": round((result["cpu_user_s"] + result["cpu_sys_s"]) / window, 3) if window else 0.0}
    def rate(x: float) -> float:
        return round(x / window, 3) if window > 0 else 0.0

    task = machine1["task"] - machine0["task"]
    # "other_cores": process time that is neither the target's, the null broker's nor
    # loadgen's: other processes on the machine (a noisy neighbour shows up here).
    cpu["machine"] = {"task_cores": rate(task), "irq_cores": rate(machine1["irq"] - machine0["irq"]),
                      "steal_cores": rate(machine1["steal"] - machine0["steal"]),
                      "other_cores": rate(max(0.0, task - ours))}
    result["cpu"] = cpu
    return result


# Machine info ----------------------------------------------------------------------------------


def _git(*args: str) -> str:
    try:
        proc = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


def machine_info(tools: Tools, haproxy_exe: str | None) -> dict[str, Any]:
    cpu_model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    mem_kib = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_kib = int(Path("/proc/meminfo").read_text().split("\n", 1)[0].split()[1])
    from rmqfast import codec

    commit = _git("rev-parse", "HEAD")
    return {
        "hostname": platform.node(),
        "cpu_model": cpu_model or platform.processor(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "mem_total_mib": mem_kib // 1024,
        "kernel": platform.release(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "rmqfast": __version__,
        "gevent": _version("gevent"),
        "cython": _version("Cython"),
        "compiled_scanner": codec.extension_built(),
        "haproxy": haproxy_version(haproxy_exe) if haproxy_exe else "",
        "cc": f"{os.environ.get('CC', 'gcc')} {tools.cc_version}",
        "git_commit": commit,
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")) if commit else None,
    }


# Summary -------------------------------------------------------------------------------------------


@dataclass
class Cell:
    """Medians of one (scenario, target) over the rounds."""

    scenario: str
    target: str
    runs: int
    rps: float
    p50_us: float
    p99_us: float
    p999_us: float
    send_rate: float
    cores: float
    cpu_us_per_req: float
    other_cores: float
    errors: int
    rounds_rps: list[float] = field(default_factory=list)


def summarize(runs: list[dict[str, Any]]) -> dict[tuple[str, str], Cell]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["scenario"], r["target"]), []).append(r)
    cells = {}
    for (sc, tg), rs in groups.items():
        def med(get: Any, rs: list[dict[str, Any]] = rs) -> float:
            return float(statistics.median(get(r) for r in rs))

        cells[(sc, tg)] = Cell(
            scenario=sc, target=tg, runs=len(rs),
            rps=med(lambda r: r["loadgen"]["rps"]),
            p50_us=med(lambda r: r["loadgen"]["lat_us"]["p50"]),
            p99_us=med(lambda r: r["loadgen"]["lat_us"]["p99"]),
            p999_us=med(lambda r: r["loadgen"]["lat_us"]["p999"]),
            send_rate=med(lambda r: r["loadgen"]["send_rate"]),
            cores=med(lambda r: r["target_cpu"]["cores"]),
            cpu_us_per_req=med(lambda r: r["target_cpu_us_per_req"] or 0.0),
            other_cores=med(lambda r: r["cpu"]["machine"]["other_cores"]),
            errors=sum(int(r["loadgen"]["errors"]) for r in rs),
            rounds_rps=[float(r["loadgen"]["rps"]) for r in rs],
        )
    return cells


#: A run during which other processes used more CPU than this is "disturbed".
NOISE_CORES = 0.1


@dataclass
class Check:
    name: str
    value: float | None
    goal: str
    met: bool | None
    unit: str = ""
    #: Other processes used > NOISE_CORES during a run this value comes from.
    disturbed: bool = False


def checks(cells: dict[tuple[str, str], Cell], rss: dict[str, list[dict[str, int]]]) -> list[Check]:
    """The issue's targets, evaluated on the medians (``None`` when not measured)."""

    def cell(sc: str, tg: str) -> Cell | None:
        return cells.get((sc, tg))

    def noisy(*cs: Cell | None) -> bool:
        return any(c is not None and c.other_cores > NOISE_CORES for c in cs)

    def best_haproxy(sc: str) -> Cell | None:
        hs = [c for c in (cell(sc, "haproxy"), cell(sc, "haproxy-1t")) if c is not None]
        return max(hs, key=lambda c: c.rps) if hs else None

    def vs(sc: str, a: Cell | None, b: Cell | None, name: str, goal: float | None) -> Check:
        r = a.rps / b.rps if a is not None and b is not None and b.rps else None
        met = None if r is None or goal is None else r >= goal
        return Check(f"{sc} {name}", r, f">= {goal}" if goal is not None else "info", met, disturbed=noisy(a, b))

    out: list[Check] = []
    c = cell("send-16x32", "rmqfast")
    out.append(Check("send-16x32 rmqfast msg/s", c.rps if c else None, ">= 60000",
                     None if c is None else c.rps >= 60000, "msg/s", noisy(c)))
    out.append(vs("send-16x32", c, best_haproxy("send-16x32"), "rmqfast / best HAProxy", 0.8))
    out.append(vs("send-64x1", cell("send-64x1", "rmqfast"), best_haproxy("send-64x1"), "rmqfast / best HAProxy", 0.75))
    d, p = cell("open-60k", "direct"), cell("open-60k", "rmqfast")
    added = (p.p99_us - d.p99_us) / 1000 if d and p else None
    kept_up = p is not None and p.send_rate >= 0.98 * SCENARIOS["open-60k"].rate and p.rps >= 0.98 * p.send_rate
    out.append(Check("open-60k rmqfast added p99 over direct", added, "< 1 ms (at the full rate)",
                     None if added is None else added < 1.0 and kept_up, "ms", noisy(d, p)))
    workers = rss.get("rmqfast", [])
    worst = max((w.get("VmRSS", 0) for w in workers), default=None)
    out.append(Check("rmqfast worker RSS after the run (max)", None if worst is None else worst / 1024,
                     "< 64 MB", None if worst is None else worst < 64 * 1024, "MiB"))
    for sc in ("send-16x32", "send-64x1", "pull-16x4"):
        for a, b in (("rmqfast", "haproxy"), ("rmqfast", "haproxy-1t"), ("rmqfast", "direct"),
                     ("rmqfast-pure", "rmqfast"), ("haproxy", "direct"), ("haproxy-1t", "haproxy")):
            ca, cb = cell(sc, a), cell(sc, b)
            if ca is not None and cb is not None:
                out.append(vs(sc, ca, cb, f"{a} / {b}", None))
    return out


def _fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def render(cells: dict[tuple[str, str], Cell], scenarios: Sequence[str], targets: Sequence[str],
           rss: dict[str, list[dict[str, int]]], found: list[Check]) -> str:
    lines = []
    head = f"{'scenario':<12} {'target':<13} {'req/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'p99.9 ms':>9} " \
           f"{'proxy CPU':>9} {'CPU us/req':>10} {'other':>5} {'errors':>6}  rounds (req/s)"
    lines.append(head)
    lines.append("-" * len(head))
    for sc in scenarios:
        for tg in targets:
            c = cells.get((sc, tg))
            if c is None:
                continue
            rounds = ", ".join(_fmt_rate(x) for x in c.rounds_rps)
            cpu = f"{c.cores:.2f}" if tg != "direct" else "-"
            per = f"{c.cpu_us_per_req:.1f}" if tg != "direct" else "-"
            lines.append(f"{sc:<12} {tg:<13} {_fmt_rate(c.rps):>10} {c.p50_us / 1000:>8.2f} {c.p99_us / 1000:>8.2f} "
                         f"{c.p999_us / 1000:>9.2f} {cpu:>9} {per:>10} {c.other_cores:>5.2f} {c.errors:>6}  {rounds}")
        d = cells.get((sc, "direct"))
        if sc in SCENARIOS and SCENARIOS[sc].open_loop and d is not None:
            for tg in targets:
                c = cells.get((sc, tg))
                if c is None or tg == "direct":
                    continue
                note = "" if c.send_rate >= 0.98 * SCENARIOS[sc].rate and c.rps >= 0.98 * c.send_rate else \
                    f"  (did not keep up: answered {_fmt_rate(c.rps)}/s)"
                lines.append(f"{'':<12} {tg:<13} added over direct: p50 {(c.p50_us - d.p50_us) / 1000:+.2f} ms, "
                             f"p99 {(c.p99_us - d.p99_us) / 1000:+.2f} ms, "
                             f"p99.9 {(c.p999_us - d.p999_us) / 1000:+.2f} ms{note}")
        lines.append("")
    for tg, workers in rss.items():
        desc = ", ".join(f"pid {w['pid']}: {w.get('VmRSS', 0) / 1024:.1f} MiB (peak {w.get('VmHWM', 0) / 1024:.1f})"
                         for w in workers)
        lines.append(f"RSS {tg} workers after the run: {desc}")
    noisy = sorted({c.scenario for c in cells.values() if c.other_cores > NOISE_CORES})
    if noisy:
        lines.append(f"WARNING: other processes used > {NOISE_CORES} core during {', '.join(noisy)} (column 'other'): "
                     "those numbers are disturbed; rerun on a quiet machine.")
    lines.append("")
    lines.append("Targets (issue) and ratios, on medians:")
    for ch in found:
        if ch.value is None:
            val = "not measured"
        elif ch.unit in ("msg/s",):
            val = _fmt_rate(ch.value)
        else:
            val = f"{ch.value:.3f}" + (f" {ch.unit}" if ch.unit else "")
        mark = {True: "MET ", False: "MISS", None: "    "}[ch.met]
        note = "   (disturbed: other processes were busy)" if ch.disturbed else ""
        lines.append(f"  {mark} {ch.name:<44} {val:>14}   goal {ch.goal}{note}")
    return "\n".join(lines)


# Main ----------------------------------------------------------------------------------------------


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="rmqfast bench",
        description="Direct vs HAProxy vs rmqfast (compiled and pure Python) against a null broker, side by side.",
        epilog="Scenarios: " + "; ".join(f"{s.name}: {s.what}" for s in SCENARIOS.values()),
    )
    ap.add_argument("--short", action="store_true", help="one round of 2 s runs, 3 scenarios (under a minute)")
    ap.add_argument("--rounds", type=int, help="rounds (default: 3 full, 1 short)")
    ap.add_argument("--duration", type=float, help="measured seconds per run (default: 8 full, 2 short)")
    ap.add_argument("--warmup", type=float, help="warm-up seconds before each measured window (default: 2 / 0.5)")
    ap.add_argument("--scenarios", help=f"comma-separated, from {', '.join(SCENARIOS)}")
    ap.add_argument("--targets", help=f"comma-separated, from {', '.join(ALL_TARGETS)}")
    ap.add_argument("--workers", type=int, default=2, help="rmqfast worker processes (default 2)")
    ap.add_argument("--results", type=Path, default=DEFAULT_RESULTS_DIR, help="results folder (default results/bench)")
    ap.add_argument("--build-dir", type=Path, default=None, help="where the C tools are built (default build/bench)")
    ap.add_argument("--no-install", action="store_true", help="do not apt-get install haproxy when it is missing")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    ap.add_argument("--real", action="store_true",
                    help="real-broker mode instead: the Java producer against a real RocketMQ, direct vs rmqfast "
                         "(see rmqfast bench --real --help)")
    ap.add_argument("--clouds", action="store_true",
                    help="cross-cloud mode instead: durable vs fast copies between two real RocketMQ clusters "
                         "(see rmqfast bench --clouds --help)")
    ap.add_argument("--report", type=Path, metavar="FILE",
                    help="run nothing: print the summary of an earlier results file (.jsonl)")
    args = ap.parse_args(argv)
    mode = SHORT if args.short else FULL
    args.rounds = args.rounds or mode.rounds
    args.duration = args.duration or mode.duration
    args.warmup = mode.warmup if args.warmup is None else args.warmup
    args.scenario_list = args.scenarios.split(",") if args.scenarios else list(mode.scenarios)
    args.target_list = args.targets.split(",") if args.targets else list(mode.targets)
    for s in args.scenario_list:
        if s not in SCENARIOS:
            ap.error(f"--scenarios: {s!r} is not one of {', '.join(SCENARIOS)}")
    for t in args.target_list:
        if t not in ALL_TARGETS:
            ap.error(f"--targets: {t!r} is not one of {', '.join(ALL_TARGETS)}")
    if args.rounds < 1 or args.duration <= 0 or args.warmup < 0 or args.workers < 1:
        ap.error("--rounds and --workers must be >= 1, --duration > 0, --warmup >= 0")
    return args


@contextlib.contextmanager
def _started(targets: list[Target]) -> Iterator[list[Target]]:
    started: list[Target] = []
    try:
        for t in targets:
            print(f"bench: starting {t.name} ...", file=sys.stderr, flush=True)
            try:
                t.start()
            except BaseException:
                t.stop()  # whatever it got to start (temp dirs, processes)
                raise
            started.append(t)
        yield started
    finally:
        for t in reversed(started):
            t.stop()


def report(path: Path) -> str:
    """The summary table of an earlier results file."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    runs = [r for r in records if r.get("kind") == "run"]
    if not runs:
        raise BenchError(f"{path}: no run records")
    rss: dict[str, list[dict[str, int]]] = {}
    for r in records:
        if r.get("kind") == "rss":
            rss.setdefault(r["target"], []).append({k: r[k] for k in ("pid", "VmRSS", "VmHWM") if k in r})
    scenarios = list(dict.fromkeys(r["scenario"] for r in runs))
    targets = [t for t in ALL_TARGETS if any(r["target"] == t for r in runs)]
    cells = summarize(runs)
    m = runs[0]["machine"]
    head = (f"rmqfast bench {runs[0]['run_id']} on {m['cpu_model']} ({m['cores']} cores), kernel {m['kernel']}, "
            f"Python {m['python']}, {m.get('haproxy') or 'no HAProxy'}; "
            f"{max(r['round'] for r in runs) + 1} round(s); medians")
    return head + "\n\n" + render(cells, scenarios, targets, rss, checks(cells, rss))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--real" in argv:
        from rmqfast.bench_real import main as real_main

        return real_main(argv)
    if "--clouds" in argv:
        from rmqfast.bench_clouds import main as clouds_main

        return clouds_main(argv)
    args = _parse(argv)
    try:
        if args.report:
            print(report(args.report))
            return 0
        return _run(args)
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    tools = build_tools(args.build_dir)
    haproxy_exe = None
    if any(t.startswith("haproxy") for t in args.target_list):
        haproxy_exe = ensure_haproxy(install=not args.no_install)
        if haproxy_exe is None:
            print("bench: skipping the HAProxy targets", file=sys.stderr)
            args.target_list = [t for t in args.target_list if not t.startswith("haproxy")]
    machine = machine_info(tools, haproxy_exe)
    before = machine_cpu()["task"]
    time.sleep(1.0)
    machine["busy_cores_before"] = round(machine_cpu()["task"] - before, 2)
    if machine["busy_cores_before"] > 2 * NOISE_CORES:
        print(f"bench: WARNING: the machine is busy before the bench starts ({machine['busy_cores_before']} cores "
              "used by other processes); results will be disturbed", file=sys.stderr)
    stamp = dt.datetime.now(dt.UTC)
    run_id = f"{stamp:%Y%m%dT%H%M%SZ}-{(machine['git_commit'] or 'nogit')[:8]}"
    args.results.mkdir(parents=True, exist_ok=True)
    out_path = args.results / f"bench-{run_id}.jsonl"
    common = {"schema": SCHEMA, "run_id": run_id, "mode": "short" if args.short else "full", "machine": machine}
    scenarios = [SCENARIOS[s] for s in args.scenario_list]
    print(f"bench: {len(args.target_list)} targets x {len(scenarios)} scenarios x {args.rounds} rounds, "
          f"{args.warmup:g} s warm-up + {args.duration:g} s each; results -> {out_path}", file=sys.stderr)

    runs: list[dict[str, Any]] = []
    rss: dict[str, list[dict[str, int]]] = {}
    failed = 0
    with open(out_path, "a") as out, NullBroker(tools) as broker:

        def emit(rec: dict[str, Any]) -> None:
            out.write(json.dumps({**common, "ts": dt.datetime.now(dt.UTC).isoformat(), **rec}) + "\n")
            out.flush()

        targets: list[Target] = []
        for name in args.target_list:
            if name == "direct":
                targets.append(DirectTarget(broker))
            elif name.startswith("haproxy"):
                assert haproxy_exe is not None
                targets.append(HAProxyTarget(haproxy_exe, broker.port, 1 if name == "haproxy-1t" else 2, name))
            else:
                targets.append(RmqfastTarget(broker.port, workers=args.workers, pure=name == "rmqfast-pure", name=name))
        with _started(targets):
            step = 0
            for rnd in range(args.rounds):
                for sc in scenarios:
                    order = targets[step % len(targets):] + targets[: step % len(targets)]
                    step += 1
                    for t in order:
                        wait_idle([pid for x in targets for pid in x.pids()] + broker.pids)
                        try:
                            res = run_loadgen(tools, t.port, sc, warmup=args.warmup, duration=args.duration,
                                              cpu_groups={"target": t.pids(), "nullbroker": broker.pids})
                        except BenchError as exc:
                            failed += 1
                            print(f"bench: {sc.name} {t.name}: {exc}", file=sys.stderr)
                            emit({"kind": "error", "round": rnd, "scenario": sc.name, "target": t.name,
                                  "error": str(exc)})
                            continue
                        rec = _run_record(rnd, sc, t, res)
                        if rec["loadgen"]["errors"] or not rec["loadgen"]["responses"]:
                            failed += 1
                        runs.append(rec)
                        emit(rec)
                        _progress(rec, args.rounds)
            for t in targets:
                if isinstance(t, RmqfastTarget):
                    rss[t.name] = [{"pid": pid, **memory_kib(pid)} for pid in t.worker_pids()]
                    for w in rss[t.name]:
                        emit({"kind": "rss", "target": t.name, **w})
    if broker.final_stats:
        with open(out_path, "a") as out:
            out.write(json.dumps({**common, "kind": "nullbroker", **broker.final_stats}) + "\n")

    cells = summarize(runs)
    found = checks(cells, rss)
    with open(out_path, "a") as out:
        for c in cells.values():
            out.write(json.dumps({**common, "kind": "summary", **asdict(c)}) + "\n")
        for ch in found:
            out.write(json.dumps({**common, "kind": "check", **asdict(ch)}) + "\n")
    if args.json:
        print(json.dumps({"run_id": run_id, "results": str(out_path), "machine": machine,
                          "cells": [asdict(c) for c in cells.values()], "checks": [asdict(c) for c in found],
                          "rss": rss}, indent=2))
    else:
        print()
        print(f"rmqfast bench {run_id} on {machine['cpu_model']} ({machine['cores']} cores), "
              f"kernel {machine['kernel']}, "
              f"Python {machine['python']}, {machine['haproxy'] or 'no HAProxy'}")
        print(f"{args.rounds} round(s), {args.warmup:g} s warm-up + {args.duration:g} s per run; medians; "
              "proxy CPU = cores used by the target's processes; CPU us/req = their CPU time per answered request; "
              "other = cores used by processes outside the bench")
        print()
        print(render(cells, args.scenario_list, args.target_list, rss, found))
        print()
        print(f"results: {out_path}")
    if failed:
        print(f"bench: {failed} run(s) failed or counted errors (see the results file)", file=sys.stderr)
        return 1
    return 0


def _run_record(rnd: int, sc: Scenario, t: Target, res: dict[str, Any]) -> dict[str, Any]:
    cpu = res.pop("cpu")
    target = cpu["target"]
    answered = res["rps"] * cpu["window_s"]
    return {
        "kind": "run", "round": rnd, "scenario": sc.name, "target": t.name, "target_info": t.info(),
        "params": asdict(sc), "loadgen": res,
        "cpu": cpu,
        "target_cpu": target,
        "target_cpu_us_per_req": round((target["user_s"] + target["sys_s"]) * 1e6 / answered, 2) if answered else None,
    }


def _progress(rec: dict[str, Any], rounds: int) -> None:
    lg = rec["loadgen"]
    lat = lg["lat_us"]
    print(f"  round {rec['round'] + 1}/{rounds}  {rec['scenario']:<11} {rec['target']:<13} "
          f"{_fmt_rate(lg['rps']):>10} req/s  p50 {lat['p50'] / 1000:6.2f} ms  p99 {lat['p99'] / 1000:7.2f} ms  "
          f"target CPU {rec['target_cpu']['cores']:.2f}  other {rec['cpu']['machine']['other_cores']:.2f}  "
          f"errors {lg['errors']}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
