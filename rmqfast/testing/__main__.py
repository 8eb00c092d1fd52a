"""``python -m rmqfast.testing``: build the jars and run a throw-away cluster until Ctrl-C."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Sequence

from rmqfast.testing.cluster import RocketMQCluster
from rmqfast.testing.maven import ensure_jars


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rmqfast.testing [--version 5|4] [--build-only] [--keep]``:
    builds the jars, starts a cluster, prints its addresses and waits for Ctrl-C."""
    ap = argparse.ArgumentParser(prog="python -m rmqfast.testing", description=main.__doc__)
    ap.add_argument("--version", choices=["5", "4"], default="5")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    ns = ap.parse_args(argv)
    t0 = time.monotonic()
    jars = ensure_jars(rocketmq4=ns.version == "4")
    print(f"jars ready in {time.monotonic() - t0:.1f} s: {jars.java_dir}", flush=True)
    if ns.build_only:
        return 0
    t0 = time.monotonic()
    with RocketMQCluster(version=ns.version, jars=jars, keep_workdir=ns.keep) as c:
        print(
            f"cluster up in {time.monotonic() - t0:.1f} s\n"
            f"  namesrv  {c.namesrv_addr}\n  broker   {c.broker_addr} "
            f"(vip {c.broker_vip_addr}, ha {c.broker_ha_port})\n  workdir  {c.workdir}\n"
            "Ctrl-C to stop.",
            flush=True,
        )
        with contextlib.suppress(KeyboardInterrupt):
            while c.broker_running and c.namesrv_running:
                time.sleep(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
