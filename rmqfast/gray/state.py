"""Promote/abort commands per group, in one small JSON file every worker reads.

``{"groups": {"GROUP": {"action": "promote" | "abort", "at": EPOCH_SECONDS}}}``: the workers
derive the phase from it (:func:`rmqfast.gray.rules.phase`) and look at the file's modification
time at most once a second, so a command applies in every worker within about a second.

The backlog watch of the supervisor (:mod:`rmqfast.gray.watch`) adds a promote's marks,
``"marks": [{"topic", "broker", "queue", "offset"}]`` (each gray queue's max offset when the watch
first saw the promote), and the outcome of a command's drain: ``"drain": "drained" | "timeout"``,
``"drained_at"`` (when a promote's committed offsets were seen at its marks, or an abort's gray queues
at backlog 0; a promote ends then) and ``"backlog"`` (what was left at a timeout: a promote's messages
below its marks not yet committed, an abort's backlog).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from rmqfast.log import ctx

log = logging.getLogger("rmqfast.gray")

ACTIONS = ("promote", "abort")
DRAIN_OUTCOMES = ("drained", "timeout")


def state_path(state_file: str, state_dir: str) -> Path:
    """``gray.state_file`` (relative to ``proxy.state_dir`` unless absolute), default ``<state_dir>/gray.json``."""
    return Path(state_dir) / (state_file or "gray.json")


def read_commands(path: Path) -> dict[str, dict[str, Any]]:
    """The commands in the file ({} when there is none); a damaged file counts as none, logged."""
    try:
        raw = json.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.error("gray state file unreadable; no promote/abort in effect", extra=ctx(path=str(path), error=str(exc)))
        return {}
    groups = raw.get("groups") if isinstance(raw, dict) else None
    if not isinstance(groups, dict):
        return {}
    out: dict[str, dict[str, Any]] = {}
    for g, c in groups.items():
        if isinstance(c, dict) and c.get("action") in ACTIONS and isinstance(c.get("at"), int | float):
            cmd: dict[str, Any] = {"action": c["action"], "at": float(c["at"])}
            marks = _marks(c.get("marks"))
            if marks is not None:
                cmd["marks"] = marks
            if c.get("drain") in DRAIN_OUTCOMES:
                cmd["drain"] = c["drain"]
                if isinstance(c.get("drained_at"), int | float) and not isinstance(c["drained_at"], bool):
                    cmd["drained_at"] = float(c["drained_at"])
                if isinstance(c.get("backlog"), int) and not isinstance(c["backlog"], bool):
                    cmd["backlog"] = c["backlog"]
            out[str(g)] = cmd
    return out


def _marks(raw: Any) -> list[dict[str, Any]] | None:
    if not isinstance(raw, list):
        return None
    out = []
    for m in raw:
        if not (isinstance(m, dict) and isinstance(m.get("topic"), str) and isinstance(m.get("broker"), str)
                and all(isinstance(m.get(k), int) and not isinstance(m.get(k), bool) for k in ("queue", "offset"))):
            return None  # damaged: the watch takes the marks again (later, so no smaller)
        out.append({"topic": m["topic"], "broker": m["broker"], "queue": m["queue"], "offset": m["offset"]})
    return out


def _write(path: Path, cur: dict[str, dict[str, Any]]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"groups": cur}, sort_keys=True), "utf-8")
    os.replace(tmp, path)


def write_command(path: Path, group: str, action: str | None, now: float | None = None) -> dict[str, Any]:
    """Record ``action`` (promote, abort; None: back to a running canary) for ``group``; atomic, locked."""
    if action is not None and action not in ACTIONS:
        raise ValueError(f"unknown gray action {action!r}; expected one of {', '.join(ACTIONS)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cur = read_commands(path)
        if action is None:
            cur.pop(group, None)
        else:
            cur[group] = {"action": action, "at": time.time() if now is None else now}
        _write(path, cur)
        return cur.get(group, {})


def set_marks(path: Path, group: str, action: str, at: float, marks: list[dict[str, Any]]) -> bool:
    """Record a promote's marks (each gray queue's max offset: ``topic``, ``broker``, ``queue``, ``offset``).
    Nothing is written (False) when the command in the file is another one by now or has marks already."""
    with open(path.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cur = read_commands(path)
        c = cur.get(group)
        if c is None or c["action"] != action or c["at"] != at or "marks" in c or "drain" in c:
            return False
        c["marks"] = [{"topic": str(m["topic"]), "broker": str(m["broker"]), "queue": int(m["queue"]),
                       "offset": int(m["offset"])} for m in marks]
        _write(path, cur)
        return True


def mark_drain(path: Path, group: str, action: str, at: float, outcome: str, when: float,
               backlog: int | None = None) -> bool:
    """Record the outcome of the drain of ``group``'s command (``action`` given at ``at``): ``drained``
    (seen at ``when``) or ``timeout``.  Nothing is written (False) when the command in the
    file is another one by now (a newer command, a reset) or already has an outcome."""
    if outcome not in DRAIN_OUTCOMES:
        raise ValueError(f"unknown drain outcome {outcome!r}; expected one of {', '.join(DRAIN_OUTCOMES)}")
    with open(path.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cur = read_commands(path)
        c = cur.get(group)
        if c is None or c["action"] != action or c["at"] != at or "drain" in c:
            return False
        c["drain"] = outcome
        if outcome == "drained":
            c["drained_at"] = when
        if backlog is not None:
            c["backlog"] = backlog
        _write(path, cur)
        return True


class Commands:
    """A worker's view of the file, refreshed at most once per ``interval`` seconds.

    With ``lead`` > 0 the view runs ``lead`` seconds behind the file: a version of the file counts
    from its modification time plus ``lead`` (the phase is then computed at ``now - lead``,
    :attr:`lead`), so every worker, having read it within ``lead``, switches at the same instant."""

    def __init__(self, path: Path, interval: float = 1.0, lead: float = 0.0) -> None:
        self.path = path
        self.interval = interval
        self.lead = lead
        self._checked = 0.0
        self._mtime: float | None = None
        self._cmds: dict[str, dict[str, Any]] = {}
        self._versions: list[tuple[float, dict[str, dict[str, Any]]]] = []  # (mtime, commands), oldest first

    def get(self, group: str) -> tuple[str | None, float]:
        c = self.command(group)
        return (c["action"], c["at"]) if c else (None, 0.0)

    def command(self, group: str) -> dict[str, Any] | None:
        """The group's command as :func:`read_commands` gives it (None: a running canary)."""
        now = time.monotonic()
        if now - self._checked >= self.interval:
            self._checked = now
            try:
                mtime: float | None = self.path.stat().st_mtime
            except OSError:
                mtime = None
            if mtime != self._mtime:
                self._mtime = mtime
                self._cmds = read_commands(self.path) if mtime is not None else {}
                self._versions = [*self._versions[-7:], (mtime or 0.0, self._cmds)]
        if self.lead <= 0 or not self._versions:
            return self._cmds.get(group)
        due = time.time() - self.lead
        cur: dict[str, dict[str, Any]] = self._versions[0][1]
        for mtime_, cmds in self._versions:
            if mtime_ <= due:
                cur = cmds
        return cur.get(group)
