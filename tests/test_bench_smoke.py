"""The benchmark's tools work: loadgen against the null broker, directly and through rmqfast.

Not a speed test (the speed targets live in ``python -m rmqfast.bench``): it only checks that
the C tools build, that every request is answered with SUCCESS and matched by its opaque,
and that the bench driver writes its results.  Needs a C compiler.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
from pathlib import Path

import pytest

from rmqfast import codec
from rmqfast.bench import cli as bench_cli
from rmqfast.bench.cbuild import Tools, build_tools
from rmqfast.bench.common import BenchError
from rmqfast.bench.floor import FloorTarget
from rmqfast.bench.loadgen import run_loadgen
from rmqfast.bench.nullbroker import NullBroker
from rmqfast.bench.procfs import memory_kib
from rmqfast.bench.scenarios import Scenario
from rmqfast.bench.targets import RmqfastTarget
from rmqfast.codec import codes as C
from rmqfast.codec.codes import SERIALIZE_ROCKETMQ
from rmqfast.codec.command import RemotingCommand, decode_frame, encode

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None, reason="needs a C compiler")

# A little of everything: several topics, a quarter pulls (answered with store records).
SMOKE = Scenario("smoke", conns=4, inflight=8, topics=3, pull_pct=25)


@pytest.fixture(scope="module")
def tools() -> Tools:
    return build_tools()


def _assert_clean(res: dict, *, pulls: bool = True) -> None:
    assert res["responses"] > 0, res
    assert res["errors"] == 0, res["error_detail"]
    assert res["resp_codes"] == {"0": res["responses"]}
    assert res["lat_us"]["p50"] > 0
    if pulls:
        assert 0 < res["pulls"] < res["sent"]
        assert res["bytes_in"] > res["responses"] * 100  # pull answers carry records


def test_loadgen_direct_and_through_rmqfast(tools: Tools) -> None:
    pure = codec.IMPLEMENTATION == "python"  # the RMQFAST_NO_EXTENSIONS=1 test run checks the pure relay
    with NullBroker(tools) as broker:
        direct = run_loadgen(tools, broker.port, SMOKE, warmup=0.2, duration=1.0)
        _assert_clean(direct)

        target = RmqfastTarget(broker.port, workers=2, pure=pure, name="rmqfast")
        target.start()
        try:
            via = run_loadgen(tools, target.port, SMOKE, warmup=0.2, duration=1.0,
                                    cpu_groups={"target": target.pids()})
            _assert_clean(via)
            assert via["cpu"]["target"]["user_s"] + via["cpu"]["target"]["sys_s"] > 0
            assert all(memory_kib(pid).get("VmRSS", 0) > 0 for pid in target.worker_pids())
            assert len(target.worker_pids()) == 2
            # the workers said whether their reactors batch through io_uring (the pure relay has none)
            io_uring = target.info()["io_uring"]
            assert io_uring is None if pure else (io_uring is True or isinstance(io_uring, str)), io_uring
        finally:
            target.stop()

        opened = run_loadgen(tools, broker.port, Scenario("open", conns=2, rate=2000), warmup=0.1,
                                   duration=0.5)
        _assert_clean(opened, pulls=False)
        # paced at 2,000/s: never above it (+10 %); below only as far as a loaded machine lags
    assert opened["mode"] == "open" and 1000 <= opened["send_rate"] <= 2200
    stats = broker.final_stats
    assert stats["protocol_errors"] == 0
    assert stats["responses"] >= direct["responses"] + via["responses"] + opened["responses"]


def test_relay_floor_relays_every_byte(tools: Tools) -> None:
    """The floor relay answers every request through itself, pull answers of 256 KiB included
    (more than its 64 KiB buffer), and stops on SIGTERM."""
    with NullBroker(tools, pull_msgs=16, pull_body=16384) as broker:
        floor = FloorTarget(tools, broker.port)
        floor.start()
        try:
            res = run_loadgen(tools, floor.port, SMOKE, warmup=0.2, duration=1.0, cpu_groups={"target": floor.pids()})
            _assert_clean(res)
            assert res["bytes_in"] > res["pulls"] * 16 * 16384 // 2  # (requests at the window edges)
            assert res["cpu"]["target"]["user_s"] + res["cpu"]["target"]["sys_s"] > 0
            proc = floor.proc
        finally:
            floor.stop()
        assert proc is not None and proc.returncode == 0  # left its loop on SIGTERM, not killed
    assert broker.final_stats["protocol_errors"] == 0


def test_relay_floor_that_cannot_start_says_so(tools: Tools) -> None:
    floor = FloorTarget(tools, 0)  # no upstream port: relayfloor refuses its arguments
    with pytest.raises(BenchError, match=r"relay-floor did not start: '' \(exit 2\)"):
        floor.start()
    assert floor.proc is None


def test_relay_floor_many_large_answers_in_order(tools: Tools) -> None:
    """100 pulls sent before any answer is read: 25 MiB of answers (more than the loopback
    socket buffers hold), every one whole and in order."""
    pull = RemotingCommand(code=C.PULL_MESSAGE, opaque=0, ext_fields={"topic": "T", "queueId": "0"})
    with NullBroker(tools, pull_msgs=16, pull_body=16384) as broker:
        floor = FloorTarget(tools, broker.port)
        floor.start()
        try:
            with socket.create_connection(("127.0.0.1", floor.port), timeout=30) as s:
                for i in range(100):
                    pull.opaque = 100 + i
                    s.sendall(encode(pull))
                answers = [decode_frame(f) for f in _read_frames(s, 100)]
        finally:
            floor.stop()
    assert [a.opaque for a in answers] == list(range(100, 200))
    assert all(a.code == C.SUCCESS and struct.unpack(">i", a.body[:4])[0] * 16 == len(a.body) for a in answers)


def test_bench_main_writes_results(tools: Tools, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = bench_cli.main(["--targets", "direct", "--scenarios", "send-64x1", "--rounds", "1", "--warmup", "0.1",
                     "--duration", "0.3", "--results", str(tmp_path)])
    assert rc == 0
    (path,) = tmp_path.glob("bench-*.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds.count("run") == 1 and "summary" in kinds and "check" in kinds
    run = records[kinds.index("run")]
    assert run["target"] == "direct" and run["scenario"] == "send-64x1"
    assert run["loadgen"]["responses"] > 0 and run["loadgen"]["errors"] == 0
    assert run["machine"]["cores"] and run["machine"]["kernel"] and run["machine"]["python"]
    assert len({r["run_id"] for r in records}) == 1
    captured = capsys.readouterr()
    assert "send-64x1" in captured.out
    # what stage the bench is in and how long each took (stderr, beside the per-run lines)
    assert "[bench] stage 4/4 round 1/1 send-64x1 against direct (0.1 s warm-up + 0.3 s) ..." in captured.err
    assert "[bench]   round 1/1 send-64x1 against direct (0.1 s warm-up + 0.3 s): done in " in captured.err
    assert bench_cli.main(["--report", str(path)]) == 0  # re-reads the results file
    assert "send-64x1" in capsys.readouterr().out


def _read_frames(sock: socket.socket, count: int) -> list[bytes]:
    data = b""
    frames: list[bytes] = []
    while len(frames) < count:
        if len(data) >= 4 and len(data) >= 4 + struct.unpack(">i", data[:4])[0]:
            end = 4 + struct.unpack(">i", data[:4])[0]
            frames.append(data[:end])
            data = data[end:]
            continue
        chunk = sock.recv(65536)
        assert chunk, "null broker closed the connection"
        data += chunk
    return frames


def test_nullbroker_answers_like_a_broker(tools: Tools) -> None:
    """Its answers decode with rmqfast's exact codec and carry what a Java client reads."""
    send = RemotingCommand(code=C.SEND_MESSAGE_V2, opaque=41, version=435,
                           ext_fields={"a": "PG", "b": "T", "e": "3", "i": "TAGS\x01A\x02"}, body=b"x" * 100)
    beat = RemotingCommand(code=C.HEART_BEAT, opaque=42, serialize_type=SERIALIZE_ROCKETMQ)  # binary header
    oneway = RemotingCommand(code=C.SEND_MESSAGE_V2, opaque=43, flag=C.FLAG_ONEWAY, ext_fields={"b": "T"})
    pull = RemotingCommand(code=C.PULL_MESSAGE, opaque=44, ext_fields={"topic": "T", "queueId": "0"})
    with NullBroker(tools, pull_msgs=2, pull_body=10) as broker:
        with socket.create_connection(("127.0.0.1", broker.port), timeout=5) as s:
            s.sendall(encode(send) + encode(beat) + encode(oneway) + encode(pull))
            answers = [decode_frame(f) for f in _read_frames(s, 3)]
    sent, beaten, pulled = answers  # the oneway frame gets no answer
    assert [a.opaque for a in answers] == [41, 42, 44] and all(a.flag == C.FLAG_RESPONSE for a in answers)
    assert all(a.code == C.SUCCESS for a in answers)
    assert sent.ext_fields is not None and sent.ext_fields["queueId"] == "3"
    assert {"msgId", "queueOffset", "MSG_REGION", "TRACE_ON"} <= set(sent.ext_fields)
    assert len(sent.ext_fields["msgId"]) == 32
    assert pulled.ext_fields is not None and "nextBeginOffset" in pulled.ext_fields
    assert struct.unpack(">i", pulled.body[:4])[0] * 2 == len(pulled.body)  # two store records
    assert broker.final_stats["oneway"] == 1 and broker.final_stats["requests"] == 4
