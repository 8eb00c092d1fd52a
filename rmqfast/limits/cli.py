"""``rmqfast limits show|set|delete``: the send limits of a running proxy, over its admin endpoint."""

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
    p = sub.add_parser("limits", help="show or change the send limits of a running proxy (admin endpoint)")
    p.add_argument("--admin", default=os.environ.get("RMQFAST_ADMIN", "http://127.0.0.1:9400"),
                   help="admin endpoint URL (default $RMQFAST_ADMIN or http://127.0.0.1:9400)")
    p.add_argument("--token", default=os.environ.get("RMQFAST_ADMIN_TOKEN", ""),
                   help="admin.token, when the proxy has one (default $RMQFAST_ADMIN_TOKEN)")
    act = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    act.add_parser("show", help="the rules in force and what they admitted / rejected")
    s = act.add_parser("set", help="add or replace the rule of a topic (and tag)")
    s.add_argument("--topic", required=True, help="topic name, prefix* or *")
    s.add_argument("--tag", help="limit only messages with this tag")
    s.add_argument("--rate", type=float, default=0, help="messages per second (batches count every message)")
    s.add_argument("--burst", type=float, default=0, help="messages (default rate/10, at least 1)")
    s.add_argument("--bytes-rate", type=float, default=0, help="bytes per second")
    s.add_argument("--bytes-burst", type=float, default=0, help="bytes (default bytes-rate/10, at least 64 KiB)")
    s.add_argument("--mode", choices=("limit", "reject", "open", "shape"), default="limit",
                   help="limit: apply the rates; reject: answer every send SYSTEM_BUSY; open: no limit; "
                        "shape: accept over-limit sends into the spill and release them at the rate")
    d = act.add_parser("delete", help="remove the rule of a topic (and tag)")
    d.add_argument("--topic", required=True)
    d.add_argument("--tag")


def run(args: argparse.Namespace) -> int:
    base = args.admin.rstrip("/")
    if args.action == "show":
        req = urllib.request.Request(f"{base}/limits")
    elif args.action == "set":
        rule = {"topic": args.topic, "rate": args.rate, "burst": args.burst, "bytes_rate": args.bytes_rate,
                "bytes_burst": args.bytes_burst, "mode": args.mode}
        if args.tag is not None:
            rule["tag"] = args.tag
        req = urllib.request.Request(f"{base}/limits/rule", data=json.dumps(rule).encode(), method="PUT",
                                     headers={"Content-Type": "application/json"})
    else:
        q = {"topic": args.topic, **({"tag": args.tag} if args.tag is not None else {})}
        req = urllib.request.Request(f"{base}/limits/rule?{urllib.parse.urlencode(q)}", method="DELETE",
                                     headers={"Content-Type": "application/json"})  # changes must say JSON
    if args.token:
        req.add_header("Authorization", f"Bearer {args.token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            view = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            why = json.loads(exc.read()).get("error", "")
        except ValueError:
            why = ""
        print(f"rmqfast limits: {req.get_method()} {req.full_url}: HTTP {exc.code} {why}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"rmqfast limits: cannot reach the admin endpoint {base} ({exc}); is the proxy running, "
              "and is --admin its admin.listen?", file=sys.stderr)
        return 2
    print(render(view))
    return 0


def render(view: dict[str, Any]) -> str:
    rows = view.get("rules", [])
    if not rows:
        return "no send limits"
    head = (f"{'topic':<24} {'tag':<12} {'mode':<7} {'msg/s':>9} {'burst':>7} {'B/s':>11} "
            f"{'admitted':>10} {'rejected':>10} {'shaped':>10}")
    out = [head, "-" * len(head)]
    for r in rows:
        out.append(f"{r['topic']:<24} {r['tag'] or '':<12} {r['mode']:<7} {r['rate']:>9g} {r['burst']:>7g} "
                   f"{r['bytes_rate']:>11g} {r['admitted']:>10.0f} {r['rejected']:>10.0f} "
                   f"{r.get('shaped', 0):>10.0f}")
    return "\n".join(out)
