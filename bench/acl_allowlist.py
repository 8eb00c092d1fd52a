"""What the ``[acl]`` topic allowlist costs (rmqfast.proxy.acl, rmqfast.filters.acl).

Starts the null broker and two ``rmqfast serve`` (2 workers each, one static endpoint to the null
broker, ``policy.message_addresses = "off"`` so answers stay in C in both): ``off`` without
``[acl]``, ``on`` with ``[acl] topics = { benchAK = ["BenchTopic"] }``.  Every request the load
generator sends carries ``AccessKey`` and a Signature-sized value (``loadgen --access-key``), so
both proxies relay the same bytes; with the allowlist the sends and pulls leave the compiled
path for the filter (full header decode, AccessKey and topic check), and are all allowed.
Rotating the order, each round runs:

* ``send``: 1 KiB SEND_MESSAGE_V2, 16 connections x 32 in flight;
* ``pull``: PULL_MESSAGE answered with 16 x 1 KiB records, 16 connections x 4 in flight.

Printed per run: answers/s, p99 and the workers' CPU per request (user + system from /proc over
the measured window); then the medians.  A measurement, not a test::

    .venv/bin/python bench/acl_allowlist.py [--rounds 3] [--duration 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

from rmqfast.bench.cbuild import build_tools
from rmqfast.bench.nullbroker import NullBroker
from rmqfast.bench.procfs import total_cpu
from rmqfast.bench.staticproxy import start_static_proxy

SCENARIOS = {
    "send": ["--conns", "16", "--inflight", "32", "--body", "1024"],
    "pull": ["--conns", "16", "--inflight", "4", "--pull-pct", "100"],
}
ACCESS_KEY = "benchAK"
MODES = {"off": "", "on": f'[acl]\ntopics = {{ {ACCESS_KEY} = ["BenchTopic"] }}\n'}




def start_proxy(mode: str, broker_port: int) -> tuple[subprocess.Popen[bytes], int, list[int], object]:
    return start_static_proxy(f"aclbench-{mode}", broker_port, MODES[mode])


def run(loadgen: Path, port: int, args: list[str], workers: list[int], warmup: float, duration: float) -> dict:
    cmd = [str(loadgen), "--port", str(port), *args, "--access-key", ACCESS_KEY,
           "--warmup", f"{warmup:g}", "--duration", f"{duration:g}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(warmup)
    u0, s0 = total_cpu(workers)
    out, err = proc.communicate(timeout=warmup + duration + 60)
    u1, s1 = total_cpu(workers)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"loadgen failed ({proc.returncode}): {err[-2000:]}")
    res = json.loads(lines[-1])
    res["worker_cpu_s"] = (u1 - u0) + (s1 - s0)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    args = ap.parse_args()
    tools = build_tools()
    modes = list(MODES)
    rows = []
    with NullBroker(tools) as nb:
        proxies = {m: start_proxy(m, nb.port) for m in modes}
        try:
            for r in range(args.rounds):
                for sname, sargs in SCENARIOS.items():
                    for m in (modes if r % 2 == 0 else modes[::-1]):
                        _, port, workers, _ = proxies[m]
                        res = run(tools.loadgen, port, sargs, workers, args.warmup, args.duration)
                        answers = res["rps"] * res["duration_s"]
                        row = {"round": r, "scenario": sname, "mode": m, "rps": round(res["rps"]),
                               "p99_us": res["lat_us"]["p99"], "errors": res["errors"],
                               "worker_cpu_us_per_req": round(1e6 * res["worker_cpu_s"] / max(answers, 1), 1)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
        finally:
            for proc, *_ in proxies.values():
                proc.terminate()
                proc.wait()
    print("\nmedian worker CPU us per request (answers/s, p99 us):")
    for sname in SCENARIOS:
        for m in modes:
            sel = [x for x in rows if x["scenario"] == sname and x["mode"] == m]
            cpu = sorted(x["worker_cpu_us_per_req"] for x in sel)[len(sel) // 2]
            rps = sorted(x["rps"] for x in sel)[len(sel) // 2]
            p99 = sorted(x["p99_us"] for x in sel)[len(sel) // 2]
            print(f"  {sname:5} acl {m:4} {cpu:7.1f} us  ({rps} /s, p99 {p99} us)")


if __name__ == "__main__":
    main()
