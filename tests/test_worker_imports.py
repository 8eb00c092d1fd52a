"""What a worker process loads: no ssl without TLS, prometheus-client's metric classes without its HTTP side.

Each check runs in a fresh interpreter (``sys.modules`` of the test process has everything).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def _run(code: str, env_dir: Path | None = None) -> dict:
    env = None
    if env_dir is not None:
        import os

        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(env_dir)}
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_worker_module_loads_no_ssl() -> None:
    got = _run("import json, sys\n"
               "import rmqfast.server.worker\n"
               "print(json.dumps({m: m in sys.modules for m in ('ssl', '_ssl', '_hashlib', 'hashlib')}))")
    assert got == {"ssl": False, "_ssl": False, "_hashlib": False, "hashlib": False}


def test_tls_context_loads_ssl_when_built(tmp_path: Path) -> None:
    got = _run("import json, sys\n"
               "from rmqfast.proxy import tls\n"
               "before = 'ssl' in sys.modules\n"
               "ctx = tls.client_context(tls.TlsUpstreamSection(enable=True, verify=False))\n"
               "import ssl\n"
               "print(json.dumps({'before': before, 'ctx': isinstance(ctx, ssl.SSLContext),"
               " 'mode': ctx.verify_mode == ssl.CERT_NONE, 'min': ctx.minimum_version == ssl.TLSVersion.TLSv1_2}))")
    assert got == {"before": False, "ctx": True, "mode": True, "min": True}


def test_light_prometheus_metrics_without_exposition(tmp_path: Path) -> None:
    """The worker's metrics are written to the multiprocess files with only the metric classes
    loaded; asking the package for anything else loads it whole, with the same classes."""
    got = _run(
        "import json, sys\n"
        "from rmqfast.metrics import Metrics, light_prometheus\n"
        "light_prometheus()\n"
        "m = Metrics()\n"
        "m.connections.labels('broker').inc(3)\n"
        "from rmqfast.proxy.health import HealthMetrics\n"
        "HealthMetrics()\n"
        "light = {k: k in sys.modules for k in ('http.server', 'urllib.request', 'hashlib')}\n"
        "from prometheus_client import Counter\n"
        "from prometheus_client.metrics import Counter as C2\n"
        "same = Counter is C2\n"
        "from prometheus_client import CollectorRegistry, generate_latest\n"
        "from prometheus_client.multiprocess import MultiProcessCollector\n"
        "reg = CollectorRegistry()\n"
        "MultiProcessCollector(reg)\n"
        "text = generate_latest(reg).decode()\n"
        "line = [x for x in text.splitlines() if x.startswith('rmqfast_connections_total{')]\n"
        "import prometheus_client\n"
        "try:\n"
        "    prometheus_client.no_such_name\n"
        "    missing = 'found'\n"
        "except AttributeError as exc:\n"
        "    missing = str(exc)\n"
        "print(json.dumps({'light': light, 'same': same, 'line': line, 'missing': missing,"
        " 'full': 'http.server' in sys.modules}))",
        env_dir=tmp_path,
    )
    assert got["light"] == {"http.server": False, "urllib.request": False, "hashlib": False}
    assert got["same"] is True
    assert got["line"] == ['rmqfast_connections_total{role="broker"} 3.0']
    assert got["missing"] == "module 'prometheus_client' has no attribute 'no_such_name'"
    assert got["full"] is True


def test_light_prometheus_is_a_no_op_once_imported() -> None:
    got = _run("import json, sys, prometheus_client\n"
               "full = prometheus_client\n"
               "from rmqfast.metrics import light_prometheus\n"
               "light_prometheus()\n"
               "print(json.dumps({'same': sys.modules['prometheus_client'] is full,"
               " 'gen': hasattr(sys.modules['prometheus_client'], 'generate_latest')}))")
    assert got == {"same": True, "gen": True}


def test_aclsign_signs_with_hashlib_imported_on_use() -> None:
    from rmqfast.codec.aclsign import signature

    # HmacSHA1 over the values sorted by key (Signature left out), then the body
    sig = signature({"b": "2", "a": "1", "Signature": "x"}, b"body", "secret")
    import base64
    import hashlib
    import hmac

    assert sig == base64.b64encode(hmac.new(b"secret", b"12body", hashlib.sha1).digest()).decode()


def test_spill_dir_is_the_spill_stores_worker_dir(tmp_path: Path) -> None:
    from rmqfast.server.services import spill_dir
    from rmqfast.spill.store import worker_dir

    for index in (0, 3, 17):
        assert spill_dir(tmp_path, index) == worker_dir(tmp_path, index)
        assert spill_dir(str(tmp_path), index) == worker_dir(str(tmp_path), index)


def test_worker_without_spill_or_records_loads_neither(tmp_path: Path) -> None:
    """A worker with no [delay], replication, shape rule, records or spill directory does not import
    the spill, the shaper or the records (they load when configured: tests of those sections)."""
    got = _run(
        "import json, sys\n"
        "from pathlib import Path\n"
        "from rmqfast.metrics import light_prometheus\n"
        "light_prometheus()\n"
        "from rmqfast import config\n"
        "from rmqfast.server.worker import Worker\n"
        f"state = Path({str(tmp_path)!r}) / 'state'\n"
        "cfg = config.from_dict({'namesrv': {'listen': '127.0.0.1:1', 'upstreams': ['127.0.0.1:9876']},"
        " 'proxy': {'state_dir': str(state)}})\n"
        "w = Worker(cfg, 0, lambda m: None, None)\n"
        "print(json.dumps({m: m in sys.modules for m in ('rmqfast.spill', 'rmqfast.limits.shaper',"
        " 'rmqfast.records', 'ssl')}))",
        env_dir=tmp_path,
    )
    assert got == {"rmqfast.spill": False, "rmqfast.limits.shaper": False, "rmqfast.records": False, "ssl": False}
