"""What a bench target is, and the ``direct`` and rmqfast targets (HAProxy: ``haproxy.py``)."""

from __future__ import annotations

import time
from typing import Any, Protocol

from rmqfast.bench.common import BenchError
from rmqfast.bench.nullbroker import NullBroker
from rmqfast.testing.proxy import ProxyProcess


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


#: the largest value ``proxy.max_connections_per_client`` takes (it is then the worker's cap)
MAX_CAP = 1 << 24


class BenchProxy(ProxyProcess):
    """``rmqfast serve`` with one static broker endpoint (``--broker``) to the null broker.

    The port block ProxyProcess reserves holds namesrv (base), admin (base + 1), the
    endpoint's VIP channel (base + 2) and the endpoint (base + 4); the automatic range is
    disabled, so no name-server traffic is needed.
    """

    def __init__(self, broker_port: int, *, workers: int, pure: bool, uring: bool = True,
                 max_connections: int = 0) -> None:
        env = {"RMQFAST_NO_EXTENSIONS": "1" if pure else "0", "RMQFAST_URING": "1" if uring else "0"}
        # every benchmark client connects from 127.0.0.1: no per-address cap below the worker's
        # (``max_connections``: 0 from the open-files limit, else this many per worker)
        caps = (f"max_connections = {max_connections}\nmax_connections_per_client = {max_connections}\n"
                if max_connections else f"max_connections_per_client = {MAX_CAP}\n")
        super().__init__([f"127.0.0.1:{broker_port}"], workers=workers, range_size=3, env=env, proxy_settings=caps)
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
    """rmqfast (compiled, or pure Python with ``pure=True``) in front of the null broker."""

    def __init__(self, broker_port: int, *, workers: int, pure: bool, name: str, uring: bool = True,
                 max_connections: int = 0) -> None:
        self.name = name
        self.max_connections = max_connections  # per worker; 0: from the open-files limit
        self.pure = pure
        self.uring = uring  # False: the reactor makes plain recv/send calls (RMQFAST_URING=0)
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
        self.proxy = BenchProxy(self.broker_port, workers=self.workers, pure=self.pure, uring=self.uring,
                                max_connections=self.max_connections)
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
        return {"workers": len(self._workers), "codec": "python" if self.pure else "compiled",
                "io_uring": self._io_uring()}

    def _io_uring(self) -> Any:
        """What the workers' reactors said of io_uring (True, or the reason they make plain
        system calls; None before any session started)."""
        if self.proxy is None:
            return None
        for r in self.proxy.log_records():
            if r.get("msg") == "relay reactor uses io_uring":
                return True
            if r.get("msg") == "relay reactor uses plain system calls":
                return str(r.get("io_uring"))
        return None

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.__exit__()
            self.proxy = None
