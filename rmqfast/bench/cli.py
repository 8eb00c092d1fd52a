"""``rmqfast bench`` / ``python -m rmqfast.bench``: options, and which mode runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rmqfast.bench.common import DEFAULT_RESULTS_DIR, guarded
from rmqfast.bench.scenarios import ALL_TARGETS, FULL, SCENARIOS, SHORT


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="rmqfast bench",
        description="Direct vs HAProxy vs rmqfast (compiled and pure Python) against a null broker, side by side.",
        epilog="Scenarios: " + "; ".join(f"{s.name}: {s.what}" for s in SCENARIOS.values()),
    )
    ap.add_argument("--short", action="store_true", help="one round of 2 s runs, 3 scenarios (under a minute)")
    ap.add_argument("--rounds", type=int, help="rounds (default: 3 full, 1 short)")
    ap.add_argument("--duration", type=float, help="measured seconds per run (default: 8 full, 2 short)")
    ap.add_argument("--warmup", type=float, help="warm-up seconds before each measured window (default: 2 / 0.5)")
    ap.add_argument("--scenarios", help=f"comma-separated, from {', '.join(SCENARIOS)}")
    ap.add_argument("--targets", help=f"comma-separated, from {', '.join(ALL_TARGETS)}")
    ap.add_argument("--workers", type=int, default=2, help="rmqfast worker processes (default 2)")
    ap.add_argument("--results", type=Path, default=DEFAULT_RESULTS_DIR, help="results folder (default results/bench)")
    ap.add_argument("--build-dir", type=Path, default=None, help="where the C tools are built (default build/bench)")
    ap.add_argument("--no-install", action="store_true", help="do not apt-get install haproxy when it is missing")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    ap.add_argument("--real", action="store_true",
                    help="real-broker mode instead: the Java producer against a real RocketMQ, direct vs rmqfast "
                         "(see rmqfast bench --real --help)")
    ap.add_argument("--failover", action="store_true",
                    help="broker-a killed (kill -9) and restarted under Java producers, through rmqfast and direct "
                         "(see rmqfast bench --failover --help)")
    ap.add_argument("--idle", action="store_true",
                    help="many mostly idle connections through one worker: RSS per connection and connection "
                         "setup rate, rmqfast vs HAProxy (see rmqfast bench --idle --help)")
    ap.add_argument("--hostile", action="store_true",
                    help="a steady client while idle floods, descriptor exhaustion, slowloris, gRPC half-prefaces "
                         "and an admin flood hit one worker (see rmqfast bench --hostile --help)")
    ap.add_argument("--clouds", action="store_true",
                    help="cross-cloud mode instead: durable vs fast copies between two real RocketMQ clusters "
                         "(see rmqfast bench --clouds --help)")
    ap.add_argument("--report", type=Path, metavar="FILE",
                    help="run nothing: print the summary of an earlier results file (.jsonl)")
    args = ap.parse_args(argv)
    mode = SHORT if args.short else FULL
    args.rounds = args.rounds or mode.rounds
    args.duration = args.duration or mode.duration
    args.warmup = mode.warmup if args.warmup is None else args.warmup
    args.scenario_list = args.scenarios.split(",") if args.scenarios else list(mode.scenarios)
    args.target_list = args.targets.split(",") if args.targets else list(mode.targets)
    for s in args.scenario_list:
        if s not in SCENARIOS:
            ap.error(f"--scenarios: {s!r} is not one of {', '.join(SCENARIOS)}")
    for t in args.target_list:
        if t not in ALL_TARGETS:
            ap.error(f"--targets: {t!r} is not one of {', '.join(ALL_TARGETS)}")
    if args.rounds < 1 or args.duration <= 0 or args.warmup < 0 or args.workers < 1:
        ap.error("--rounds and --workers must be >= 1, --duration > 0, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the bench mode ``argv`` asks for; the process exit status."""
    argv = sys.argv[1:] if argv is None else argv
    # The Java-producer modes have their own options; imported only when asked for.
    if "--real" in argv:
        from rmqfast.bench import real

        return real.main(argv)
    if "--clouds" in argv:
        from rmqfast.bench import clouds

        return clouds.main(argv)
    if "--hostile" in argv:
        from rmqfast.bench import hostile

        return hostile.main(argv)
    if "--idle" in argv:
        from rmqfast.bench import idleconns

        return idleconns.main(argv)
    if "--failover" in argv:
        from rmqfast.bench import failover

        return failover.main(argv)
    args = _parse(argv)
    if args.report:
        from rmqfast.bench.report import report

        def show() -> int:
            print(report(args.report))
            return 0

        return guarded("bench", show)
    from rmqfast.bench.run import run

    return guarded("bench", lambda: run(args))
