"""tidal.logging.progress: live bars on a terminal (one shared display), plain lines elsewhere."""

import io
import re
import time

from rich.console import Console

from tidal.logging import progress


def test_plain_lines_when_not_a_terminal(monkeypatch):
    monkeypatch.setattr(progress, "PLAIN_FIRST_S", 0.2)
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 0.4)
    out = io.StringIO()
    con = Console(file=out, width=100, force_terminal=False)
    with progress.Step("warm start (SFT)", total=1500, unit="steps", con=con) as step:
        for i in range(1500):
            if i == 600:
                time.sleep(0.5)  # the first line comes while the step runs
            step.advance(info=f"loss {1 / (i + 1):.3f}")
    lines = out.getvalue().splitlines()
    assert re.fullmatch(r"\[tidal\] warm start \(SFT\): 600/1,500 steps \(40%\) after 0\.\d\d s, about 0\.\d\d s left \(loss 0\.002\) \.\.\.", lines[0]), lines
    assert len(lines) == 2 and re.fullmatch(r"\[tidal\] warm start \(SFT\): done in 0\.\d\d s \(loss 0\.001\)", lines[1]), lines


def test_plain_lines_say_the_time_left(monkeypatch):
    """With a count: time per unit so far times the units left; without one: the last run's time
    less the time spent (``expected_s``)."""
    clock = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    step = progress.Step("warm start", total=100, unit="steps", enabled=False).__enter__()
    step.completed, clock[0] = 25, 10.0
    assert step._remaining() == ", about 30.0 s left"
    ev = progress.stage("evaluating", enabled=False, expected_s=12.0).__enter__()
    clock[0] = 14.0  # 4 s in
    assert ev._remaining() == ", about 8.00 s left (the last took 12.0 s)"
    clock[0] = 30.0
    assert ev._remaining() == ", longer than the last (the last took 12.0 s)"
    assert progress.stage("loading", enabled=False).__enter__()._remaining() == ""


def test_a_live_bar_shows_the_time_remaining():
    out = io.StringIO()
    con = Console(file=out, width=120, force_terminal=True)
    with progress.Step("warm start", total=10, con=con):
        columns = progress.display(con)._progress.columns
    assert any(isinstance(c, progress.TimeRemainingColumn) for c in columns)


def test_stage_and_failure_and_disabled():
    out = io.StringIO()
    con = Console(file=out, width=100, force_terminal=False)
    with progress.stage("loading the prompts", con=con) as s:
        s.done("200 prompts")
    try:
        with progress.stage("saving", con=con):
            raise OSError("disk full")
    except OSError:
        pass
    with progress.stage("quiet", enabled=False, con=con):
        pass
    (line,) = out.getvalue().splitlines()  # quick: one line; a failed step leaves its error to say what happened
    assert re.fullmatch(r"\[tidal\] loading the prompts: done in 0\.0\d s \(200 prompts\)", line), line


def test_one_live_display_for_every_bar_on_a_terminal():
    out = io.StringIO()
    con = Console(file=out, width=100, force_terminal=True)
    shared = progress.display(con)
    outer = shared.add("train", total=10)
    seen = []
    with progress.Step("evaluating", total=3, con=con) as step:
        for _ in range(3):
            seen.append([t.description for t in shared._progress.tasks])
            step.advance()
    assert seen[0] == ["train", "evaluating"] and shared._progress is not None
    shared.remove(outer)
    assert shared._progress is None and "evaluating: done in" in out.getvalue()


def test_format_seconds():
    assert [progress.format_seconds(s) for s in (0.4212, 12.34, 125, 3725)] == ["0.42 s", "12.3 s", "2 min 05 s", "1 h 02 min"]
