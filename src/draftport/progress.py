"""The long verbs' progress bars (capture, regeneration, train, eval): one look, and the time left from the
first completed step on.

rich's own TimeRemainingColumn estimates the speed from the updates of its last 30 s and needs two of them, so
a bar whose steps take longer than that (a training step of Gemma-3-270M on a shared 2-core CPU takes about a
minute) never shows an estimate. `TimeLeft` uses the mean rate of what this run has completed instead: an
estimate after the first step, steadier over a long run. No torch: capture, train and the verbs all use it.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

RESUMED_AT = "resumed_at"   # task field: the count a resumed run started from (not this run's work)


def time_left(done: float, elapsed: float | None, remaining: float | None) -> float | None:
    """Seconds left at the mean rate so far: elapsed / done × remaining; None before the first completed unit."""
    if not done or done <= 0 or elapsed is None or remaining is None:
        return None
    return max(remaining, 0.0) * elapsed / done


def clock(seconds: float | None) -> str:
    """H:MM:SS, or -:--:-- when there is no estimate yet."""
    if seconds is None:
        return "-:--:--"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"


def _done(task) -> float:
    return task.completed - task.fields.get(RESUMED_AT, 0)


class TimeLeft(ProgressColumn):
    """'ETA H:MM:SS' from the mean rate of this run's completed work (see the module docstring)."""

    def render(self, task) -> Text:
        if task.finished:
            return Text("done", style="progress.elapsed")
        return Text("ETA " + clock(time_left(_done(task), task.elapsed, task.remaining)), style="progress.remaining")


class Rate(ProgressColumn):
    """This run's mean rate: '1,234 tok/s'."""

    def __init__(self, unit: str):
        super().__init__()
        self.unit = unit

    def render(self, task) -> Text:
        rate = _done(task) / task.elapsed if task.elapsed else 0.0
        return Text(f"{rate:,.0f} {self.unit}/s", style="progress.data.speed")


def progress_bar(console: Console, *, unit: str | None = None, info: bool = False, transient: bool = False,
                 disable: bool = False) -> Progress:
    """description, bar, done/total, [rate in `unit`/s], [the task's `info` field], elapsed, ETA. A resumed
    task passes RESUMED_AT=<its starting count> to add_task so the rate and the ETA count this run's work only."""
    cols: list = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:,}/{task.total:,}")]
    if unit:
        cols.append(Rate(unit))
    if info:
        cols.append(TextColumn("{task.fields[info]}"))
    cols += [TimeElapsedColumn(), TimeLeft()]
    return Progress(*cols, console=console, transient=transient, disable=disable)
