"""Finding and checking the input files of the Spark jobs.

A records tree holds (any depth): ``agg-*.parquet|jsonl``, ``sample-*.parquet|jsonl`` (the
proxy's traffic records, docs/records.md) and ``bench-*.jsonl`` (rmqfast.bench results).
Hidden files (``.*``, ``_*``) are what a writer has not finished yet, or what a crash left
behind: they are listed as incomplete and never read.  Every Parquet file is checked for its
magic and footer before Spark sees it; one that fails is reported as corrupt and skipped.

Paths without a scheme (or ``file:``) are walked with the standard library; any other URI
(``hdfs://``, ``s3a://``...) through the Hadoop FileSystem API of the Spark session, so the
same job runs unchanged on a cluster.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from rmqfast.records.parquet import check_file


@dataclass
class Inputs:
    agg: list[str] = field(default_factory=list)
    sample: list[str] = field(default_factory=list)
    bench: list[str] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)
    corrupt: list[tuple[str, str]] = field(default_factory=list)  # (path, why)
    ignored: int = 0
    total_bytes: int = 0  # of the files to read (local inputs only; 0 for remote ones)

    def problems(self) -> list[tuple[str, str]]:
        return [(p, "incomplete (temporary file of a writer: still open, or left by a crash); skipped")
                for p in self.incomplete] + [(p, f"corrupt: {why}; skipped") for p, why in self.corrupt]


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file:")


def _local_path(uri: str) -> str:
    if uri.startswith("file://"):
        return uri[len("file://"):]
    if uri.startswith("file:"):
        return uri[len("file:"):]
    return uri


def _classify(inp: Inputs, path: str, name: str, reader: Any) -> None:
    if name.startswith((".", "_")):
        if name.endswith(".tmp"):
            inp.incomplete.append(path)
        else:
            inp.ignored += 1
        return
    if name.startswith("bench-") and name.endswith(".jsonl"):
        inp.bench.append(path)
        _add_size(inp, path)
        return
    if name.startswith("agg-"):
        target = inp.agg
    elif name.startswith("sample-"):
        target = inp.sample
    else:
        inp.ignored += 1
        return
    if name.endswith(".parquet"):
        why = reader(path)
        if why is not None:
            inp.corrupt.append((path, why))
            return
    elif not name.endswith(".jsonl"):
        inp.ignored += 1
        return
    target.append(path)
    _add_size(inp, path)


def _add_size(inp: Inputs, path: str) -> None:
    if is_local(path):
        try:
            inp.total_bytes += os.path.getsize(_local_path(path))
        except OSError:
            pass  # reported when Spark reads it


def _check_local(path: str) -> str | None:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(4)
            if size >= 8:
                f.seek(size - 8)
            tail = f.read(8)
    except OSError as exc:
        return f"cannot read it ({exc.strerror})"
    return check_file(head, tail, size)


def find_inputs(roots: list[str], spark: Any = None) -> Inputs:
    """Walk every root (a directory or a single file) and classify what is there."""
    inp = Inputs()
    for root in roots:
        if is_local(root):
            base = _local_path(root)
            if os.path.isfile(base):
                _classify(inp, os.path.abspath(base), os.path.basename(base), _check_local)
                continue
            if not os.path.isdir(base):
                raise FileNotFoundError(f"records directory {root!r} does not exist; pass the records.dir of the "
                                        "proxy (or a copy of it), or results/bench for benchmark results")
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "_")))
                for name in sorted(filenames):
                    _classify(inp, os.path.abspath(os.path.join(dirpath, name)), name, _check_local)
        else:
            if spark is None:
                raise ValueError(f"{root!r}: a remote path needs a Spark session")
            _walk_hadoop(inp, root, spark)
    return inp


def _walk_hadoop(inp: Inputs, root: str, spark: Any) -> None:
    jvm = spark.sparkContext._jvm
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    path = jvm.org.apache.hadoop.fs.Path(root)
    fs = path.getFileSystem(conf)
    if not fs.exists(path):
        raise FileNotFoundError(f"records directory {root!r} does not exist")

    def reader_for(size: int) -> Any:
        def check(p: str) -> str | None:
            stream = fs.open(jvm.org.apache.hadoop.fs.Path(p))
            try:
                buf = spark.sparkContext._gateway.new_array(jvm.byte, 8)
                stream.readFully(0, buf, 0, 4)
                head = bytes(b & 0xFF for b in list(buf)[:4])
                stream.readFully(max(0, size - 8), buf, 0, 8)
                tail = bytes(b & 0xFF for b in list(buf))
            finally:
                stream.close()
            return check_file(head, tail, size)
        return check

    it = fs.listFiles(path, True)
    while it.hasNext():
        st = it.next()
        p = st.getPath()
        parts = str(p.toUri().getPath()).split("/")
        if any(x.startswith((".", "_")) for x in parts[:-1] if x):
            continue
        _classify(inp, str(p), p.getName(), reader_for(int(st.getLen())))


#: A sampled record's ``ts`` must lie in [0, TS_MAX] (1970 to 2286). One that is not a time (NaN,
#: infinite, negative, absurdly far: a damaged file) would stretch the time buckets over
#: centuries and overflow the tables' 64-bit integers, so it is left out of every table and
#: counted as an input problem.
TS_MAX = 1e10


def ts_ok() -> Any:
    """True for a usable ``ts`` (Spark orders NaN above every number; a null gives null)."""
    from pyspark.sql import functions as F

    return F.col("ts").between(0, TS_MAX)


def bad_ts_problem(problems: list[tuple[str, str]], bad: int) -> None:
    if bad:
        problems.append(("sampled records", f"{bad} sampled record(s) whose timestamp is not a time "
                                            f"(NaN, infinite, negative or past {TS_MAX:.0e} s) skipped"))
