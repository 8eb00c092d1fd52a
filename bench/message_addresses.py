"""What rewriting broker addresses inside messages costs (``policy.message_addresses``).

Starts the null broker and one ``rmqfast serve`` (2 workers) per mode (``off``, ``records``,
``all``), each with a static endpoint to the null broker and a port range, so the store host the
null broker writes in its pull records (127.0.0.1:10911) gets an endpoint of its own and is
really patched.  Then, rotating the order, runs the load generator against every proxy:

* ``pull``: pulls answered with 16 x 1 KiB records, 16 connections x 4 in flight;
* ``send``: 1 KiB sends, 16 connections x 32 in flight.

For each run it prints answers/s, p99 and the workers' CPU per request (user + system, from
/proc, during the measured window).  A measurement, not a test (no asserts)::

    .venv/bin/python bench/message_addresses.py [--rounds 3] [--duration 4] [--modes off,records,all]
"""

from __future__ import annotations

import argparse
import json
import subprocess

from rmqfast.bench.cbuild import build_tools
from rmqfast.bench.loadgen import run_loadgen
from rmqfast.bench.nullbroker import NullBroker
from rmqfast.bench.scenarios import Scenario
from rmqfast.bench.staticproxy import start_static_proxy

SCENARIOS = {
    "pull": Scenario("pull", conns=16, inflight=4, pull_pct=100, topics=1),
    "send": Scenario("send", conns=16, inflight=32),
}




def start_proxy(mode: str, broker_port: int) -> tuple[subprocess.Popen[bytes], int, list[int], object]:
    return start_static_proxy(f"msgaddr-{mode}", broker_port, message_addresses=mode, dynamic_ports=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--modes", default="off,records,all")
    args = ap.parse_args()
    modes = args.modes.split(",")
    tools = build_tools()
    rows = []
    with NullBroker(tools) as nb:
        proxies = {m: start_proxy(m, nb.port) for m in modes}
        try:
            for r in range(args.rounds):
                for sname, sc in SCENARIOS.items():
                    order = modes if r % 2 == 0 else modes[::-1]
                    for m in order:
                        _, port, workers, _ = proxies[m]
                        res = run_loadgen(tools, port, sc, warmup=args.warmup, duration=args.duration,
                                          cpu_groups={"workers": workers})
                        cpu = res["cpu"]["workers"]
                        cpu_s = cpu["user_s"] + cpu["sys_s"]
                        answers = res["rps"] * res["duration_s"]
                        row = {"round": r, "scenario": sname, "mode": m, "rps": round(res["rps"]),
                               "p99_us": res["lat_us"]["p99"], "errors": res["errors"],
                               "worker_cpu_us_per_req": round(1e6 * cpu_s / max(answers, 1), 1)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
        finally:
            for proc, *_ in proxies.values():
                proc.terminate()
                proc.wait()
    print("\nmedian worker CPU us per request (answers/s):")
    for sname in SCENARIOS:
        for m in modes:
            sel = sorted(x["worker_cpu_us_per_req"] for x in rows if x["scenario"] == sname and x["mode"] == m)
            rps = sorted(x["rps"] for x in rows if x["scenario"] == sname and x["mode"] == m)
            print(f"  {sname:5} {m:8} {sel[len(sel) // 2]:7.1f} us  ({rps[len(rps) // 2]} /s)")


if __name__ == "__main__":
    main()
