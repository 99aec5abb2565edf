"""Download progress of a stage, as lines for ``join``'s log: bytes, rate and ETA.

A pure decision (:meth:`DownloadProgress.update` takes the clock's reading and returns the line
to log, or None), so the coordinator calls it from the event loop or a fetching thread alike
and tests drive it with made-up times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A line every this many seconds per stage: often enough to see a stall, rarely enough to read.
LOG_EVERY_S = 5.0
_MB = 1e6


@dataclass
class DownloadProgress:
    """Progress of one stage's download, turned into a log line now and then."""

    label: str
    _start_s: float | None = None
    _start_bytes: int = 0
    _last_log_s: float = -math.inf
    _finished: bool = False

    def update(self, done: int, total: int, now_s: float) -> str | None:
        """The line to log for ``done`` of ``total`` bytes at ``now_s``, or None (not yet)."""
        if total <= 0 or self._finished:
            return None
        if self._start_s is None:
            self._start_s, self._start_bytes = now_s, done
        finished = done >= total
        if not finished and now_s - self._last_log_s < LOG_EVERY_S:
            return None
        self._last_log_s, self._finished = now_s, finished
        elapsed = now_s - self._start_s
        rate = (done - self._start_bytes) / elapsed if elapsed > 0 else 0.0
        line = (
            f"{self.label}: {done / _MB:.1f} of {total / _MB:.1f} MB ({100 * done / total:.0f} %)"
        )
        if finished:
            return f"{line}, done in {elapsed:.1f} s"
        if rate <= 0:
            return f"{line}, rate unknown yet"
        return f"{line}, {rate / _MB:.1f} MB/s, ETA {(total - done) / rate:.0f} s"
