"""The Spark report as a reader sees it: rendered by a real headless browser (Debian's chromium).

The page is loaded from disk by chromium; a small script added to a copy of the page records,
once the page has loaded, every image's ``complete`` flag and ``naturalWidth`` (0 for an image
that failed to load) into the DOM, which ``--dump-dom`` prints.  A screenshot of the page must
show content (not a blank page).  Also checked on the HTML: every table has a caption, every
chart a caption, request and response codes are named, expected answers (TOPIC_NOT_EXIST from
the name server) are plotted apart from errors; and on the chart helpers: a series that is 0
throughout gets no legend entry, gaps are drawn by one rule.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("matplotlib")

from spark_helpers import spark  # noqa: E402, F401

from rmqfast.analytics import analyze  # noqa: E402
from rmqfast.analytics.inputs import find_inputs  # noqa: E402
from rmqfast.analytics.jobs import run_all  # noqa: E402
from rmqfast.analytics.report import chart_series  # noqa: E402
from rmqfast.analytics.synth import _adder, write_aggregates, write_samples  # noqa: E402

pytestmark = pytest.mark.spark

PROBE = """<script>
window.addEventListener('load', () => {
  const imgs = Array.from(document.images).map(i => ({src: i.getAttribute('src'), complete: i.complete,
                                                       w: i.naturalWidth, h: i.naturalHeight}));
  const pre = document.createElement('pre');
  pre.id = 'probe';
  pre.textContent = JSON.stringify({imgs, tables: document.querySelectorAll('table').length,
                                    captions: document.querySelectorAll('table > caption').length});
  document.body.appendChild(pre);
});
</script>"""


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no chromium on PATH: `make test-deps` installs Debian's chromium (apt-get install chromium)")


def _browser(args: list[str], timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    # --no-sandbox: tests run as root in containers, where chromium's sandbox cannot start
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--allow-file-access-from-files", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def _write_demo_like_records(d: Path) -> None:
    """Synthetic records plus what the demo's proxy wrote in real runs: name-server route
    queries answered TOPIC_NOT_EXIST (expected), a broker SYSTEM_ERROR (an error), and a quiet
    stretch (no rows) in the middle."""
    write_samples(d, 3000, per_file=1500, span_s=120)
    write_aggregates(d, span_s=40, hosts=1, workers=1)
    from rmqfast.records.parquet import write_table
    from rmqfast.records.schema import AGG_COLUMNS, schema_tag

    names = [c.name for c in AGG_COLUMNS]
    rows: dict[str, list[Any]] = {n: [] for n in names}
    add = _adder(rows, names, "demo", 0)
    t0 = 1_700_000_000
    for s in (0, 1, 2, 30, 31):  # seconds 3-29: nothing happened
        add(t0 + s, "request", role="namesrv", code=105, count=4)
        add(t0 + s, "response", role="namesrv", code=0, count=2)
        add(t0 + s, "response", role="namesrv", code=17, count=2, errors=2)
    add(t0 + 1, "response", role="broker", code=1, count=1, errors=1)
    write_table(d / "agg" / "agg-v1-demo-w0-x.parquet", AGG_COLUMNS, rows, codec="gzip",
                metadata={"rmqfast.schema": schema_tag("agg")})
    bench = d / "bench"
    bench.mkdir()
    lines = [json.dumps({"schema": "rmqfast-bench/1", "run_id": f"2026010{i}T000000Z-abc{i}", "mode": "short",
                         "kind": "summary", "scenario": "send", "target": tg, "rps": rps, "p50_us": 100.0,
                         "p99_us": 400.0, "p999_us": 800.0, "errors": 0, "runs": 1})
             for i in range(2) for tg, rps in (("rmqfast", 90000 + i), ("direct", 150000))]
    (bench / "bench-1.jsonl").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory, spark: Any) -> dict[str, Any]:  # noqa: F811
    d = tmp_path_factory.mktemp("browser-records")
    _write_demo_like_records(d)
    out = d.parent / "browser-report"
    summary = analyze([str(d)], out, spark=spark, quiet=True)
    return {"dir": d, "out": out, "summary": summary, "html": (out / "report.html").read_text()}


def test_report_renders_in_headless_chromium(report: dict[str, Any]) -> None:
    out: Path = report["out"]
    page = out / "report_probe.html"  # same directory: the charts' relative paths resolve as in report.html
    page.write_text(report["html"] + PROBE, encoding="utf-8")
    r = _browser(["--virtual-time-budget=10000", "--dump-dom", page.as_uri()])
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r'<pre id="probe">(.*?)</pre>', r.stdout, re.S)
    assert m, f"the page did not finish loading in chromium; stderr: {r.stderr[-2000:]}"
    probe = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    imgs = probe["imgs"]
    want = set(report["summary"]["charts"])
    assert {Path(i["src"]).stem for i in imgs} == want and len(want) >= 10, (imgs, want)
    broken = [i for i in imgs if not (i["complete"] and i["w"] > 100 and i["h"] > 100)]
    assert not broken, f"chart images that did not load in the browser: {broken}"
    assert probe["tables"] == probe["captions"] > 10

    shot = out / "screenshot.png"
    r = _browser(["--window-size=1280,4000", f"--screenshot={shot}", (out / "report.html").as_uri()])
    assert r.returncode == 0 and shot.is_file(), r.stderr[-2000:]
    from PIL import Image

    with Image.open(shot) as im:
        gray = im.convert("L")
        w, h = gray.size
        dark = sum(gray.histogram()[:128])
    assert (w, h) == (1280, 4000)
    assert dark > w * h * 0.01, f"screenshot looks blank: {dark} dark pixels of {w * h}"


def test_report_names_codes_captions_and_expected_answers(report: dict[str, Any]) -> None:
    html = report["html"]
    assert "SEND_MESSAGE_V2 (310)" in html and "GET_ROUTEINFO_BY_TOPIC (105)" in html
    assert "TOPIC_NOT_EXIST (17)" in html and "SYSTEM_ERROR (1)" in html
    assert html.count("<table>") == html.count("<table><caption>") > 10
    assert html.count("<img ") == html.count("<figcaption>")
    # expected answers have a chart of their own; the errors chart holds only the real error
    assert "charts/agg_expected.png" in html and "charts/agg_errors.png" in html
    tables = report["out"] / "tables"
    import csv

    with open(tables / "agg_responses_by_code.csv") as f:
        resp = {(r["role"], int(r["code"])): r for r in csv.DictReader(f)}
    assert resp[("namesrv", 17)]["errors"] == "0" and resp[("namesrv", 17)]["expected"] == "10"
    assert resp[("broker", 1)]["errors"] == "1" and resp[("broker", 1)]["expected"] == "0"


def test_chart_series_gaps_and_silent_series() -> None:
    rows = [{"bucket": 100, "k": "a", "v": 2.0}, {"bucket": 130, "k": "a", "v": 4.0},
            {"bucket": 100, "k": "zero", "v": 0.0}, {"bucket": 110, "k": "zero", "v": 0.0}]
    axis, drawn, silent = chart_series(rows, lambda r: r["k"], "v", 10)
    assert axis == [100, 110, 120, 130]
    assert drawn == {"a": [2.0, 0.0, 0.0, 4.0]}  # a rate: missing buckets are 0, never bridged
    assert silent == ["zero"]  # not drawn, so no legend entry
    axis, drawn, _ = chart_series(rows, lambda r: r["k"], "v", 10, level=True)
    a = drawn["a"]
    assert a[0] == 2.0 and math.isnan(a[1]) and math.isnan(a[2]) and a[3] == 4.0  # a level: line broken
    assert chart_series([{"bucket": 5, "k": "z", "v": 0}], lambda r: r["k"], "v", 1)[1] == {}


def test_small_and_large_paths_give_the_same_tables(report: dict[str, Any], spark: Any) -> None:  # noqa: F811
    """Small inputs regroup one collected table on the driver, large ones regroup in Spark: same
    tables either way."""
    inputs = find_inputs([str(report["dir"])])
    small = run_all(spark, inputs, small=True).tables
    large = run_all(spark, inputs, small=False).tables
    assert small.keys() == large.keys()
    for name in small:
        a, b = small[name], large[name]
        assert len(a) == len(b), name
        for ra, rb in zip(a, b, strict=True):
            assert ra.keys() == rb.keys(), name
            for k, v in ra.items():  # float sums may differ in the last bits (order of addition)
                assert v == (pytest.approx(rb[k]) if isinstance(v, float) else rb[k]), (name, k, ra, rb)
