"""Command line: ``rmqfast serve | check-config | demo | analyze``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rmqfast import __version__
from rmqfast import config as config_mod
from rmqfast import log as log_mod
from rmqfast.checkconfig import summary
from rmqfast.errors import ConfigError

DESCRIPTION = """\
rmqfast: a high-throughput proxy for Apache RocketMQ's Remoting protocol.

Point your clients' name-server address at rmqfast's name-server listener. rmqfast relays
to the real name servers, rewrites route answers so that every broker address maps to an
rmqfast endpoint, and relays each client connection to its broker frame by frame. Admin
request codes are refused by default.
"""

SERVE_EPILOG = """\
Flags override the config file. Examples:

  rmqfast serve --namesrv-listen 127.0.0.1:9876 --namesrv-upstream 10.0.0.1:9876
  rmqfast serve --config /etc/rmqfast/rmqfast.toml --workers 4
  rmqfast serve --namesrv-upstream 10.0.0.1:9876 \\
      --broker 0.0.0.0:30911=10.0.0.1:10911 --advertise-host 192.168.1.10 \\
      --namesrv-listen 0.0.0.0:9876 --admin-listen 127.0.0.1:9400

Signals: SIGTERM/SIGINT drain and stop (exit 0); SIGHUP reloads the config file.
Admin endpoint (--admin-listen): /metrics (Prometheus), /healthz, /readyz.
"""


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    o: dict[str, Any] = {
        "namesrv.listen": args.namesrv_listen,
        "namesrv.upstreams": args.namesrv_upstream or None,
        "brokers.port_range": args.broker_port_range,
        "proxy.workers": args.workers,
        "proxy.advertise_host": args.advertise_host,
        "proxy.state_dir": args.state_dir,
        "admin.listen": args.admin_listen,
        "log.format": args.log_format,
        "log.level": args.log_level,
    }
    if args.broker:
        static = []
        for spec in args.broker:
            listen, sep, upstream = spec.partition("=")
            if not sep:
                raise ConfigError(
                    f"--broker: {spec!r} is not allowed; expected LISTEN=UPSTREAM, e.g. 0.0.0.0:30911=10.0.0.1:10911"
                )
            static.append({"listen": listen, "upstream": upstream})
        o["brokers.static"] = static
    return o


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", metavar="FILE", help="TOML config file (see docs/configuration.md)")
    p.add_argument(
        "--namesrv-listen", metavar="H:P", help="where clients reach the name-server proxy (default 127.0.0.1:9876)"
    )
    p.add_argument(
        "--namesrv-upstream",
        metavar="H:P",
        action="append",
        help="a real name server; repeat for several (failover in order)",
    )
    p.add_argument(
        "--broker",
        metavar="LISTEN=UPSTREAM",
        action="append",
        help="a static broker endpoint, e.g. 0.0.0.0:30911=10.0.0.1:10911; repeatable",
    )
    p.add_argument(
        "--broker-port-range",
        metavar="A-B",
        help="ports for brokers the routes reveal (default 30900-30999; '' disables)",
    )
    p.add_argument("--advertise-host", metavar="HOST", help="host written into rewritten routes")
    p.add_argument("--workers", type=int, metavar="N", help="worker processes (default: one per usable CPU)")
    p.add_argument("--admin-listen", metavar="H:P", help="admin HTTP endpoint: /metrics /healthz /readyz")
    p.add_argument("--state-dir", metavar="DIR", help="where the broker endpoint table is kept")
    p.add_argument("--log-format", choices=("json", "human"), help="log format (default json)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="rmqfast", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--version", action="version", version=f"rmqfast {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="run the proxy (supervisor + workers)",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_serve_flags(serve)

    check = sub.add_parser(
        "check-config",
        help="validate a config file (and flags): every error at once, or a short summary of what it sets up",
        description="Validate a config file given as FILE or --config FILE (and the flags, as `serve` reads "
                    "them): every error at once, or a summary of every part it sets up.",
    )
    check.add_argument("file", metavar="FILE", nargs="?", help="the TOML config file (or --config FILE)")
    check.add_argument("--json", action="store_true", help="on success print the validated configuration as JSON")
    _add_serve_flags(check)

    spill = sub.add_parser(
        "spill",
        help="show the cross-cloud backlog in the spill directories (stopped or running proxy)",
    )
    spill.add_argument("what", choices=("stats", "inspect"), help="stats: backlog per lane; inspect: the copies")
    spill.add_argument("--config", "-c", metavar="FILE", help="the proxy's config file (for proxy.state_dir)")
    spill.add_argument("--state-dir", metavar="DIR", help="proxy.state_dir (overrides --config)")
    spill.add_argument("--limit", type=int, default=20, help="inspect: at most this many copies (default 20)")
    spill.add_argument("--remote", help="inspect: only this remote cloud")
    spill.add_argument("--topic", help="inspect: only this topic")
    spill.add_argument("--json", action="store_true", help="JSON output")

    demo = sub.add_parser(
        "demo",
        help="start a local RocketMQ (Maven Central jars), rmqfast in front, real traffic, a report",
    )
    demo.add_argument("--messages", type=int, default=2000, help="messages to send (default 2000)")
    demo.add_argument("--workers", type=int, default=2, help="proxy worker processes (default 2)")
    demo.add_argument("--keep-running", action="store_true", help="leave everything running until Ctrl-C")

    from rmqfast.limits import cli as limits_cli

    limits_cli.add_parser(sub)
    from rmqfast.delay import cli as delay_cli

    delay_cli.add_parser(sub)
    from rmqfast.gray import admin as gray_admin

    gray_admin.add_parser(sub)

    # The bench has its own parser (rmqfast.bench); `rmqfast bench ...` hands it the rest of argv.
    sub.add_parser(
        "bench",
        help="benchmarks side by side: direct vs HAProxy vs rmqfast (null broker), or --real (real RocketMQ)",
        add_help=False,
    )
    analyze = sub.add_parser(
        "analyze",
        help="Spark report (HTML, PNG charts, Parquet/CSV tables) from traffic records and benchmark results",
    )
    from rmqfast.analytics.report import add_arguments

    add_arguments(analyze)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from rmqfast.bench.cli import main as bench_main

        return bench_main(argv[1:])
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command is None:
        ap.print_help()
        return 2
    # commands that talk to a running proxy's admin endpoint: their module's run(args)
    runners = {"limits": "rmqfast.limits.cli", "delay": "rmqfast.delay.cli", "gray": "rmqfast.gray.admin"}
    if args.command in runners:
        import importlib

        return int(importlib.import_module(runners[args.command]).run(args))
    if args.command == "demo":
        from rmqfast.demo import run_demo

        return run_demo(messages=args.messages, workers=args.workers, keep_running=args.keep_running)

    if args.command == "analyze":
        from rmqfast.analytics.report import run_cli

        return run_cli(args)

    if args.command == "spill":
        return _spill(args)

    ok, path = _config_path(args)
    if not ok:
        return 2

    def load() -> config_mod.Config:
        return config_mod.load(path, _overrides(args))

    try:
        cfg = load()
    except ConfigError as exc:
        errors = getattr(exc, "errors", None)
        if errors:
            where = f" in {path}" if path else ""
            print(f"rmqfast: invalid configuration{where} ({len(errors)} errors):", file=sys.stderr)
            for e in errors:
                print(f"  {e}", file=sys.stderr)
        else:
            print(f"rmqfast: invalid configuration: {exc}", file=sys.stderr)
        return 2
    if args.command == "check-config":
        if args.json:
            print(cfg.to_json())
        else:
            print(summary(path, cfg))
        return 0

    log_mod.setup(cfg.log.format, cfg.log.level)
    from rmqfast.server.supervisor import Supervisor

    try:
        return Supervisor(cfg, load).run()
    except ConfigError as exc:
        print(f"rmqfast: {exc}", file=sys.stderr)
        return 2


def _config_path(args: argparse.Namespace) -> tuple[bool, str | None]:
    """(False, None) when two different files are named, else (True, the config file or None);
    ``check-config`` takes FILE or --config FILE."""
    path: str | None = args.config
    if args.command == "check-config" and args.file is not None:
        if path is not None and path != args.file:
            print(f"rmqfast check-config: two config files given ({args.file} and --config {path}); "
                  "name one, as FILE or as --config FILE", file=sys.stderr)
            return False, None
        path = args.file
    return True, path


def _spill(args: argparse.Namespace) -> int:
    from rmqfast.spill import cli as spill_cli
    from rmqfast.spill.store import SpillError

    state_dir = args.state_dir
    if state_dir is None:
        try:
            raw = config_mod.load_file(args.config) if args.config else {}
        except ConfigError as exc:
            print(f"rmqfast: {exc}", file=sys.stderr)
            return 2
        state_dir = (raw.get("proxy") or {}).get("state_dir", config_mod.ProxySection().state_dir)
    try:
        if args.what == "stats":
            return spill_cli.stats(state_dir, as_json=args.json)
        return spill_cli.inspect(state_dir, limit=args.limit, remote=args.remote, topic=args.topic, as_json=args.json)
    except SpillError as exc:
        print(f"rmqfast spill: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
