"""``rmqfast spill stats|inspect``: the cross-cloud backlog of a stopped or running proxy.

The spill directories are opened as RocksDB *secondary* instances (read-only, beside a running
worker: the one writer keeps writing) and fall back to a plain read-only open.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from rmqfast.codec.properties import parse_properties
from rmqfast.spill.record import CopyRecord
from rmqfast.spill.store import SpillError, SpillStore


def spill_dirs(state_dir: str | Path) -> list[Path]:
    root = Path(state_dir) / "spill"
    if not root.is_dir():
        raise SpillError(
            f"{root} does not exist: no spill under proxy.state_dir {str(state_dir)!r} (is it the right directory, "
            "and is [[clouds.remote]] configured?)"
        )
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("worker-")),
                  key=lambda p: int(p.name.split("-", 1)[1]) if p.name.split("-", 1)[1].isdigit() else 0)


def open_reader(path: Path) -> SpillStore:
    try:
        return SpillStore(path, access="secondary")
    except SpillError:
        return SpillStore(path, access="ro")


def stats(state_dir: str | Path, out: TextIO = sys.stdout, as_json: bool = False) -> int:
    rows: list[dict[str, Any]] = []
    for d in spill_dirs(state_dir):
        st = open_reader(d)
        try:
            for r in st.stats():
                rows.append({"worker": d.name, **r})
        finally:
            st.close()
    if as_json:
        out.write(json.dumps({"state_dir": str(state_dir), "lanes": rows}) + "\n")
        return 0
    if not rows:
        out.write(f"no backlog in {Path(state_dir) / 'spill'}\n")
        return 0
    out.write(f"{'worker':<10} {'remote':<16} {'topic':<32} {'messages':>10} {'bytes':>12} {'oldest(s)':>10}\n")
    for r in rows:
        age = "-" if r["oldest_age_s"] is None else f"{r['oldest_age_s']:.1f}"
        out.write(f"{r['worker']:<10} {r['remote']:<16} {r['topic']:<32} {r['messages']:>10} {r['bytes']:>12} "
                  f"{age:>10}\n")
    out.write(f"{'total':<60} {sum(r['messages'] for r in rows):>10} {sum(r['bytes'] for r in rows):>12}\n")
    return 0


def inspect(state_dir: str | Path, out: TextIO = sys.stdout, *, limit: int = 20, remote: str | None = None,
            topic: str | None = None, as_json: bool = False) -> int:
    now = time.time() * 1000
    shown = 0
    for d in spill_dirs(state_dir):
        st = open_reader(d)
        try:
            for r, t, seq, value in st.scan():
                if (remote and r != remote) or (topic and t != topic):
                    continue
                rec = CopyRecord.decode(value)
                props = parse_properties(rec.properties)
                row = {
                    "worker": d.name, "remote": r, "topic": t, "seq": seq, "queue_id": rec.queue_id,
                    "age_s": round((now - rec.created_ms) / 1000, 3), "uniq_key": props.get("UNIQ_KEY"),
                    "tags": props.get("TAGS"), "keys": props.get("KEYS"), "batch": rec.is_batch,
                    "body_bytes": len(rec.body),
                }
                out.write((json.dumps(row) if as_json else " ".join(f"{k}={v}" for k, v in row.items())) + "\n")
                shown += 1
                if shown >= limit:
                    return 0
        finally:
            st.close()
    if shown == 0 and not as_json:
        out.write("no copies match\n")
    return 0
