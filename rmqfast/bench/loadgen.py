"""One run of the load generator (``bench/loadgen.c``), with the CPU it and others used."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Sequence
from typing import Any

from rmqfast.bench.cbuild import Tools
from rmqfast.bench.common import BenchError
from rmqfast.bench.procfs import machine_cpu, total_cpu
from rmqfast.bench.scenarios import Scenario


def run_loadgen(tools: Tools, port: int, sc: Scenario, *, warmup: float, duration: float,
                cpu_groups: dict[str, Sequence[int]] | None = None) -> dict[str, Any]:
    """Run the load generator once and return its JSON.

    With ``cpu_groups`` (name -> pids), ``cpu`` is added: per group the user and system CPU
    seconds spent during the measured window (sampled when the warm-up ends and when loadgen
    exits) and the cores that makes.
    """
    cmd = [str(tools.loadgen), "--port", str(port), *sc.loadgen_args(),
           "--warmup", f"{warmup:g}", "--duration", f"{duration:g}"]
    groups = cpu_groups or {}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(warmup)
    t0 = time.monotonic()
    cpu0 = {name: total_cpu(pids) for name, pids in groups.items()}
    machine0 = machine_cpu()
    try:
        out, err = proc.communicate(timeout=warmup + duration + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise BenchError(f"loadgen did not finish: {' '.join(cmd)}") from None
    window = time.monotonic() - t0
    cpu1 = {name: total_cpu(pids) for name, pids in groups.items()}
    machine1 = machine_cpu()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        raise BenchError(f"loadgen printed no result (exit {proc.returncode}): {' '.join(cmd)}\n{err}")
    result: dict[str, Any] = json.loads(lines[-1])
    if proc.returncode != 0 or "error" in result:
        raise BenchError(f"loadgen failed (exit {proc.returncode}): {result.get('error', err)}")
    cpu: dict[str, Any] = {"window_s": round(window, 3)}
    ours = result["cpu_user_s"] + result["cpu_sys_s"]
    for name in groups:
        user = cpu1[name][0] - cpu0[name][0]
        system = cpu1[name][1] - cpu0[name][1]
        ours += user + system
        cpu[name] = {"user_s": round(user, 3), "sys_s": round(system, 3),
                     "cores": round((user + system) / window, 3) if window > 0 else 0.0}
    cpu["loadgen"] = {"user_s": result["cpu_user_s"], "sys_s": result["cpu_sys_s"],
                      "cores": round((result["cpu_user_s"] + result["cpu_sys_s"]) / window, 3) if window else 0.0}

    def rate(x: float) -> float:
        return round(x / window, 3) if window > 0 else 0.0

    task = machine1["task"] - machine0["task"]
    # "other_cores": process time that is neither the target's, the null broker's nor
    # loadgen's: other processes on the machine (a noisy neighbour shows up here).
    cpu["machine"] = {"task_cores": rate(task), "irq_cores": rate(machine1["irq"] - machine0["irq"]),
                      "steal_cores": rate(machine1["steal"] - machine0["steal"]),
                      "other_cores": rate(max(0.0, task - ours))}
    result["cpu"] = cpu
    return result
