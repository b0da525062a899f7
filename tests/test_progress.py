"""The long verbs' progress bars: an ETA from the first completed step, counting a resumed run's own work only."""

from __future__ import annotations

from rich.console import Console

from draftport.progress import RESUMED_AT, TimeLeft, clock, progress_bar, time_left


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _bar(now: _Clock):
    bar = progress_bar(Console(file=open("/dev/null", "w"), width=200), info=True)
    bar.get_time = now  # what rich's tasks read their elapsed time from
    return bar


def test_eta_shows_after_the_first_slow_step():
    now = _Clock()
    bar = _bar(now)
    task_id = bar.add_task("training", total=400, info="")
    task = bar.tasks[0]
    column = TimeLeft()
    assert column.render(task).plain == "ETA -:--:--"   # nothing completed: no estimate
    now.t = 70.0                                         # one 70 s step: rich's own column still has none
    bar.update(task_id, completed=1)
    assert task.time_remaining is None
    assert column.render(task).plain == "ETA " + clock(399 * 70.0) == "ETA 7:45:30"
    now.t = 140.0
    bar.update(task_id, completed=2)
    assert column.render(task).plain == "ETA 7:44:20"
    bar.update(task_id, completed=400)
    assert column.render(task).plain == "done"


def test_a_resumed_run_counts_only_its_own_steps():
    now = _Clock()
    bar = _bar(now)
    task_id = bar.add_task("training", total=100, completed=90, info="", **{RESUMED_AT: 90})
    assert TimeLeft().render(bar.tasks[0]).plain == "ETA -:--:--"  # 90 done by an earlier run, none by this one
    now.t = 10.0
    bar.update(task_id, completed=91)
    assert TimeLeft().render(bar.tasks[0]).plain == "ETA 0:01:30"  # 9 steps left at 10 s each


def test_time_left_is_pure_arithmetic():
    assert time_left(0, 5.0, 10) is None and time_left(2, None, 10) is None
    assert time_left(2, 5.0, 10) == 25.0 and time_left(3, 3.0, 0) == 0.0
    assert clock(None) == "-:--:--" and clock(3725.4) == "1:02:05"


def test_the_bar_renders_every_column():
    now = _Clock()
    console = Console(record=True, width=160, file=open("/dev/null", "w"))
    bar = progress_bar(console, unit="tok")
    bar.get_time = now
    task_id = bar.add_task("capturing", total=5000)
    now.t = 2.0
    bar.update(task_id, completed=1000)
    console.print(bar.get_renderable())
    text = console.export_text()
    assert "capturing" in text and "1,000/5,000" in text and "500 tok/s" in text and "ETA 0:00:08" in text
