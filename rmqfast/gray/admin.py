"""``/gray`` on the admin endpoint and ``rmqfast gray status|promote|abort|reset GROUP``.

``GET /gray``: every configured group, its phase and the gray counters of the workers.
``POST /gray/promote?group=G``, ``/gray/abort?group=G``, ``/gray/reset?group=G`` (back to a running
canary): allowed like a limit change (``admin.token``, or a loopback endpoint and client).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from rmqfast.gray.config import GraySection
from rmqfast.gray.rules import phase
from rmqfast.gray.state import read_commands, state_path, write_command
from rmqfast.gray.watch import GrayWatch, behind_marks, drain_state

ACTIONS = {"promote": "promote", "abort": "abort", "reset": None}


def _counters(metrics_text: bytes) -> dict[str, dict[str, float]]:
    """rmqfast_gray_* samples by group: {group: {"name{side}": value}}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(metrics_text.decode("utf-8", "replace")):
        if not fam.name.startswith("rmqfast_gray_"):
            continue
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            g = s.labels.get("group", "")
            side = s.labels.get("side")
            key = s.name.removeprefix("rmqfast_gray_") + (f"{{{side}}}" if side else "")
            out.setdefault(g, {})[key] = out.get(g, {}).get(key, 0.0) + s.value
    return out


def view(cfg: Any, metrics_text: bytes | None = None, now: float | None = None,
         backlog: bool = False, watch: GrayWatch | None = None) -> dict[str, Any]:
    """The state of every configured group (``backlog``: with its gray queues' backlog, asked of the brokers)."""
    g: GraySection = cfg.gray
    now = time.time() if now is None else now
    cmds = read_commands(state_path(g.state_file, cfg.proxy.state_dir))
    counters = _counters(metrics_text) if metrics_text else {}
    groups = []
    for grp in g.groups:
        c = cmds.get(grp.group)
        action, at = (c["action"], c["at"]) if c else (None, 0.0)
        ph = phase(action, at, now, g.settle, c.get("drained_at") if c else None, g.drain_timeout)
        row: dict[str, Any] = {"group": grp.group, "topics": grp.topics, "gray_queues": grp.gray_queues,
                               "phase": ph.value, "action": action, "since": at or None,
                               "settle_left": max(0.0, round(at + g.settle - now, 1)) if action else 0.0,
                               "drain": drain_state(c), "counters": counters.get(grp.group, {})}
        if c is not None:
            row["drain_timeout_left"] = max(0.0, round(at + g.drain_timeout - now, 1)) if "drain" not in c else 0.0
            if "drained_at" in c:
                row["drained_after"] = round(c["drained_at"] - at, 1)
            if "backlog" in c:
                row["drain_backlog"] = c["backlog"]
            if "marks" in c:
                row["drain_marks"] = c["marks"]
        if watch is not None:
            row["backlog_last_read"] = last = watch.view(grp.group)
            if c is not None and "marks" in c and "drain" not in c and last is not None:
                row["drain_left"] = behind_marks(c["marks"], last)  # below the marks, not committed yet
        if backlog:
            from rmqfast.gray.backlog import gray_backlog

            row["backlog"] = gray_backlog(grp, [str(u) for u in cfg.namesrv.upstreams])
        groups.append(row)
    return {"settle": g.settle, "grace": g.grace, "groups": groups}


def admin_gray(handler: Any, method: str, path: str, query: str) -> tuple[int, dict[str, Any]]:
    """The admin endpoint's answer (status, JSON body) to ``GET /gray`` and ``POST /gray/ACTION?group=G``."""
    cfg = getattr(handler.backend, "cfg", None)
    if cfg is None:
        return 503, {"error": "the proxy's configuration is not available to the admin endpoint"}
    if method == "GET":
        try:
            text = handler.backend.metrics_text()
        except Exception:  # the state is still worth showing
            text = None
        return 200, view(cfg, text, backlog=urllib.parse.parse_qs(query).get("backlog", [""])[0] in ("1", "true"),
                         watch=getattr(handler.backend, "gray_watch", None))
    action = path.removeprefix("/gray/")
    if action not in ACTIONS:
        return 404, {"error": f"POST {path}: unknown path; use POST /gray/promote|abort|reset?group=GROUP"}
    refusal = handler.write_refusal()
    if refusal is not None:
        return refusal  # type: ignore[no-any-return]
    group = urllib.parse.parse_qs(query).get("group", [""])[0]
    if cfg.gray.group(group) is None:
        known = ", ".join(g.group for g in cfg.gray.groups) or "none"
        return 404, {"error": f"unknown gray group {group!r}; configured: {known}"}
    write_command(state_path(cfg.gray.state_file, cfg.proxy.state_dir), group, ACTIONS[action])
    return 200, view(cfg)


# Command line -----------------------------------------------------------------------------------------


def add_parser(sub: Any) -> None:
    p = sub.add_parser("gray", help="state of gray (canary) releases; promote or abort one (admin endpoint)")
    p.add_argument("--admin", default=os.environ.get("RMQFAST_ADMIN", "http://127.0.0.1:9400"),
                   help="admin endpoint URL (default $RMQFAST_ADMIN or http://127.0.0.1:9400)")
    p.add_argument("--token", default=os.environ.get("RMQFAST_ADMIN_TOKEN", ""),
                   help="admin.token, when the proxy has one (default $RMQFAST_ADMIN_TOKEN)")
    p.add_argument("--json", action="store_true", help="print the JSON answer")
    p.add_argument("--backlog", action="store_true",
                   help="status: also each gray queue's backlog (max offset - the group's committed offset)")
    p.add_argument("action", choices=("status", "promote", "abort", "reset"),
                   help="status; promote (gray consumers become the group); abort (normal consumers take the "
                        "gray queues); reset (back to a running canary)")
    p.add_argument("group", nargs="?", default="", help="consumer group (all groups for status)")


def render(v: dict[str, Any], only: str = "") -> str:
    lines = []
    for g in v["groups"]:
        if only and g["group"] != only:
            continue
        extra = f", {g['settle_left']} s of settle left" if g["settle_left"] else ""
        drain = g.get("drain")
        if drain == "draining":
            left = g.get("drain_left")
            below = f"; {left} message(s) below the marks not committed" if left is not None else ""
            extra += f", draining ({g.get('drain_timeout_left', 0)} s to the drain timeout{below})"
        elif drain == "drained":
            extra += f", drained after {g.get('drained_after', 0)} s"
        elif drain == "timeout":
            extra += f", drain timed out with {g.get('drain_backlog', 'an unknown number of')} message(s) left"
        lines.append(f"{g['group']}: {g['phase']}{extra} (topics {', '.join(g['topics'])}; "
                     f"last {g['gray_queues']} queue(s) per broker gray)")
        last = g.get("backlog_last_read")
        if last is not None and g.get("backlog") is None:
            lines.append(f"  backlog of the gray queues: {last['total']} (read {last['age']} s ago)")
        for k, val in sorted(g["counters"].items()):
            lines.append(f"  {k} {val:g}")
        b = g.get("backlog")
        if b is not None:
            if "error" in b:
                lines.append(f"  backlog: not known ({b['error']})")
            else:
                lines.append(f"  backlog of the gray queues: {b['total']}")
            for r in b["queues"]:
                lines.append(f"    {r['topic']} {r['broker']} queue {r['queue']}: {r['backlog']} "
                             f"(max {r['max']}, committed {r['committed']})")
    return "\n".join(lines) if lines else "no gray group configured" + (f" named {only!r}" if only else "")


def run(args: argparse.Namespace) -> int:
    base = args.admin.rstrip("/")
    if args.action == "status":
        req = urllib.request.Request(f"{base}/gray" + ("?backlog=1" if args.backlog else ""))
    else:
        if not args.group:
            print(f"rmqfast gray {args.action}: name the consumer group", file=sys.stderr)
            return 2
        q = urllib.parse.urlencode({"group": args.group})
        # a change: the admin endpoint needs Content-Type: application/json (rmqfast.server.admin_names)
        req = urllib.request.Request(f"{base}/gray/{args.action}?{q}", data=b"", method="POST",
                                     headers={"Content-Type": "application/json"})
    if args.token:
        req.add_header("Authorization", f"Bearer {args.token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            v = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            why = json.loads(exc.read()).get("error", "")
        except ValueError:
            why = ""
        print(f"rmqfast gray {args.action}: HTTP {exc.code}: {why}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"rmqfast gray {args.action}: cannot reach {base}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(v, indent=2) if args.json else render(v, args.group))
    return 0
