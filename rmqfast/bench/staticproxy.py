"""An ``rmqfast serve`` with one static broker endpoint, for the feature benches in ``bench/``
(the allowlist, message addresses, gray rules): each starts it with its own extra config."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rmqfast.bench.common import wait_serving
from rmqfast.bench.procfs import children
from rmqfast.testing.ports import reserve


def start_static_proxy(label: str, broker_port: int, extra: str = "", *, namesrv: str = "127.0.0.1:9",
                       message_addresses: str = "off", dynamic_ports: int = 0,
                       ) -> tuple[subprocess.Popen[bytes], int, list[int], Any]:
    """(process, endpoint port, worker pids, port lease) of a 2-worker proxy whose endpoint relays
    to the broker on ``broker_port``; ``extra`` is appended to its TOML config, ``dynamic_ports``
    broker endpoints are reserved for brokers learnt from routes.  Waits until it serves."""
    lease = reserve(list(range(3 + dynamic_ports)))
    ns, admin, endpoint, lo = lease.base, lease.base + 1, lease.base + 2, lease.base + 3
    port_range = f"{lo}-{lo + dynamic_ports - 1}" if dynamic_ports else ""
    d = Path(tempfile.mkdtemp(prefix=f"rmqfast-{label}-"))
    (d / "c.toml").write_text(f"""
[proxy]
workers = 2
state_dir = "{d}/state"
[namesrv]
listen = "127.0.0.1:{ns}"
upstreams = ["{namesrv}"]
[brokers]
port_range = "{port_range}"
vip_channel = false
[[brokers.static]]
listen = "127.0.0.1:{endpoint}"
upstream = "127.0.0.1:{broker_port}"
[admin]
listen = "127.0.0.1:{admin}"
[log]
level = "warning"
[policy]
message_addresses = "{message_addresses}"
{extra}
""")
    proc = subprocess.Popen([sys.executable, "-P", "-m", "rmqfast", "serve", "--config", str(d / "c.toml")],
                            stdout=subprocess.DEVNULL, stderr=open(d / "log", "wb"))
    wait_serving(proc, admin, [ns, endpoint], f"rmqfast ({label}); see {d / 'log'}")
    while len(children(proc.pid)) < 2:
        time.sleep(0.1)
    return proc, endpoint, children(proc.pid), lease
