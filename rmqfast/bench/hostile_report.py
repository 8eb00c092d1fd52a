"""What ``rmqfast bench --hostile`` makes of its measurements: silent gaps, the truth of health,
the steady client's success and p99, worker memory, and the goals met or missed."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

#: Printed goals (issue 30): the steady client's success while attacked, its p99 against quiet,
#: the longest time any listener answered nobody, worker RSS (64 MB + bytes per held connection).
GOAL_SUCCESS = 0.999
GOAL_P99_RATIO = 2.0
GOAL_SILENT_S = 1.0
GOAL_RSS_BYTES = 64_000_000
#: Bytes of worker RSS per held connection, as docs/benchmarks.md measured them (``rmqfast bench
#: --idle``, 9,850 idle connections through one worker: 2,210 bytes per connection).
DOC_BYTES_PER_CONN = 2210
#: Half the width of the window in which a listener's probes decide whether it accepts (s).
TRUTH_WINDOW = 0.5


def _done(recs: list[list[Any]]) -> list[list[Any]]:
    """Probes that finished (those cut by the end of the prober say nothing)."""
    return [r for r in recs if r[2] != "unfinished"]


def silent_gap(recs: list[list[Any]], a: float, b: float) -> dict[str, Any]:
    """The longest stretch of [a, b] in which no probe of one listener got an answer."""
    inside = [r for r in _done(recs) if a <= r[0] <= b]
    answers = sorted(r[1] for r in _done(recs) if r[1] is not None and a <= r[1] <= b)
    marks = [a, *answers, b]
    gap, at = 0.0, a
    for x, y in zip(marks, marks[1:], strict=False):
        if y - x > gap:
            gap, at = y - x, x
    statuses: dict[str, int] = {}
    for r in inside:
        if r[1] is None:
            key = str(r[2]).split(":")[0] if str(r[2]).startswith("connect") else str(r[2])
            statuses[key] = statuses.get(key, 0) + 1
    return {"probes": len(inside), "answered": sum(1 for r in inside if r[1] is not None),
            "unanswered_by_reason": statuses, "longest_silent_s": round(gap, 3), "silent_from": round(at - a, 3)}


def recovery_s(recs: list[list[Any]], t: float) -> float | None:
    """Seconds from ``t`` until a probe started at or after ``t`` was answered (None: never)."""
    ok = [r[1] for r in _done(recs) if r[0] >= t and r[1] is not None]
    return round(min(ok) - t, 3) if ok else None


def accepting(recs: list[list[Any]], t: float) -> bool | None:
    """Whether the listener answered a probe started within TRUTH_WINDOW of ``t`` (None: no probe)."""
    near = [r for r in _done(recs) if abs(r[0] - t) <= TRUTH_WINDOW]
    if not near:
        return None
    return any(r[1] is not None for r in near)


def healthz_truth(recs: list[list[Any]], alive: list[tuple[float, bool]], a: float, b: float) -> dict[str, Any]:
    """``/healthz`` answers in [a, b] against the truth (the supervisor and a worker alive, from /proc)."""
    out = {"probes": 0, "ok_200": 0, "refused_or_503": 0, "unanswered": 0, "false": 0}
    for r in _done(recs):
        if not a <= r[0] <= b:
            continue
        out["probes"] += 1
        truth = _alive_at(alive, r[0])
        if r[1] is None:
            out["unanswered"] += 1
            out["false"] += 1 if truth else 0
            continue
        code = r[2][0] if isinstance(r[2], list) else None
        if code == 200:
            out["ok_200"] += 1
            out["false"] += 0 if truth else 1
        else:
            out["refused_or_503"] += 1
            out["false"] += 1 if truth else 0
    return out


def _alive_at(alive: list[tuple[float, bool]], t: float) -> bool:
    state = True
    for ts, ok in alive:
        if ts > t:
            break
        state = ok
    return state


def readyz_truth(readyz: list[list[Any]], listeners: dict[str, list[list[Any]]], a: float, b: float) -> dict[str, Any]:
    """``/readyz`` in [a, b] against the truth: ready exactly while every Remoting and gRPC listener
    answers its probes (:func:`accepting`).  ``present`` is False when the endpoint answers 404."""
    out: dict[str, Any] = {"probes": 0, "present": None, "ready": 0, "not_ready": 0, "unanswered": 0,
                           "false_ready": 0, "false_not_ready": 0, "reasons": {}}
    for r in _done(readyz):
        if not a <= r[0] <= b:
            continue
        out["probes"] += 1
        if r[1] is None or not isinstance(r[2], list):
            out["unanswered"] += 1
            continue
        code, body = r[2]
        if code == 404:
            out["present"] = False
            continue
        out["present"] = True
        truth = [accepting(recs, r[0]) for recs in listeners.values()]
        if None in truth:
            continue  # no probe of some listener near this moment: nothing to compare with
        ready_truth = all(truth)
        if code == 200:
            out["ready"] += 1
            out["false_ready"] += 0 if ready_truth else 1
        else:
            out["not_ready"] += 1
            out["false_not_ready"] += 1 if ready_truth else 0
            reason = _reason(body)
            out["reasons"][reason] = out["reasons"].get(reason, 0) + 1
    return out


def _reason(body: str) -> str:
    import json

    try:
        obj = json.loads(body)
        return str(obj["reason"] if "reason" in obj else f"refused: {obj.get('error', '?')}")[:120]
    except (ValueError, AttributeError):
        return body[:80] or "?"


def steady(res: dict[str, Any]) -> dict[str, Any]:
    """The steady client's run (loadgen's JSON).

    Every request ends one way: answered SUCCESS, answered with another code, lost (its slot was
    needed again), skipped (its connection was dead or its send buffer full: loadgen does not send
    it) or still in flight when the window closed.  success = SUCCESS / all of them, where the
    requests in flight at the end count as failed beyond one second's worth of the rate (a client
    stalled for more than a second at the very end is caught; the normal in-flight tail is not).
    """
    d = res["error_detail"]
    ok = res["responses"] - d["bad_code"]
    late = max(0, res["outstanding_at_end"] - int(res.get("rate", 0)))
    failed = d["bad_code"] + d["lost"] + res.get("skipped", 0) + late
    total = ok + failed
    return {"sent": res["sent"], "ok": ok, "failed": failed, "skipped": res.get("skipped", 0),
            "success": round(ok / total, 6) if total else 0.0,
            "p50_ms": round(res["lat_us"]["p50"] / 1000, 3), "p99_ms": round(res["lat_us"]["p99"] / 1000, 3),
            "p999_ms": round(res["lat_us"]["p999"] / 1000, 3), "max_ms": round(res["lat_us"]["max"] / 1000, 3),
            "rps": res["rps"], "errors": res["errors"], "error_detail": d,
            "outstanding_at_end": res["outstanding_at_end"], "resp_codes": res["resp_codes"],
            "other_cores": res.get("cpu", {}).get("machine", {}).get("other_cores"),
            "cores": {k: v["cores"] for k, v in res.get("cpu", {}).items() if isinstance(v, dict) and "cores" in v}}


def rss_verdict(samples: list[dict[str, Any]], base_fds: int) -> dict[str, Any]:
    """Worker RSS against 64 MB + DOC_BYTES_PER_CONN per held connection, at its worst sample.

    Held connections = (worker descriptors - those before any load) / 2: a relayed connection
    holds two (client and upstream), so a connection the proxy has not connected upstream yet
    counts as half: the budget is, if anything, tight."""
    worst: dict[str, Any] | None = None
    for s in samples:
        if s["rss_kib"] == 0:
            continue  # the worker was gone (counted apart by the bench)
        held = max(0, s["fds"] - base_fds) // 2
        budget = GOAL_RSS_BYTES + DOC_BYTES_PER_CONN * held
        over = s["rss_kib"] * 1024 - budget
        if worst is None or over > worst["over_bytes"]:
            worst = {"rss_mib": round(s["rss_kib"] / 1024, 1), "held_conns": held,
                     "budget_mib": round(budget / 2**20, 1), "over_bytes": over, "t": s["t"]}
    peak = max((s["rss_kib"] for s in samples), default=0)
    return {"peak_rss_mib": round(peak / 1024, 1), "worst": worst,
            "max_fds": max((s["fds"] for s in samples), default=0), "base_fds": base_fds}


@dataclass
class Goal:
    """One printed goal (field names differ from ``rmqfast bench``'s ``check`` lines on purpose: the
    Spark report reads every results file of a folder into one schema)."""

    what: str
    measured: Any
    limit: str
    met: bool | None  # None: could not be measured (said why in measured)


def quiet_reference(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The quiet run the attacked one is held against: of the runs before and after the attack, the
    one with the lower p99 (the stricter comparison; a neighbour's burst can spoil one of them)."""
    return before if before["p99_ms"] <= after["p99_ms"] else after


def goals(quiet: dict[str, Any], attack: dict[str, Any], gaps: dict[str, dict[str, Any]],
          health: dict[str, Any], ready: dict[str, Any], rss: dict[str, Any]) -> list[Goal]:
    out = [Goal("steady success while attacked", attack["success"], f">= {GOAL_SUCCESS}",
                attack["success"] >= GOAL_SUCCESS)]
    if quiet["p99_ms"] > 0:
        ratio = round(attack["p99_ms"] / quiet["p99_ms"], 3)
        out.append(Goal("steady p99 attacked / quiet", ratio, f"<= {GOAL_P99_RATIO}", ratio <= GOAL_P99_RATIO))
    else:
        out.append(Goal("steady p99 attacked / quiet", "no quiet p99", f"<= {GOAL_P99_RATIO}", None))
    for name, g in gaps.items():
        out.append(Goal(f"{name}: longest silent", g["longest_silent_s"], f"<= {GOAL_SILENT_S} s",
                        g["longest_silent_s"] <= GOAL_SILENT_S))
    out.append(Goal("/healthz false answers (workers alive)", health["false"], "0", health["false"] == 0))
    if ready["present"] is False:
        out.append(Goal("/readyz false answers", "absent (404)", "0", None))
    else:
        wrong = ready["false_ready"] + ready["false_not_ready"]
        out.append(Goal("/readyz false answers", wrong, "0", wrong == 0 if ready["probes"] else None))
    w = rss["worst"]
    if w is None:
        out.append(Goal("worker RSS", "not sampled", "", None))
    else:
        out.append(Goal("worker RSS", f"{w['rss_mib']} MiB with {w['held_conns']:,} held",
                        f"<= {w['budget_mib']} MiB (64 MB + {DOC_BYTES_PER_CONN} B/conn)", w["over_bytes"] <= 0))
    return out


def goal_rows(found: list[Goal]) -> list[dict[str, Any]]:
    return [asdict(g) for g in found]


def render(r: dict[str, Any]) -> str:
    """The printed summary of one run (``r``: the summary line the bench writes)."""
    a, hp = r["steady"]["attack"], r["hostile_params"]
    lines = [f"hostile load against one rmqfast worker; steady client {hp['rate']:,.0f} msg/s over "
             f"{hp['steady_conns']} connections, {hp['duration']:g} s each: quiet, attacked, quiet again"
             " (p99 held against the lower quiet p99)",
             "attack: " + ", ".join(f"{k} {v:,}" for k, v in r["attack_sizes"].items()), ""]
    lines.append(f"{'steady client':<14} {'success':>9} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'msg/s':>9}  "
                 "cores: worker / supervisor / gRPC / others")
    for name, s in (("quiet", r["steady"]["quiet"]), ("attacked", a), ("quiet after", r["steady"]["quiet_after"])):
        c = s.get("cores", {})
        cores = " / ".join("-" if v is None else f"{v:.2f}" for v in (c.get("worker"), c.get("supervisor"),
                                                                      c.get("grpc"), s.get("other_cores")))
        lines.append(f"{name:<14} {s['success'] * 100:>8.3f}% {s['p50_ms']:>8.2f} {s['p99_ms']:>8.2f} "
                     f"{s['max_ms']:>8.1f} {s['rps']:>9,.0f}  {cores}")
    lines.append("(others: processes outside the proxy, the null broker and the steady client: attackers, prober, "
                 "neighbours)")
    lines += ["", f"{'listener':<10} {'phase':<9} {'probes':>7} {'answered':>9} {'silent max s':>12}  unanswered"]
    for lname, phases in r["listeners"].items():
        for ph, g in phases.items():
            why = ", ".join(f"{k} {v}" for k, v in g["unanswered_by_reason"].items()) or "-"
            lines.append(f"{lname:<10} {ph:<9} {g['probes']:>7} {g['answered']:>9} "
                         f"{g['longest_silent_s']:>12.3f}  {why}")
    rec = ", ".join(f"{k} {'never' if v is None else f'{v:.2f} s'}" for k, v in r["recovery_s"].items())
    lines += ["", f"answered again after the attackers closed: {rec}",
              f"prober timer late by up to {r['prober_late_s'] * 1000:.0f} ms (a starved prober inflates gaps)"]
    h, rd = r["healthz"], r["readyz"]
    lines.append(f"/healthz while attacked: {h['probes']} probes, {h['ok_200']} x 200, {h['refused_or_503']} other, "
                 f"{h['unanswered']} unanswered; false {h['false']}")
    if rd["present"] is False:
        lines.append("/readyz: absent (404)")
    else:
        lines.append(f"/readyz while attacked: {rd['ready']} ready, {rd['not_ready']} not ready, {rd['unanswered']} "
                     f"unanswered; false ready {rd['false_ready']}, false not-ready {rd['false_not_ready']}"
                     + (f"; reasons {rd['reasons']}" if rd["reasons"] else ""))
    m = r["rss"]
    lines.append(f"worker RSS: quiet {r['rss_quiet_mib']} MiB, peak {m['peak_rss_mib']} MiB, worker descriptors up to "
                 f"{m['max_fds']:,}; gRPC process peak {r.get('grpc_rss_mib', '-')} MiB")
    if m.get("worker_gone_samples"):
        lines.append(f"WARNING: the measured worker was gone in {m['worker_gone_samples']} RSS samples (it died; "
                     "a restarted worker has another pid and is not measured)")
    if m.get("after_recovery"):
        lines.append(f"worker RSS {r['hostile_params']['recovery']:g} s after the attackers closed: "
                     f"{m['after_recovery']['rss_mib']} MiB, {m['after_recovery']['fds']:,} descriptors")
    if m["worst"]:
        w = m["worst"]
        lines.append(f"worker RSS furthest over (or least under) its budget: {w['rss_mib']} MiB with "
                     f"{w['held_conns']:,} held connections, {w['t'] - r['attack_t0']:.1f} s after the attack began "
                     f"(it ended at {r['phases_s']['attacked']:.1f} s; sampled while attacked and after the recovery)")
    lines.append("load average at the start of quiet / attacked / quiet after: "
                 + " / ".join(f"{x:.1f}" for x in r.get("loadavg", [])))
    lines.append("attackers: " + "; ".join(
        f"{x['label']}: open at end {x['open_before_stop']:,} (connecting {x.get('connecting_before_stop', 0):,}), "
        f"opened {x['opened']:,}, closed by proxy "
        f"{x['peer_closed']:,} (p50 after {x['closed_after_s']['p50']} s), connect failed {x['connect_failed']:,}"
        + (f", answers {x['codes']}" if x.get("codes") else "")
        for x in r["attackers"]))
    if r.get("proxy_counters"):
        lines.append("proxy counters after the attack (/metrics): "
                     + ", ".join(f"{k} {v:,.0f}" if isinstance(v, float) else f"{k} {v}"
                                 for k, v in r["proxy_counters"].items()))
    lines += ["", "goals:"]
    for g in r["goals"]:
        mark = "n/a " if g["met"] is None else ("PASS" if g["met"] else "FAIL")
        lines.append(f"  {mark} {g['what']}: {g['measured']} (goal {g['limit']})")
    return "\n".join(lines)
