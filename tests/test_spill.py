"""The per-worker spill on real RocksDB (rocksdict) in temporary directories."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import gevent
import pytest

from rmqfast.spill import CopyRecord, GroupCommitter, SpillError, SpillStore
from rmqfast.spill.store import make_key, split_key


def rec(i: int, topic: str = "T", body: bytes | None = None) -> bytes:
    return CopyRecord(
        topic=topic,
        body=body if body is not None else f"body-{i}".encode(),
        properties=f"UNIQ_KEY\x01U{i}\x02idx\x01{i}\x02",
        queue_id=i % 4,
        born_timestamp=1700000000000 + i,
        created_ms=int(time.time() * 1000),
    ).encode()


def test_record_roundtrip_keeps_every_field() -> None:
    r = CopyRecord(
        topic="Tø", body=b"\x00\x01body", properties="UNIQ_KEY\x01abc\x02TAGS\x01a\x02", queue_id=3, sys_flag=1,
        born_timestamp=123, flag=7, reconsume_times=2, max_reconsume_times=5, broker_name="broker-a",
        producer_group="PG", kind=1, created_ms=99,
    )
    assert CopyRecord.decode(r.encode()) == r


def test_record_decode_errors_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="shorter than"):
        CopyRecord.decode(b"\x01\x00")
    data = bytearray(CopyRecord(topic="T", body=b"").encode())
    data[0] = 9
    with pytest.raises(ValueError, match="version 9 is not supported"):
        CopyRecord.decode(bytes(data))


def test_keys_order_lanes_and_sequences() -> None:
    keys = [make_key("b", "T", 256), make_key("b", "T", 1), make_key("b", "T2", 0), make_key("a", "T", 5)]
    assert [split_key(k) for k in sorted(keys)] == [("a", "T", 5), ("b", "T", 1), ("b", "T", 256), ("b", "T2", 0)]


def test_write_read_delete_and_reopen_resumes(tmp_path: Path) -> None:
    st = SpillStore(tmp_path / "w0")
    items = [("cloud-b", "T", st.next_seq(), rec(i)) for i in range(10)]
    items += [("cloud-b", "U", st.next_seq(), rec(i, "U")) for i in range(3)]
    st.write(items, sync=False)
    assert st.messages == 13
    got = st.read_lane("cloud-b", "T", -1, 100)
    assert [s for s, _ in got] == list(range(10))
    assert CopyRecord.decode(got[4][1]).properties.startswith("UNIQ_KEY\x01U4")
    st.delete([("cloud-b", "T", s, len(v)) for s, v in got[:6]])
    assert [s for s, _ in st.read_lane("cloud-b", "T", -1, 100)] == [6, 7, 8, 9]
    assert [s for s, _ in st.read_lane("cloud-b", "T", 7, 100)] == [8, 9]
    by_lane = {(x["remote"], x["topic"]): x for x in st.stats()}
    assert by_lane[("cloud-b", "T")]["messages"] == 4
    assert by_lane[("cloud-b", "U")]["messages"] == 3
    nbytes = st.bytes
    st.close()
    st2 = SpillStore(tmp_path / "w0")
    assert st2.messages == 7 and st2.bytes == nbytes
    assert st2.next_seq() == 13  # sequence recovered: new copies sort after the old ones
    assert [s for s, _ in st2.read_lane("cloud-b", "T", -1, 100)] == [6, 7, 8, 9]
    st2.delete_lane("cloud-b", "U")
    assert st2.read_lane("cloud-b", "U", -1, 10) == [] and st2.messages == 4
    st2.close()


def test_second_writer_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    st = SpillStore(tmp_path / "w0")
    try:
        with pytest.raises(SpillError, match=r"cannot open the spill database in .*w0 \(rw\).*one writer"):
            SpillStore(tmp_path / "w0")
    finally:
        st.close()


def test_secondary_reader_sees_a_running_writer(tmp_path: Path) -> None:
    st = SpillStore(tmp_path / "w0")
    st.write([("r", "T", st.next_seq(), rec(i)) for i in range(5)], sync=True)
    ro = SpillStore(tmp_path / "w0", access="secondary")
    try:
        assert ro.messages == 5
        assert [x["messages"] for x in ro.stats()] == [5]
    finally:
        ro.close()
        st.close()


def test_group_commit_batches_concurrent_producers(tmp_path: Path) -> None:
    st = SpillStore(tmp_path / "w0")
    gc = GroupCommitter(st)
    results: list[list[int]] = []

    def producer(k: int) -> None:
        for i in range(20):
            results.append(gc.commit([("r", f"T{k % 3}", rec(i))]))

    gevent.joinall([gevent.spawn(producer, k) for k in range(50)])
    gc.close()
    assert len(results) == 1000
    assert st.messages == 1000 and st.synced_messages == 1000
    assert gc.messages_per_fsync > 5, f"only {gc.messages_per_fsync:.1f} messages per fsync"
    # every lane is in arrival (sequence) order
    for t in ("T0", "T1", "T2"):
        seqs = [s for s, _ in st.read_lane("r", t, -1, 10000)]
        assert seqs == sorted(seqs) and len(seqs) > 300
    st.close()


def test_group_commit_answers_after_the_wal_sync_and_the_hub_runs_during_it(tmp_path: Path) -> None:
    """The fsync runs in a native thread without the GIL (rocksdict holds the GIL through a write
    with sync=True, which stopped every greenlet of the worker for the whole fsync): while the
    sync is held up, other greenlets run, and no producer hears SUCCESS before the sync returned."""
    import threading

    st = SpillStore(tmp_path / "w0")
    release = threading.Event()
    entered = threading.Event()
    synced: list[int] = []
    real_sync = st.sync_wal

    def slow_sync() -> None:  # stands for a slow disk: waits (GIL released) until the test lets it go
        entered.set()
        assert release.wait(60), "the test never released the sync"
        real_sync()
        synced.append(st.messages)

    st.sync_wal = slow_sync  # type: ignore[method-assign]
    gc = GroupCommitter(st)
    acked: list[int] = []
    producer = gevent.spawn(lambda: acked.extend(gc.commit([("r", "T", rec(1))])))
    ticks = 0
    deadline = time.monotonic() + 60
    while not entered.is_set():
        assert time.monotonic() < deadline, "the committer never synced the WAL (SpillStore.sync_wal)"
        gevent.sleep(0.001)
    # the hub keeps running this greenlet while the sync is held
    for _ in range(50):
        gevent.sleep(0)
        ticks += 1
    assert ticks == 50 and not acked and not synced, "a producer was answered before its copy was synced"
    release.set()
    producer.join(timeout=30)
    assert producer.successful(), producer.exception
    assert acked == [0] and synced, (acked, synced)
    gc.close()
    st.close()
    reopened = SpillStore(tmp_path / "w0")
    assert [s for s, _ in reopened.read_lane("r", "T", -1, 10)] == [0]
    reopened.close()


def test_disk_cap_accounting(tmp_path: Path) -> None:
    st = SpillStore(tmp_path / "w0", disk_cap_bytes=2000)
    v = rec(0, body=b"x" * 500)
    assert not st.would_exceed(len(v))
    st.write([("r", "T", st.next_seq(), v) for _ in range(3)], sync=False)
    assert st.would_exceed(len(v))
    st.close()


_CRASH_WRITER = textwrap.dedent(
    """
    import sys, gevent
    from rmqfast.spill import GroupCommitter, SpillStore, CopyRecord
    st = SpillStore(sys.argv[1])
    gc = GroupCommitter(st)
    def producer(k):
        i = 0
        while True:
            body = f"{sys.argv[2]}-{k}-{i}".encode()
            gc.commit([("r", f"T{k}", CopyRecord(topic=f"T{k}", body=body).encode())])
            sys.stdout.write(body.decode() + "\\n")   # acknowledged only after the synced write returned
            sys.stdout.flush()
            i += 1
    gevent.joinall([gevent.spawn(producer, k) for k in range(8)])
    """
)


def test_sigkill_mid_write_loses_no_acknowledged_copy(tmp_path: Path) -> None:
    """A writer killed with SIGKILL while committing: every copy it acknowledged is on disk."""
    db = tmp_path / "w0"
    acked: set[str] = set()
    for rnd in range(3):  # repeatedly: reopen after a crash, keep writing, crash again
        proc = subprocess.Popen([sys.executable, "-c", _CRASH_WRITER, str(db), str(rnd)], stdout=subprocess.PIPE)
        assert proc.stdout is not None
        deadline = time.monotonic() + 20
        n = 0
        while n < 800 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            acked.add(line.decode().strip())
            n += 1
        os.kill(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate()
        # lines already written before the kill were acknowledged too
        acked.update(x for x in (rest or b"").decode().splitlines() if x)
        assert n >= 800, f"the writer acknowledged only {n} copies"
        st = SpillStore(db)
        stored = {CopyRecord.decode(v).body.decode() for _r, _t, _s, v in st.scan()}
        st.close()
        missing = acked - stored
        assert not missing, f"{len(missing)} acknowledged copies lost, e.g. {sorted(missing)[:5]}"
    assert len(stored) > 2000, json.dumps(len(stored))


def test_spill_cli_reads_a_running_writers_backlog(tmp_path: Path) -> None:
    import io

    from rmqfast.spill import cli as spill_cli
    from rmqfast.spill.store import worker_dir

    st = SpillStore(worker_dir(tmp_path, 0))  # the "running worker" keeps it open
    try:
        st.write([("cloud-b", "T1", st.next_seq(), rec(i)) for i in range(4)], sync=True)
        out = io.StringIO()
        assert spill_cli.stats(tmp_path, out, as_json=True) == 0
        lanes = json.loads(out.getvalue())["lanes"]
        assert [(x["worker"], x["remote"], x["topic"], x["messages"]) for x in lanes] == [
            ("worker-0", "cloud-b", "T1", 4)]
        out = io.StringIO()
        spill_cli.inspect(tmp_path, out, limit=2, as_json=True)
        rows = [json.loads(x) for x in out.getvalue().splitlines()]
        assert [r["uniq_key"] for r in rows] == ["U0", "U1"]
    finally:
        st.close()
    with pytest.raises(SpillError, match="does not exist"):
        spill_cli.stats(tmp_path / "nope", io.StringIO())
