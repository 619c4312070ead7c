"""Progress for long runs: say what is loading, then one live line, and keep JSONL records.

On a terminal the live line is redrawn in place; in a log (CI, batch jobs) a full line is printed
every `log_every` seconds instead, so logs stay readable.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO


def fmt_count(n: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def fmt_duration(s: float) -> str:
    if s != s or s == float("inf"):
        return "?"
    s = int(s)
    if s >= 3600:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class LiveLine:
    def __init__(self, stream: TextIO | None = None, log_every: float = 30.0, enabled: bool = True):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.log_every = log_every
        self.enabled = enabled
        self._last_log = 0.0
        self._width = 0

    def __getstate__(self) -> dict[str, Any]:
        # Sent to a spawned process (launch.launch), a line keeps its settings and writes to that
        # process's own stderr: a stream does not travel between processes.
        return {"log_every": self.log_every, "enabled": self.enabled}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)

    def say(self, msg: str) -> None:
        """A one-off status line ("loading target ...")."""
        if not self.enabled:
            return
        self._clear()
        print(msg, file=self.stream, flush=True)

    def update(self, msg: str, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.time()
        if self.tty:
            pad = max(0, self._width - len(msg))
            self.stream.write("\r" + msg + " " * pad)
            self.stream.flush()
            self._width = len(msg)
        elif force or now - self._last_log >= self.log_every:
            print(msg, file=self.stream, flush=True)
            self._last_log = now

    def done(self, msg: str | None = None) -> None:
        if not self.enabled:
            return
        self._clear()
        if msg:
            print(msg, file=self.stream, flush=True)

    def _clear(self) -> None:
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0


class JsonlLog:
    """Append-only JSON lines (metrics.jsonl and friends), flushed per record."""

    def __init__(self, path):
        self.f = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.f.write(json.dumps(record, default=float) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()
