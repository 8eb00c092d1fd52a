"""The Spark report unchanged on a real cluster: ``rmqfast analyze --master spark://...`` against
a standalone Master and one Worker (started from the installed pyspark's ``spark-class`` on
loopback, rmqfast.testing.sparkcluster) gives the same tables as local mode on the same records.

Both runs are the command line a user types, in subprocesses; the records are the synthetic ones
of the scale benchmark (rmqfast.analytics.synth), small enough for a loaded 2-core machine.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
pq = pytest.importorskip("pyarrow.parquet")

from rmqfast.analytics.synth import write_aggregates, write_samples  # noqa: E402
from rmqfast.testing.sparkcluster import StandaloneCluster  # noqa: E402

N = 20_000
ANALYZE_TIMEOUT = 600  # bounds a hang; a run took 60 s at a load average of 13 on 2 cores
START_TIMEOUT = 180  # Master + Worker up: about 30 s at a load average of 11

# the first test's time holds the fixture: the cluster's start and both reports (about 2.5 min at
# a load average of 11); each step is bounded above, the whole by this
pytestmark = [pytest.mark.spark, pytest.mark.timeout(START_TIMEOUT + 2 * ANALYZE_TIMEOUT + 120)]


def _analyze(records: Path, out: Path, master: str, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "rmqfast", "analyze", str(records), "-o", str(out), "--master", master]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=ANALYZE_TIMEOUT, env=env)
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-4000:]}"
    assert f"report: {out / 'report.html'}" in done.stdout, done.stdout
    return json.loads((out / "summary.json").read_text())  # type: ignore[no-any-return]


def _rows(path: Path) -> list[dict[str, Any]]:
    """The table's rows in a canonical order (Spark's row order depends on its partitions):
    by the columns that are not floats, then by the floats rounded."""

    def key(r: dict[str, Any]) -> tuple[list[str], list[float]]:
        floats = sorted(k for k in r if isinstance(r[k], float))
        return [repr(r[k]) for k in sorted(r) if k not in floats], [round(r[k], 6) for k in floats]

    return sorted(pq.read_table(path).to_pylist(), key=key)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):  # sums in another order may round otherwise
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return bool(a == b)


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("spark-cluster")
    records = base / "records"
    write_samples(records, N, per_file=N // 2, span_s=600)
    write_aggregates(records, span_s=120, hosts=1, workers=2)
    with StandaloneCluster(base / "cluster", cores=2, memory="1g", start_timeout=START_TIMEOUT) as cluster:
        cluster_summary = _analyze(records, base / "report-cluster", cluster.master_url, cluster.client_env())
        apps = cluster.applications()
        master_url = cluster.master_url
    local_summary = _analyze(records, base / "report-local", "local[2]", cluster.client_env())
    return {"base": base, "cluster": cluster_summary, "local": local_summary, "apps": apps, "master": master_url,
            "worker_log": cluster.worker_log}


def test_the_report_ran_on_the_cluster(reports: dict[str, Any]) -> None:
    assert reports["master"].startswith("spark://127.0.0.1:")
    # the Worker launched an executor for the report's application: the jobs ran there, not in the driver
    assert len(reports["apps"]) == 1, f"executors launched: {reports['apps']}; see {reports['worker_log']}"


def test_cluster_tables_equal_local_tables(reports: dict[str, Any]) -> None:
    base = reports["base"]
    local = {p.name: p for p in (base / "report-local" / "tables").glob("*.parquet")}
    cluster = {p.name: p for p in (base / "report-cluster" / "tables").glob("*.parquet")}
    assert len(local) >= 15 and sorted(cluster) == sorted(local)
    for name, path in sorted(local.items()):
        a, b = pq.read_table(path), pq.read_table(cluster[name])
        assert a.schema == b.schema, name
        ra, rb = _rows(path), _rows(cluster[name])
        assert len(ra) == len(rb), (name, len(ra), len(rb))
        for x, y in zip(ra, rb, strict=True):
            assert x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x), (name, x, y)
    assert reports["cluster"]["counts"] == reports["local"]["counts"]
    assert reports["local"]["counts"]["sample_records"] == N
    assert reports["cluster"]["problems"] == reports["local"]["problems"] == []
    assert sorted(reports["cluster"]["charts"]) == sorted(reports["local"]["charts"])
    assert (base / "report-cluster" / "report.html").stat().st_size > 10_000


def test_a_daemon_that_exits_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rmqfast.testing import sparkcluster
    from rmqfast.testing.errors import ClusterError

    monkeypatch.setattr(sparkcluster, "MASTER_CLASS", "org.apache.spark.deploy.master.NoSuchMaster")
    cluster = StandaloneCluster(tmp_path, start_timeout=START_TIMEOUT)
    with pytest.raises(ClusterError, match=r"the Spark master exited \(\d+\) before it was up") as exc:
        cluster.start()
    assert "NoSuchMaster" in str(exc.value)  # the log's tail says why
    assert cluster.master_url == ""
