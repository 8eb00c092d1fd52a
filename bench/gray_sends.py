"""What ``[gray]`` costs on the send path (rmqfast.gray).

Starts the null broker, a stand-in name server that answers every route request with one broker
(``broker-a``, 8 queues) and three ``rmqfast serve`` (2 workers each, one static endpoint to the
null broker, ``policy.message_addresses = "off"``):

* ``off``: no ``[gray]``;
* ``other``: ``[gray]`` splits another topic: the sends of ``BenchTopic`` stay on the compiled
  path (the scanner hands only the sends of split topics to the gray filter);
* ``split``: ``[gray]`` splits ``BenchTopic`` and names the load generator's producer group gray:
  every send leaves the compiled path, is decoded, its queue id rewritten to a gray queue and the
  header encoded again.

Each round runs 1 KiB SEND_MESSAGE_V2, 16 connections x 32 in flight, against every proxy in
rotating order.  Printed per run: answers/s, p99, the workers' CPU per send; then the medians and
the throughput ratios against ``off``.  A measurement, not a test::

    .venv/bin/python bench/gray_sends.py [--rounds 3] [--duration 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from typing import Any

from rmqfast.bench.cbuild import build_tools
from rmqfast.bench.nullbroker import NullBroker
from rmqfast.bench.procfs import total_cpu
from rmqfast.bench.staticproxy import start_static_proxy
from rmqfast.testing.standins import FakeNameServer, StandInServer

SEND = ["--conns", "16", "--inflight", "32", "--body", "1024"]
GROUP = """
[gray]
[[gray.group]]
group = "bench-cg"
topics = ["{topic}"]
gray_queues = 2
producer_groups = ["PG_bench"]
"""
MODES = {"off": "", "other": GROUP.format(topic="OtherTopic"), "split": GROUP.format(topic="BenchTopic")}


def route_server(broker_port: int) -> StandInServer:
    """A name server answering route queries with broker-a (8 queues) at the null broker."""
    return FakeNameServer(route=json.dumps({
        "brokerDatas": [{"brokerName": "broker-a", "cluster": "c", "brokerAddrs": {"0": f"127.0.0.1:{broker_port}"}}],
        "queueDatas": [{"brokerName": "broker-a", "perm": 6, "readQueueNums": 8, "writeQueueNums": 8,
                        "topicSysFlag": 0}],
    }).encode())


def start_proxy(mode: str, broker_port: int, namesrv: str) -> tuple[subprocess.Popen[bytes], int, list[int], object]:
    return start_static_proxy(f"graybench-{mode}", broker_port, MODES[mode], namesrv=namesrv)


def run(loadgen: Path, port: int, workers: list[int], warmup: float, duration: float) -> dict[str, Any]:
    cmd = [str(loadgen), "--port", str(port), *SEND, "--warmup", f"{warmup:g}", "--duration", f"{duration:g}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(warmup)
    u0, s0 = total_cpu(workers)
    out, err = proc.communicate(timeout=warmup + duration + 60)
    u1, s1 = total_cpu(workers)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"loadgen failed ({proc.returncode}): {err[-2000:]}")
    res: dict[str, Any] = json.loads(lines[-1])
    res["worker_cpu_s"] = (u1 - u0) + (s1 - s0)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=4.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    args = ap.parse_args()
    tools = build_tools()
    modes = list(MODES)
    rows = []
    with NullBroker(tools) as nb:
        ns = route_server(nb.port)
        proxies = {m: start_proxy(m, nb.port, ns.addr) for m in modes}
        try:
            for r in range(args.rounds):
                for m in modes[r % len(modes):] + modes[: r % len(modes)]:
                    _, port, workers, _ = proxies[m]
                    res = run(tools.loadgen, port, workers, args.warmup, args.duration)
                    answers = res["rps"] * res["duration_s"]
                    row = {"round": r, "mode": m, "rps": round(res["rps"]), "p99_us": res["lat_us"]["p99"],
                           "errors": res["errors"],
                           "worker_cpu_us_per_send": round(1e6 * res["worker_cpu_s"] / max(answers, 1), 1)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            for proc, *_ in proxies.values():
                proc.terminate()
                proc.wait()
            ns.close()

    def median(mode: str, key: str) -> float:
        sel = sorted(x[key] for x in rows if x["mode"] == mode)
        return float(sel[len(sel) // 2])

    print("\nmedians: sends/s, p99 us, worker CPU us per send; throughput against off")
    base = median("off", "rps")
    for m in modes:
        rps = median(m, "rps")
        cpu = median(m, "worker_cpu_us_per_send")
        p99 = median(m, "p99_us")
        print(f"  gray {m:5} {rps:9.0f}/s  p99 {p99:7.0f} us  cpu {cpu:6.1f} us  ratio {rps / base:.3f}")


if __name__ == "__main__":
    main()
