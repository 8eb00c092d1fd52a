"""``rmqfast delay cancel|stats``: cancel held delayed messages, see what the workers hold.

``cancel`` asks the running proxy's admin endpoint (``POST /delay/cancel``), or, with
``--state-dir`` (and ``--workers``), writes the cancel request beside the workers' stores itself.
``stats`` opens the workers' spill databases read-only (beside a running proxy).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("delay", help="cancel held delayed messages, or show what the workers hold")
    act = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    c = act.add_parser("cancel", help="cancel a pending delayed message by its msgId (UNIQ_KEY) or a key")
    g = c.add_mutually_exclusive_group(required=True)
    g.add_argument("--msg-id", help="the msgId the producer got (the message's UNIQ_KEY)")
    g.add_argument("--key", help="one of the message's keys (KEYS)")
    c.add_argument("--admin", default=os.environ.get("RMQFAST_ADMIN", "http://127.0.0.1:9400"),
                   help="admin endpoint URL (default $RMQFAST_ADMIN or http://127.0.0.1:9400)")
    c.add_argument("--token", default=os.environ.get("RMQFAST_ADMIN_TOKEN", ""),
                   help="admin.token, when the proxy has one (default $RMQFAST_ADMIN_TOKEN)")
    c.add_argument("--state-dir", help="write the request into proxy.state_dir directly (no admin endpoint)")
    c.add_argument("--workers", type=int, default=1, help="with --state-dir: how many workers must answer")
    s = act.add_parser("stats", help="held messages per worker (read-only, beside a running proxy)")
    s.add_argument("--state-dir", required=True, help="proxy.state_dir")


def _cancel(args: argparse.Namespace) -> int:
    if args.state_dir:
        from rmqfast.delay.cancel import request_cancel

        res = request_cancel(args.state_dir, msg_id=args.msg_id, key=args.key, workers=args.workers)
        print(json.dumps(res, indent=2))
        return 0 if res["complete"] else 1
    q = urllib.parse.urlencode({"msg_id": args.msg_id} if args.msg_id else {"key": args.key})
    # a change: the admin endpoint needs Content-Type: application/json (rmqfast.server.admin_names)
    req = urllib.request.Request(f"{args.admin.rstrip('/')}/delay/cancel?{q}", data=b"", method="POST",
                                 headers={"Content-Type": "application/json"})
    if args.token:
        req.add_header("Authorization", f"Bearer {args.token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            print(resp.read().decode())
            return 0
    except urllib.error.HTTPError as exc:
        print(f"rmqfast delay cancel: {exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"rmqfast delay cancel: cannot reach {args.admin}: {exc}", file=sys.stderr)
        return 1


def _count_keys(db: Any, prefix: bytes) -> dict[bytes, int]:
    """Keys under ``prefix``, counted by their part before the last 16 bytes (due time, sequence)."""
    out: dict[bytes, int] = {}
    it = db.iter()
    it.seek(prefix)
    while it.valid():
        k = it.key()
        if not k.startswith(prefix):
            break
        out[k[:-16]] = out.get(k[:-16], 0) + 1
        it.next()
    return out


def _stats(args: argparse.Namespace) -> int:
    """Per worker: messages and bytes held (the store's counters), the next due time, the messages
    waiting for a broker that did not take its releases (by broker) and the dead letters (both
    counted by reading their keys)."""
    from rmqfast.delay.store import _STATS, DEAD_PREFIX, DUE_PREFIX, PARK_PREFIX, STATS_KEY, split_due_key
    from rmqfast.spill.cli import open_reader, spill_dirs

    rows = []
    for d in spill_dirs(args.state_dir):
        st = open_reader(d)
        try:
            raw = st.db.get(STATS_KEY)
            n, b = _STATS.unpack(raw) if raw else (0, 0)
            it = st.db.iter()
            it.seek(DUE_PREFIX)
            first = split_due_key(it.key())[0] if it.valid() and it.key().startswith(DUE_PREFIX) else None
            waiting = {p[3:].decode("utf-8", "replace"): c for p, c in _count_keys(st.db, PARK_PREFIX).items()}
            dead = sum(_count_keys(st.db, DEAD_PREFIX).values())
            rows.append({"worker": d.name, "messages": n, "bytes": b, "next_due_ms": first,
                         "waiting_for_broker": waiting, "dead_letters": dead})
        finally:
            st.close()
    print(json.dumps(rows, indent=2))
    return 0


def run(args: argparse.Namespace) -> int:
    return _cancel(args) if args.action == "cancel" else _stats(args)
