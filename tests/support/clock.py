"""A fake clock for the time budgets of ``ampfx.capture.export``: ``export_timeout`` and its shares (a ``SIGALRM``
timer, :func:`~ampfx.capture.export.time_limit`) and the stall limit (``time.perf_counter`` in a forward hook).

Installed (:meth:`ExportClock.install`), the module reads this clock instead of the machine's: time passes only
where a test says a step is slow (:meth:`ExportClock.sleep`), and the alarm of the innermost time limit fires there,
at its deadline, as ``SIGALRM`` interrupts a real sleep. A verdict that rests on which step ran past its budget then
holds on a machine of any speed or load; the real timer is tested on its own (``tests/test_export.py``).

>>> clock = ExportClock()
>>> with clock.time_limit(2.0):
...     clock.sleep(1.5)
...     try:
...         clock.sleep(1.5)
...     except export.ExportTimeout as e:
...         print(e, clock.elapsed)
torch.export took longer than 2 s 2.0
"""
from __future__ import annotations

import contextlib
import math
import types
from typing import Iterator

from ampfx.capture import export


class ExportClock:
    """The time ``ampfx.capture.export`` reads while installed; :attr:`elapsed`: seconds passed on it."""

    START = 1000.0  # as a real perf_counter, never 0 (export's stall limit takes 0 for "not yet")

    def __init__(self) -> None:
        self.now = self.START
        self._limits: list[tuple[float, float]] = []  # (deadline, seconds) of each time limit open, innermost last

    def perf_counter(self) -> float:
        return self.now

    @property
    def elapsed(self) -> float:
        return self.now - self.START

    @contextlib.contextmanager
    def time_limit(self, seconds: float | None) -> Iterator[str | None]:
        """:func:`ampfx.capture.export.time_limit` on this clock."""
        if not seconds:
            yield "no export_timeout"
            return
        self._limits.append((self.now + seconds, seconds))
        try:
            yield None
        finally:
            self._limits.pop()

    def sleep(self, seconds: float) -> None:
        """A step taking ``seconds``: the clock moves on, and a time limit whose deadline passes meanwhile raises
        :class:`~ampfx.capture.export.ExportTimeout` at its deadline."""
        deadline, limit = self._limits[-1] if self._limits else (math.inf, math.inf)
        if self.now + seconds >= deadline:
            self.now = deadline
            raise export.ExportTimeout(f"torch.export took longer than {limit:g} s")
        self.now += seconds

    def install(self, monkeypatch) -> "ExportClock":
        """Make ``ampfx.capture.export`` read this clock (undone with ``monkeypatch``); the clock."""
        monkeypatch.setattr(export, "time", types.SimpleNamespace(perf_counter=self.perf_counter))
        monkeypatch.setattr(export, "time_limit", self.time_limit)
        return self
