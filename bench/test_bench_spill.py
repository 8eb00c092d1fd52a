"""Spill benchmarks (pytest-benchmark): ``pytest bench/test_bench_spill.py``.

* write: one unsynced WriteBatch of 64 copies (fast mode's spill), one synced single copy (a
  lone durable producer: one fsync per message), and a group commit of 64 concurrent producers
  (``extra_info["messages_per_fsync"]``);
* drain: read 256 copies of a lane and delete them (what the feeder does per batch);
* the copy path side by side: 2000 sends through :meth:`Replicator.take` from 64 concurrent
  greenlets in fast and in durable mode (``extra_info["messages"]`` per round; the ratio of
  the two means is durable/fast throughput).

Copies are 1 KiB bodies with Java-like properties.  ``extra_info`` carries the messages per
call, to turn time per call into messages per second.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import gevent
import pytest

from rmqfast import config as config_mod
from rmqfast.replicate.replicator import Replicator
from rmqfast.spill import CopyRecord, GroupCommitter, SpillStore

pytest.importorskip("pytest_benchmark")

VALUE = CopyRecord(
    topic="BenchTopic", body=bytes(1024),
    properties="KEYS\x01k1\x02UNIQ_KEY\x017F0000011B6D8A3C0000000000000001\x02WAIT\x01true\x02TAGS\x01TagA\x02",
    created_ms=int(time.time() * 1000),
).encode()


@pytest.fixture
def store(tmp_path: Path) -> Any:
    st = SpillStore(tmp_path / "w0")
    yield st
    st.close()


def test_spill_write_batch_unsynced(benchmark: Any, store: SpillStore) -> None:
    def write() -> None:
        store.write([("cloud-b", "BenchTopic", store.next_seq(), VALUE) for _ in range(64)], sync=False)

    benchmark.extra_info.update(messages=64, bytes=64 * len(VALUE))
    benchmark(write)


def test_spill_write_single_synced(benchmark: Any, store: SpillStore) -> None:
    def write() -> None:
        store.write([("cloud-b", "BenchTopic", store.next_seq(), VALUE)], sync=True)

    benchmark.extra_info.update(messages=1)
    benchmark(write)


def test_spill_group_commit_64_producers(benchmark: Any, store: SpillStore) -> None:
    gc = GroupCommitter(store)

    def round_() -> None:
        gevent.joinall([gevent.spawn(gc.commit, [("cloud-b", "BenchTopic", VALUE)]) for _ in range(64)])

    f0, m0 = store.fsyncs, store.synced_messages
    benchmark.pedantic(round_, rounds=30, iterations=1, warmup_rounds=2)
    gc.close()
    benchmark.extra_info.update(messages=64, messages_per_fsync=round((store.synced_messages - m0) /
                                                                      max(1, store.fsyncs - f0), 1))


def test_spill_drain_256(benchmark: Any, store: SpillStore) -> None:
    def setup() -> tuple[tuple[()], dict[str, Any]]:
        store.write([("cloud-b", "BenchTopic", store.next_seq(), VALUE) for _ in range(256)], sync=False)
        return (), {}

    def drain() -> None:
        got = store.read_lane("cloud-b", "BenchTopic", -1, 256)
        assert len(got) == 256
        store.delete([("cloud-b", "BenchTopic", s, len(v)) for s, v in got])

    benchmark.extra_info.update(messages=256)
    benchmark.pedantic(drain, setup=setup, rounds=50, iterations=1, warmup_rounds=2)


@pytest.mark.parametrize("durability", ["fast", "durable"])
def test_copy_path_take_2000_from_64_producers(benchmark: Any, durability: str) -> None:
    with tempfile.TemporaryDirectory(prefix="bsp") as d:
        cfg = config_mod.from_dict({
            "proxy": {"state_dir": d},
            "namesrv": {"upstreams": ["127.0.0.1:9876"]},
            "clouds": {"remote": [{"name": "cloud-b", "namesrv": ["127.0.0.1:1"]}]},
            "replicate": {"durability": durability, "channel_size": 1_000_000},
        })
        rep = Replicator(cfg, 0)  # not started: nothing drains, we time the copy path alone

        def producer(n: int) -> None:
            for _ in range(n):
                s = rep.take(["cloud-b"], "BenchTopic", VALUE)
                rep.confirm(s)

        def round_() -> None:
            gevent.joinall([gevent.spawn(producer, 2000 // 64 + 1) for _ in range(64)])

        benchmark.pedantic(round_, rounds=5, iterations=1, warmup_rounds=1)
        per_fsync = rep.store.synced_messages / rep.store.fsyncs if rep.store.fsyncs else 0.0
        benchmark.extra_info.update(messages=64 * (2000 // 64 + 1), durability=durability,
                                    messages_per_fsync=round(per_fsync, 1))
        rep.close()
