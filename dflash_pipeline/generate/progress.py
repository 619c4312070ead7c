"""The live line of `dflash generate`: conversations done, output tokens/s, mean reply length, stop
reasons, rows busy, ETA. Each process counts its own share; the first process prints its line."""

from __future__ import annotations

import time

from dflash_pipeline.generate.engine import EngineStats
from dflash_pipeline.progress import LiveLine, fmt_count, fmt_duration


class GenerateProgress:
    def __init__(self, line: LiveLine, work, total_conversations: int, num_rows: int, world: int,
                 every_s: float = 0.5):
        self.line, self.work, self.total = line, work, total_conversations
        self.num_rows, self.world, self.every_s = num_rows, world, every_s
        self.t0 = time.perf_counter()
        self._last = 0.0

    def text(self, stats: EngineStats) -> str:
        live = self.work.live
        elapsed = time.perf_counter() - self.t0
        done = live.conversations
        replies = max(live.replies, 1)
        finish = " ".join(f"{k} {v / replies:.0%}" for k, v in sorted(live.finish.items(), key=lambda kv: -kv[1]))
        eta = (self.total - done) * elapsed / done if done else float("nan")
        share = f" (this process of {self.world})" if self.world > 1 else ""
        return (f"generate: {done:,}/{self.total:,} conversations{share}, {live.replies:,} replies, "
                f"{fmt_count(stats.busy_row_steps / elapsed if elapsed > 0 else 0.0)} tok/s, "
                f"mean reply {live.reply_tokens / replies:.0f} tok, {finish or 'no reply yet'}, "
                f"rows busy {stats.busy_row_steps / max(stats.steps, 1) / self.num_rows:.0%}, "
                f"ETA {fmt_duration(eta)}")

    def update(self, stats: EngineStats) -> None:
        now = time.perf_counter()
        if now - self._last >= self.every_s:
            self._last = now
            self.line.update(self.text(stats))

    def done(self) -> None:
        self.line.done()
