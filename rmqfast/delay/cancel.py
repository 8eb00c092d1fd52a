"""Cancel held messages by msgId or key, across the workers of a proxy.

Each worker owns its RocksDB (one writer), so a cancel is a request file that every worker
answers for its own store: ``<state_dir>/delay/cancel/<id>.req`` (JSON ``{"msg_id": ..., "key":
...}``), answered by ``<id>.w<N>.json`` per worker.  The admin endpoint (``POST
/delay/cancel?msg_id=...``) and ``rmqfast delay cancel`` write the request and wait for the
answers of every worker.  Requests and answers older than ten minutes are removed.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

STALE_S = 600.0


def cancel_dir(state_dir: str | Path) -> Path:
    return Path(state_dir) / "delay" / "cancel"


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def request_cancel(state_dir: str | Path, *, msg_id: str | None = None, key: str | None = None,
                   workers: int = 1, timeout: float = 10.0) -> dict[str, Any]:
    """Ask every worker to cancel; wait (bounded) for ``workers`` answers."""
    if bool(msg_id) == bool(key):
        raise ValueError("name exactly one of msg_id or key")
    d = cancel_dir(state_dir)
    d.mkdir(parents=True, exist_ok=True)
    rid = uuid.uuid4().hex
    _write_atomic(d / f"{rid}.req", {"msg_id": msg_id, "key": key, "at": time.time()})
    deadline = time.monotonic() + timeout
    answers: dict[int, dict[str, Any]] = {}
    while True:
        for p in d.glob(f"{rid}.w*.json"):
            try:
                a = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            answers[int(a.get("worker", -1))] = a
        if len(answers) >= workers or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    cancelled = [m for a in answers.values() for m in a.get("cancelled", [])]
    return {
        "request": rid,
        "msg_id": msg_id,
        "key": key,
        "cancelled": cancelled,
        "already_releasing": sum(int(a.get("already_releasing", 0)) for a in answers.values()),
        "workers_answered": sorted(answers),
        "complete": len(answers) >= workers,
    }


def answer_requests(state_dir: str | Path, index: int, seen: set[str],
                    cancel: Callable[..., dict[str, Any]]) -> int:
    """Apply the cancel requests this worker has not answered yet (a worker's poll)."""
    d = cancel_dir(state_dir)
    if not d.is_dir():
        return 0
    n = 0
    now = time.time()
    for p in d.glob("*.req"):
        rid = p.name[:-4]
        if rid in seen:
            continue
        try:
            req = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if now - float(req.get("at", now)) > STALE_S:
            for q in [p, *d.glob(f"{rid}.w*.json")]:
                q.unlink(missing_ok=True)
            continue
        out = d / f"{rid}.w{index}.json"
        seen.add(rid)
        if out.exists():  # answered by this worker slot before a restart
            continue
        res = cancel(msg_id=req.get("msg_id") or None, key=req.get("key") or None)
        _write_atomic(out, {**res, "worker": index})
        n += 1
    return n


def admin_cancel(handler: Any, query: str) -> tuple[int, dict[str, Any]]:
    """``POST /delay/cancel?msg_id=ID`` (or ``?key=KEY``) on the admin endpoint: (status, JSON body).

    Allowed like a limit change (``admin.token``, or a loopback endpoint and client).
    """
    from urllib.parse import parse_qs

    refusal = handler.write_refusal()
    if refusal is not None:
        return refusal  # type: ignore[no-any-return]
    q = parse_qs(query)
    msg_id, key = q.get("msg_id", [""])[0], q.get("key", [""])[0]
    if bool(msg_id) == bool(key):
        return 400, {"error": "POST /delay/cancel needs exactly one of ?msg_id=ID or ?key=KEY"}
    if len(msg_id.encode()) > MAX_ID_BYTES or len(key.encode()) > MAX_ID_BYTES:
        return 400, {"error": f"POST /delay/cancel: msg_id and key are at most {MAX_ID_BYTES} bytes"}
    cfg = getattr(handler.backend, "cfg", None)
    if cfg is None:
        return 503, {"error": "the proxy's configuration is not available to the admin endpoint"}
    if not cfg.delay.enabled:  # no worker reads requests: nothing held, nothing to wait for
        return 409, {"error": "POST /delay/cancel: [delay] is not enabled in this proxy's configuration "
                              "(no delay.topics), so no message is held"}
    if not _CANCELS.acquire(blocking=False):  # each waits up to CANCEL_WAIT: they must not hold every admin slot
        return 503, {"error": f"{MAX_CANCELS_AT_ONCE} cancels are already waiting for the workers; retry shortly"}
    try:
        res = request_cancel(cfg.proxy.state_dir, msg_id=msg_id or None, key=key or None,
                             workers=cfg.worker_count, timeout=CANCEL_WAIT)
    finally:
        _CANCELS.release()
    return (200 if res["complete"] else 504), res


#: A message id is 32 hex digits and keys are short; a request file is written per cancel.
MAX_ID_BYTES = 1024
#: How long a cancel waits for every worker's answer.
CANCEL_WAIT = 10.0
#: Cancels waiting for the workers at once (each holds an admin connection up to CANCEL_WAIT).
MAX_CANCELS_AT_ONCE = 4
_CANCELS = threading.BoundedSemaphore(MAX_CANCELS_AT_ONCE)
