"""Differential fuzzing of the records walk: compiled scanner, pure twin and the client's reading.

A records answer's body (pull, pop, query, view) is walked by ``ext/records.pxi`` and its twin
``rmqfast/codec/_records_py.py``, which patch the IPv4 store hosts in place.  For every input:

* both twins give the same ``(status, records, changed)`` and the same bytes after patching;
* a body that is not walked whole (REC_MISS, REC_BAD) is left exactly as it was;
* a body that is patched is read by a RocketMQ client (:func:`client_reading`, an independent
  model of Java's ``MessageDecoder.decodesBatch``, which reads each record field by field and
  never looks at TOTALSIZE) with every store host it delivers mapped, and with no byte changed
  that it reads as anything else (a body, a topic, properties).

The same bodies also go through both twins' ``FrameScanner`` as the answer of a tracked PULL,
fed in random chunks: the same events and forwarded bytes.  Inputs are store records of every
layout (V1/V2, IPv6 born or store host, compressed and inner-batch flags) and mutations aimed at
their length fields (TOTALSIZE, body, topic and properties lengths, sysFlag host bits), cuts,
splices and random bytes.

``python -m rmqfast.testing.records_fuzz --seconds 600`` runs it for longer than CI does.
"""

from __future__ import annotations

import argparse
import random
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any

from rmqfast import codec
from rmqfast.codec import _scan_py
from rmqfast.codec import codes as C
from rmqfast.codec.command import RemotingCommand, encode
from rmqfast.codec.msgaddr import host_bytes
from rmqfast.codec.store import (
    BORNHOST_V6_FLAG,
    COMPRESSED_FLAG,
    INNER_BATCH_FLAG,
    MAGIC_V1,
    MAGIC_V2,
    STOREHOST_V6_FLAG,
    StoreRecord,
    encode_records,
)

REAL = host_bytes("10.1.2.3", 10911)
OTHER = host_bytes("10.1.2.4", 10911)
UNKNOWN = host_bytes("10.9.9.9", 10911)
EP = host_bytes("127.0.0.1", 40001)
EP2 = host_bytes("127.0.0.1", 40002)
MAPPING = {REAL: EP, OTHER: EP2, EP: EP}
_HOSTS = {REAL: "10.1.2.3:10911", OTHER: "10.1.2.4:10911", UNKNOWN: "10.9.9.9:10911", EP: "127.0.0.1:40001"}

_I32 = struct.Struct(">i")
_I16 = struct.Struct(">h")
_I8 = struct.Struct(">b")


class Mismatch(AssertionError):
    """The twins disagree, or a patched body is not what a client reads as patched."""


@dataclass(frozen=True)
class ClientRecord:
    start: int
    end: int  # where the client's next record starts
    store_host: int  # offset of the IPv4 store host, -1 for IPv6


def client_reading(body: bytes, start: int, end: int) -> tuple[list[ClientRecord], int]:
    """The records a Java client delivers from ``body[start:end]`` and the offset where it stopped
    reading (``end`` when it read them all).  ``MessageDecoder.decode`` reads field by field (TOTALSIZE
    is only stored), a BufferUnderflow or any other exception ends the batch (``decodesBatch``
    breaks on a null); a non-positive body or properties length reads nothing, a negative topic
    length throws (``new byte[n]``), a host port outside 0..65535 throws (``InetSocketAddress``)."""
    out: list[ClientRecord] = []
    pos = start

    def need(at: int, n: int) -> None:
        if at + n > end:
            raise IndexError

    while pos < end:
        try:
            need(pos, 40)
            magic = _I32.unpack_from(body, pos + 4)[0] & 0xFFFFFFFF
            if magic not in (MAGIC_V1, MAGIC_V2):
                raise ValueError("magic")
            sys_flag = _I32.unpack_from(body, pos + 36)[0]
            at = pos + 48
            born = 16 if sys_flag & BORNHOST_V6_FLAG else 4
            need(at, born + 4)
            if not 0 <= _I32.unpack_from(body, at + born)[0] <= 0xFFFF:
                raise ValueError("born port")
            at += born + 4 + 8  # STORETIMESTAMP
            store = 16 if sys_flag & STOREHOST_V6_FLAG else 4
            need(at, store + 4)
            store_at = -1 if store == 16 else at
            if not 0 <= _I32.unpack_from(body, at + store)[0] <= 0xFFFF:
                raise ValueError("store port")
            at += store + 4 + 4 + 8  # RECONSUMETIMES, PREPARED TRANSACTION OFFSET
            need(at, 4)
            body_len = _I32.unpack_from(body, at)[0]
            at += 4
            if body_len > 0:
                need(at, body_len)
                at += body_len
            if magic == MAGIC_V1:
                need(at, 1)
                topic_len = _I8.unpack_from(body, at)[0]
                at += 1
            else:
                need(at, 2)
                topic_len = _I16.unpack_from(body, at)[0]
                at += 2
            if topic_len < 0:
                raise ValueError("topic length")
            need(at, topic_len)
            at += topic_len
            need(at, 2)
            props_len = _I16.unpack_from(body, at)[0]
            at += 2
            if props_len > 0:
                need(at, props_len)
                at += props_len
        except (IndexError, ValueError):
            return out, pos
        out.append(ClientRecord(pos, at, store_at))
        pos = at
    return out, pos


# --- inputs -----------------------------------------------------------------------------------


def _record(r: random.Random, i: int) -> StoreRecord:
    sys_flag = 0
    born, store = "192.168.0.9:5555", _HOSTS[r.choice([REAL, REAL, OTHER, EP, UNKNOWN])]
    if r.random() < 0.2:
        sys_flag |= BORNHOST_V6_FLAG
        born = "[::1]:5555"
    if r.random() < 0.15:
        sys_flag |= STOREHOST_V6_FLAG
        store = "[fe80::1]:10911"
    if r.random() < 0.15:
        sys_flag |= COMPRESSED_FLAG
    if r.random() < 0.1:
        sys_flag |= INNER_BATCH_FLAG
    magic = MAGIC_V2 if r.random() < 0.3 else MAGIC_V1
    topic = "T" * r.choice([0, 1, 5, 127] + ([128, 300] if magic == MAGIC_V2 else []))
    body = r.randbytes(r.choice([0, 1, 8, 40, 300]))
    props = {} if r.random() < 0.1 else {"UNIQ_KEY": f"U{i:030d}", "KEYS": "k" * r.choice([1, 3, 200])}
    return StoreRecord(topic=topic, body=body, properties=props, queue_id=i % 4, queue_offset=i,
                       commit_log_offset=1000 + 97 * i, sys_flag=sys_flag, born_timestamp=1, born_host=born,
                       store_timestamp=2, store_host=store, magic=magic)


def _offsets(body: bytes) -> list[int]:
    """Record starts by TOTALSIZE (of a well-formed body)."""
    out, pos = [], 0
    while pos + 4 <= len(body):
        total = _I32.unpack_from(body, pos)[0]
        if total <= 0:
            break
        out.append(pos)
        pos += total
    return out


def _length_fields(body: bytes, pos: int) -> dict[str, tuple[int, int]]:
    """name -> (offset, width) of the length fields of the well-formed record at ``pos``."""
    sys_flag = _I32.unpack_from(body, pos + 36)[0]
    at = pos + 48 + (16 if sys_flag & BORNHOST_V6_FLAG else 4) + 4 + 8
    store = at
    at += (16 if sys_flag & STOREHOST_V6_FLAG else 4) + 4 + 12
    body_len = at
    at += 4 + max(0, _I32.unpack_from(body, at)[0])
    topic_len = at
    v2 = (_I32.unpack_from(body, pos + 4)[0] & 0xFFFFFFFF) == MAGIC_V2
    tl = _I16.unpack_from(body, at)[0] if v2 else _I8.unpack_from(body, at)[0]
    props = at + (2 if v2 else 1) + max(0, tl)
    return {"total": (pos, 4), "magic": (pos + 4, 4), "sysflag": (pos + 36, 4), "storeport": (store + 4, 4),
            "body": (body_len, 4), "topic": (topic_len, 2 if v2 else 1), "props": (props, 2)}


def _put(buf: bytearray, at: int, width: int, value: int) -> None:
    fmt = {1: ">b", 2: ">h", 4: ">i"}[width]
    lo, hi = -(1 << (8 * width - 1)), (1 << (8 * width - 1)) - 1
    buf[at : at + width] = struct.pack(fmt, max(lo, min(hi, value)))


def mutate(r: random.Random, body: bytes) -> bytes:
    buf = bytearray(body)
    starts = _offsets(body)
    for _ in range(r.choice([1, 1, 1, 2, 3])):
        kind = r.random()
        if kind < 0.55 and starts:
            pos = r.choice(starts)
            try:
                fields = _length_fields(bytes(buf), pos)
            except struct.error:
                continue
            name = r.choice(sorted(fields))
            at, width = fields[name]
            if at + width > len(buf):
                continue
            old = int.from_bytes(buf[at : at + width], "big", signed=True)
            if name == "sysflag":
                _put(buf, at, 4, old ^ r.choice([BORNHOST_V6_FLAG, STOREHOST_V6_FLAG, 0x30, COMPRESSED_FLAG]))
            elif name == "magic":
                _put(buf, at, 4, r.choice([MAGIC_V1 - (1 << 32), MAGIC_V2 - (1 << 32), 0, -1]))
            else:
                delta = r.choice([-12, -4, -2, -1, 1, 2, 4, 12, 91, 1 << 20])
                new = r.choice([old + delta, -old, -1, 0, (1 << (8 * width - 1)) - 1, -(1 << (8 * width - 1))])
                _put(buf, at, width, new)
        elif kind < 0.7 and buf:
            i = r.randrange(len(buf))
            buf[i] = r.randrange(256)
        elif kind < 0.8 and buf:
            del buf[r.randrange(len(buf)) :]
        elif kind < 0.9:
            buf += r.randbytes(r.choice([1, 4, 91, 120]))
        elif starts:
            a = r.choice(starts)
            buf[a:a] = buf[a : a + r.choice([4, 40, 91, 200])]
    return bytes(buf)


def gen_body(r: random.Random) -> bytes:
    if r.random() < 0.03:
        return r.randbytes(r.choice([0, 10, 91, 200]))
    body = encode_records([_record(r, i) for i in range(r.choice([1, 1, 2, 3, 8]))])
    return body if r.random() < 0.3 else mutate(r, body)


# --- checks ------------------------------------------------------------------------------------


def _fill(m: Any) -> Any:
    amap = m.AddressMap()
    for k, v in MAPPING.items():
        amap.set(k, v)
    return amap


def check_walk(body: bytes, twins: list[Any], prefix: int = 0) -> int:
    """One body through every twin's walk (at offset ``prefix`` of a larger buffer); the status."""
    data = b"\x5a" * prefix + body
    results = []
    for m in twins:
        buf = bytearray(data)
        got = m.walk_store_hosts(buf, prefix, len(buf), _fill(m), True)
        results.append((tuple(got), bytes(buf)))
    if any(x != results[0] for x in results):
        raise Mismatch(f"twins disagree on body {body.hex()}: {[x[0] for x in results]}")
    (status, _seen, changed), out = results[0]
    if out[:prefix] != data[:prefix]:
        raise Mismatch("bytes before the body changed")
    patched = out[prefix:]
    if status != _scan_py.REC_OK:
        if patched != body:
            raise Mismatch(f"status {status} but the body changed: {body.hex()}")
        return status
    if changed != (patched != body):
        raise Mismatch(f"changed={changed} but the bytes say otherwise: {body.hex()}")
    recs, stop = client_reading(body, 0, len(body))
    allowed = set()
    for rec in recs:
        if rec.store_host < 0:
            continue
        raw = body[rec.store_host : rec.store_host + 8]
        want = MAPPING.get(raw)
        if want is None:
            raise Mismatch(f"patched body, but the client reads record {rec.start} with store host {raw.hex()} the "
                           f"map does not know (left to it as the real broker's): {body.hex()}")
        if patched[rec.store_host : rec.store_host + 8] != want:
            raise Mismatch(f"the client reads record at {rec.start} with store host "
                           f"{patched[rec.store_host:rec.store_host + 8].hex()}, not {want.hex()}: {body.hex()}")
        allowed.update(range(rec.store_host, rec.store_host + 8))
    for i in range(min(stop, len(body))):
        if patched[i] != body[i] and i not in allowed:
            raise Mismatch(f"byte {i} changed, which the client reads as no store host (records "
                           f"{[(x.start, x.end) for x in recs]}): {body.hex()}")
    return status


def _pull(opaque: int) -> bytes:
    return encode(RemotingCommand(code=C.PULL_MESSAGE, opaque=opaque, version=401,
                                  ext_fields={"topic": "T", "queueId": "0", "consumerGroup": "G"}))


def _answer(opaque: int, body: bytes) -> bytes:
    return encode(RemotingCommand(code=C.SUCCESS, opaque=opaque, flag=1, ext_fields={"nextBeginOffset": "3"},
                                  body=body))


def _feed(scanner: Any, data: bytes, cuts: list[int]) -> tuple[list[Any], bytes, bytes]:
    """Feed ``data`` to ``scanner`` as a relay does, one receive per piece; events and forwarded bytes."""
    events: list[Any] = []
    forwarded = bytearray()
    buf = bytearray()
    edges = [0, *cuts, len(data)]
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        buf += data[a:b]
        start = pos = 0
        while True:
            ev, x, y = scanner.scan(buf, pos, len(buf))
            forwarded += buf[start:x]
            start = x
            if ev == codec.EV_POLICY:
                events.append(("policy", bytes(buf[x:y]), scanner.records))
                forwarded += buf[x:y]
                start = pos = y
                continue
            if ev == codec.EV_ERROR:
                events.append(("error", scanner.error))
                return events, bytes(forwarded), bytes(buf)
            break
        del buf[:start]
    return events, bytes(forwarded), bytes(buf)


def _records_actions() -> bytes:
    table = bytearray(codec.CODE_SLOTS)
    table[_scan_py.code_slot(C.PULL_MESSAGE)] = _scan_py.ACTION_RECORDS
    return bytes(table)


def check_scanner(r: random.Random, bodies: list[bytes], twins: list[Any]) -> None:
    """The bodies as answers of tracked pulls (some opaques answered twice, some never asked),
    through every twin's scanner pair in the same random receives."""
    opaques = list(range(1, len(bodies) + 1))
    reqs = b"".join(_pull(o) for o in opaques)
    order = opaques[:]
    r.shuffle(order)
    if r.random() < 0.3:
        order.append(order[0])  # an answer to a request already answered: not walked
    if r.random() < 0.3:
        order.append(len(bodies) + 7)  # to a request never made
    answers = b"".join(_answer(o, bodies[(o - 1) % len(bodies)]) for o in order)
    cuts = sorted(r.sample(range(1, len(answers)), min(len(answers) - 1, r.choice([0, 1, 3, 20]))))
    out = []
    for m in twins:
        stats, inflight = m.ScanStats(), m.InFlight()
        c2u = m.FrameScanner(stats, actions=_records_actions(), inflight=inflight, direction=0)
        u2c = m.FrameScanner(stats, inflight=inflight, direction=1)
        u2c.address_map = _fill(m)
        got_reqs = _feed(c2u, reqs, [])
        got = _feed(u2c, answers, cuts)
        out.append((got_reqs, got, u2c.address_map.walked, u2c.address_map.rewritten, len(inflight)))
    if any(x != out[0] for x in out):
        raise Mismatch(f"scanner twins disagree (answers {answers.hex()}, cuts {cuts})")
    events, forwarded, rest = out[0][1]
    if rest or len(forwarded) != len(answers):
        raise Mismatch(f"scanner held or lost bytes: {len(forwarded)} of {len(answers)} forwarded, {len(rest)} held")


def twins() -> list[Any]:
    """The pure twin and, when built, the compiled one."""
    cm = codec.compiled_twin()
    return [_scan_py] + ([cm] if cm is not None else [])


def run(seconds: float = 2.0, seed: int | None = None, max_cases: int | None = None) -> dict[str, int]:
    """Fuzz for ``seconds`` (or ``max_cases`` bodies); raise :class:`Mismatch` on the first finding."""
    seed = random.randrange(1 << 30) if seed is None else seed
    r = random.Random(seed)
    ts = twins()
    counts = {"cases": 0, "ok": 0, "miss": 0, "bad": 0, "scanned": 0, "seed": seed, "twins": len(ts)}
    deadline = time.monotonic() + seconds
    names = {_scan_py.REC_OK: "ok", _scan_py.REC_MISS: "miss", _scan_py.REC_BAD: "bad"}
    while time.monotonic() < deadline and (max_cases is None or counts["cases"] < max_cases):
        bodies = [gen_body(r) for _ in range(r.choice([1, 1, 2, 4]))]
        for body in bodies:
            try:
                counts[names[check_walk(body, ts, r.choice([0, 0, 13]))]] += 1
            except Mismatch as exc:
                raise Mismatch(f"seed {seed}, case {counts['cases']}: {exc}") from None
            counts["cases"] += 1
        try:
            check_scanner(r, bodies, ts)
        except Mismatch as exc:
            raise Mismatch(f"seed {seed}, case {counts['cases']}: {exc}") from None
        counts["scanned"] += len(bodies)
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    try:
        counts = run(args.seconds, args.seed)
    except Mismatch as exc:
        print(f"MISMATCH: {exc}", file=sys.stderr)
        return 1
    print(" ".join(f"{k}={v}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
