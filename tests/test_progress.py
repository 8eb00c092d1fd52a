"""Progress of long work (rmqfast.progress): a stage's start, a status line while it runs, its end."""

from __future__ import annotations

import io
import threading

import pytest

from rmqfast.progress import Stages, stage


class Lines(io.StringIO):
    """An output that tells a waiting test when a line containing ``mark`` was written."""

    def __init__(self, mark: str) -> None:
        super().__init__()
        self.mark = mark
        self.seen = threading.Event()

    def write(self, s: str) -> int:
        n = super().write(s)
        if self.mark in s:
            self.seen.set()
        return n


def test_a_running_stage_prints_status_lines_with_its_time_and_detail() -> None:
    out = Lines("so far")
    st = Stages("demo", total=2, every=0.02, out=out)
    with st.stage("starting RocketMQ", detail=lambda: "tasks 3/4"):
        assert out.seen.wait(30), out.getvalue()  # the work waits for a status line, not a sleep
    with st.stage("report"):
        pass
    text = out.getvalue().splitlines()
    assert text[0] == "[demo] stage 1/2 starting RocketMQ ..."
    status = [ln for ln in text if "so far" in ln]
    assert status and status[0].startswith("[demo]   starting RocketMQ: ") and status[0].endswith("; tasks 3/4")
    assert any(ln.startswith("[demo]   starting RocketMQ: done in ") for ln in text)
    assert "[demo] stage 2/2 report ..." in text
    assert [(what, ok) for what, _, ok in st.done] == [("starting RocketMQ", True), ("report", True)]


def test_a_failing_stage_is_reported_and_the_error_goes_on() -> None:
    out = io.StringIO()
    st = Stages("bench", out=out)
    with pytest.raises(RuntimeError, match="broker died"):
        with st.stage("send scenario"):
            raise RuntimeError("broker died")
    assert "[bench]   send scenario: FAILED in " in out.getvalue()
    assert st.done[0][0] == "send scenario" and st.done[0][2] is False


def test_a_failing_detail_never_breaks_the_work() -> None:
    out = Lines("so far")

    def broken() -> str:
        raise ValueError("no Spark yet")

    st = Stages("analyze", every=0.02, out=out)
    with st.stage("Spark jobs", detail=broken):
        assert out.seen.wait(30)
    assert "no Spark yet" not in out.getvalue()


def test_a_stage_without_ticks_prints_start_and_end_only() -> None:
    out = io.StringIO()
    st = Stages("demo", every=0.001, out=out)
    with st.stage("report", tick=False):
        pass
    assert [ln for ln in out.getvalue().splitlines() if "so far" in ln] == []
    assert "[demo]   report: done in " in out.getvalue()


def test_no_progress_is_no_output(capsys: pytest.CaptureFixture[str]) -> None:
    with stage(None, "quiet"):
        pass
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="every"):
        Stages("x", every=0)


def test_spark_status_from_the_status_tracker() -> None:
    from types import SimpleNamespace

    from rmqfast.progress import spark_status

    def session(active: list[int], all_jobs: list[int], stages: dict[int, tuple[int, int]]) -> object:
        tracker = SimpleNamespace(
            getActiveJobsIds=lambda: active, getJobIdsForGroup=lambda: all_jobs,
            getActiveStageIds=lambda: list(stages),
            getStageInfo=lambda s: SimpleNamespace(numCompletedTasks=stages[s][0], numTasks=stages[s][1]))
        return SimpleNamespace(sparkContext=SimpleNamespace(statusTracker=lambda: tracker))

    assert spark_status(session([3], [1, 2, 3], {7: (3, 4), 8: (0, 2)})) == \
        "Spark: 2 job(s) done, 1 running (tasks 3/6 of its active stages)"
    assert spark_status(session([], [1, 2], {})).startswith("Spark: 2 job(s) done, none running")
