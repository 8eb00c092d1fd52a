"""The gRPC front process: ``python -P -m rmqfast.grpcfront.server --runtime DIR --lifeline FD``.

Each worker starts one (see :func:`spawn`): a gRPC server on an asyncio (uvloop) loop in a process
of its own, so the worker's gevent hub and the Remoting hot path share neither the GIL nor a loop
with gRPC.  ``[grpc] server`` picks it: "h2" (default), the libnghttp2 server of
:mod:`rmqfast.grpcfront.h2server`; "grpcio", grpc's asyncio server (``grpc.aio``).  Every such
process binds ``[grpc] listen`` with SO_REUSEPORT, so
the kernel spreads gRPC connections over them as it does Remoting ones over the workers.  The
process reads the validated configuration from ``DIR/config.json`` and exits when the lifeline
pipe (its worker's end) closes or on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("rmqfast.grpc")


def send_limiter(runtime: Path, limits: Any) -> Any:
    """``[limits]``: a limiter over the buckets the workers share (the supervisor's file), so gRPC sends
    and Remoting sends take the same tokens; None without rules.  Shape rules act as reject here (the
    front holds no backlog)."""
    from rmqfast.limits import SHM_NAME, open_limiter

    path = runtime / SHM_NAME
    rules = limits.limiter_rules()
    if not rules or not path.exists():
        return None
    lim = open_limiter(path)
    lim.configure(rules)
    return lim


async def serve(namesrvs: list[str], settings: Any, lifeline: int | None, limiter: Any = None,
                tls: Any = None, acl: Any = None) -> None:
    from rmqfast.grpcfront import protos
    from rmqfast.grpcfront.service import MessagingService

    pb = protos.load()
    svc = MessagingService(pb, namesrvs, settings, limiter, acl, tls)  # acl: [acl], checked per call
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if settings.server == "h2":
        close = await _serve_h2(svc, settings, tls)
    else:
        close = await _serve_grpcio(svc, settings, tls)
    log.info("gRPC front listening on %s%s (pid %d, server %s)", settings.listen, " (TLS)" if settings.tls else "",
             os.getpid(), settings.server)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    if lifeline is not None:
        loop.add_reader(lifeline, stop.set)  # readable = EOF: the worker is gone
    await stop.wait()
    await close(2.0)
    await svc.close()
    log.info("gRPC front stats: %s", json.dumps(vars(svc.stats), sort_keys=True))


async def _serve_grpcio(svc: Any, settings: Any, tls: Any) -> Callable[[float], Awaitable[Any]]:
    """``[grpc] server = "grpcio"``: grpc's asyncio server; returns its graceful stop."""
    server, _ = await grpcio_server(svc, settings, tls)
    return lambda grace: server.stop(grace=grace)


async def grpcio_server(svc: Any, settings: Any, tls: Any) -> tuple[Any, int]:
    """grpc's asyncio server on ``settings.listen``, started; and its port.  Its bounds are
    grpc core's: the TLS and HTTP/2 handshake (preface and SETTINGS) within ``handshake_timeout``, a
    connection with no call for ``idle_timeout`` gets GOAWAY, at most ``max_connections`` connections
    (grpc counts them from the accept, handshaken or not); it has no per-address cap."""
    import grpc

    server = grpc.aio.server(options=[
        ("grpc.so_reuseport", 1), ("grpc.max_receive_message_length", settings.max_body_size + (1 << 20)),
        ("grpc.server_handshake_timeout_ms", int(settings.handshake_timeout * 1000)),
        ("grpc.max_connection_idle_ms", int(settings.idle_timeout * 1000)),
        ("grpc.max_allowed_incoming_connections", settings.max_connections)])
    server.add_generic_rpc_handlers((svc.handler(),))
    if settings.tls:
        from rmqfast.grpcfront.settings import server_credentials

        port = server.add_secure_port(settings.listen, server_credentials(tls))
    else:
        port = server.add_insecure_port(settings.listen)
    if port == 0:
        raise OSError(f"cannot bind {settings.listen}")
    await server.start()
    return server, port


async def _serve_h2(svc: Any, settings: Any, tls: Any) -> Callable[[float], Awaitable[Any]]:
    """``[grpc] server = "h2"``: the nghttp2 server (rmqfast.grpcfront.h2server); returns its graceful stop."""
    from rmqfast.grpcfront.h2server import H2Server

    ctx = None
    if settings.tls:
        from rmqfast.proxy.tls import server_context

        ctx = server_context(tls.listen)
    server = H2Server(svc, settings.max_body_size, ctx, max_connections=settings.max_connections,
                      max_connections_per_client=settings.max_connections_per_client,
                      handshake_timeout=settings.handshake_timeout, idle_timeout=settings.idle_timeout)
    host, _, port = settings.listen.rpartition(":")
    await server.start(host.strip("[]"), int(port))
    return server.stop


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed (less CPU per call for the asyncio machinery under
    grpc.aio), unless ``RMQFAST_GRPC_LOOP=asyncio``; None: asyncio's own loop."""
    if os.environ.get("RMQFAST_GRPC_LOOP", "") == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rmqfast.grpcfront.server")
    ap.add_argument("--runtime", required=True)
    ap.add_argument("--lifeline", type=int)
    args = ap.parse_args(argv)
    from rmqfast import config as config_mod
    from rmqfast import log as log_mod

    cfg = config_mod.from_json((Path(args.runtime) / "config.json").read_text())
    with contextlib.suppress(Exception):
        log_mod.setup(cfg.log.format, cfg.log.level)
    namesrvs = [f"{u.host}:{u.port}" for u in cfg.namesrv.upstreams]
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(serve(namesrvs, cfg.grpc, args.lifeline, send_limiter(Path(args.runtime), cfg.limits),
                             cfg.tls, cfg.acl))
    except OSError as exc:
        log.error("gRPC front cannot start: %s", exc)
        return 3
    return 0


def spawn(runtime: str | Path) -> tuple[subprocess.Popen[bytes], int]:
    """Start the gRPC front process of the calling worker; returns it and the lifeline's write end
    (keep it open; closing it, or this process dying, stops the front)."""
    r, w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "rmqfast.grpcfront.server", "--runtime", str(runtime),
                                 "--lifeline", str(r)], pass_fds=(r,), start_new_session=False)
    except BaseException:
        os.close(w)
        raise
    finally:
        os.close(r)
    return proc, w


if __name__ == "__main__":
    sys.exit(main())
