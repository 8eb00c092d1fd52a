"""Scale benchmark of the Spark report: N synthetic per-request records -> full report.

    python bench/spark_scale.py [--records 10000000] [--dir DIR] [--keep] [--codec gzip|none]

Generates the records (Parquet, the workers' writer and schema; plus one hour of
per-second aggregates for 4 workers and, when present, results/bench) and then times
``rmqfast.analytics.analyze`` on them end to end: Spark session start, reading, every job,
charts, HTML and tables.  Target: 10 million records in under 60 s on a 2-core
machine.  Prints records/s and seconds, and one JSON line with the figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rmqfast.analytics import analyze  # noqa: E402
from rmqfast.analytics.synth import write_aggregates, write_samples  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=10_000_000, help="sampled records to generate (default 10M)")
    ap.add_argument("--per-file", type=int, default=1_000_000, help="records per file (default 1M)")
    ap.add_argument("--dir", help="where to generate (default: a temporary directory); reused if it has data")
    ap.add_argument("--codec", choices=("gzip", "none"), default="gzip")
    ap.add_argument("--keep", action="store_true", help="keep the generated records and the report")
    ap.add_argument("--no-bench", action="store_true", help="leave results/bench out of the report")
    ap.add_argument("--master", help="Spark master (default local[*])")
    args = ap.parse_args(argv)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="rmqfast-spark-scale-"))
    recs = base / "records"
    t0 = time.monotonic()
    if not (recs / "sample").is_dir():
        files = write_samples(recs, args.records, per_file=args.per_file, codec=args.codec)
        write_aggregates(recs, codec=args.codec)
        gen = time.monotonic() - t0
        size = sum(f.stat().st_size for f in files)
        print(f"generated {args.records:,} records in {len(files)} files ({size / 1e6:.0f} MB) in {gen:.1f} s")
    inputs = [str(recs)]
    bench = REPO / "results" / "bench"
    if bench.is_dir() and not args.no_bench:
        inputs.append(str(bench))
    t1 = time.monotonic()
    s = analyze(inputs, base / "report", master=args.master)
    total = time.monotonic() - t1
    n = s["counts"].get("sample_records", 0)
    print(f"analysed {n:,} sampled records (+ {s['counts'].get('agg_rows', 0):,} aggregate rows, "
          f"{s['counts'].get('bench_runs', 0)} benchmark runs) into the full report in {total:.1f} s "
          f"(Spark jobs {s['jobs_seconds']:.1f} s): {n / total:,.0f} records/s")
    print(f"target: < 60 s for 10M records: {'met' if total < 60 and n >= 10_000_000 else 'NOT met'}")
    print(json.dumps({"bench": "spark_scale", "records": n, "seconds": round(total, 2),
                      "jobs_seconds": s["jobs_seconds"], "records_per_s": round(n / total), "codec": args.codec,
                      "report": s["report"]}))
    if not args.keep and not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
