"""A window of batches under torch.profiler: is the GPU slow inside a batch, or waiting for the host?

`DFLASH_PROFILE=FIRST:COUNT:PATH` makes extraction's GPU loop profile batches FIRST .. FIRST+COUNT-1
(counted over the whole run, per process) and write PATH (other ranks than 0: `.rankN` before the
extension): the window's kernel time against its GPU span, the largest gaps between
consecutive kernels and what the host was running then, and the kernels by total time. Kernel time
near the span means the GPU was busy and its kernels are what they cost; a span well above kernel
time means the GPU waited between kernels for the host.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_pipeline.errors import DFlashError

ENV = "DFLASH_PROFILE"


@dataclass
class ProfileWindow:
    first: int
    count: int
    path: Path

    @classmethod
    def from_env(cls, rank: int = 0) -> "ProfileWindow | None":
        spec = os.environ.get(ENV)
        if not spec:
            return None
        try:
            first, count, path = spec.split(":", 2)
            window = cls(int(first), int(count), Path(path))
        except ValueError:
            raise DFlashError(f"{ENV}={spec!r}: expected FIRST:COUNT:PATH, e.g. 10:4:/tmp/profile.json") from None
        if window.first < 0 or window.count < 1:
            raise DFlashError(f"{ENV}={spec!r}: FIRST must be >= 0 and COUNT >= 1")
        if rank > 0:
            window.path = window.path.with_name(f"{window.path.stem}.rank{rank}{window.path.suffix}")
        return window


class BatchProfiler:
    """Call `before(i)` before batch i is launched; it starts and stops the profiler at the window."""

    def __init__(self, window: ProfileWindow | None, label: str = ""):
        self.window, self.label = window, label
        self.prof = None
        self.done = window is None

    def before(self, batch_index: int, tokens_so_far: int = 0) -> None:
        if self.done:
            return
        w = self.window
        if self.prof is None and batch_index == w.first:
            self.tokens0 = tokens_so_far
            self.prof = torch.profiler.profile(activities=_activities())
            self.prof.__enter__()
        elif self.prof is not None and batch_index == w.first + w.count:
            self.finish(tokens_so_far)

    def finish(self, tokens_so_far: int = 0) -> None:
        if self.prof is None or self.done:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        try:
            report = summarize(self.prof)
        except Exception as e:  # a diagnostic must not end the run; the table below still says a lot
            report = {"summary_error": f"{type(e).__name__}: {e}"}
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        report["table"] = self.prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70)
        report.update(label=self.label, batches=self.window.count, tokens=tokens_so_far - self.tokens0)
        self.window.path.parent.mkdir(parents=True, exist_ok=True)
        self.window.path.write_text(json.dumps(report, indent=1))
        self.done = True


def _activities():
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def summarize(prof, top: int = 12) -> dict[str, Any]:
    """Kernel time, GPU span, gaps between kernels (with the host op running at each gap's start) and
    the kernels by total time, from a finished torch.profiler session."""
    events = list(prof.events())
    kernels = sorted((e for e in events if _is_device(e)), key=lambda e: e.time_range.start)
    host = sorted((e for e in events if not _is_device(e)), key=lambda e: e.time_range.start)
    out: dict[str, Any] = {"kernels": len(kernels)}
    if not kernels:
        return out
    busy = 0.0
    gaps = []
    end = kernels[0].time_range.start
    for k in kernels:
        s, e = k.time_range.start, k.time_range.end
        if s > end:
            gaps.append((s - end, end))
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    span = end - kernels[0].time_range.start
    gaps.sort(reverse=True)
    by_name: dict[str, float] = {}
    for k in kernels:
        by_name[k.name] = by_name.get(k.name, 0.0) + (k.time_range.end - k.time_range.start)
    out.update(
        kernel_busy_s=busy / 1e6, span_s=span / 1e6, busy_fraction=busy / span if span else 1.0,
        gaps_total_s=sum(g for g, _ in gaps) / 1e6, gaps_over_100us=sum(1 for g, _ in gaps if g > 100),
        largest_gaps=[{"us": round(g, 1), "host_op": _host_op_at(host, t)} for g, t in gaps[:top]],
        top_kernels=[{"name": n[:120], "s": v / 1e6} for n, v in sorted(by_name.items(), key=lambda x: -x[1])[:top]],
    )
    return out


def _is_device(e) -> bool:
    """A compute kernel (copies and memsets run on their own engines and streams: left out)."""
    return str(getattr(e, "device_type", "")).endswith("CUDA") and not e.name.startswith(("Memcpy", "Memset"))


def _host_op_at(host, t: float) -> str:
    """The innermost host op running at time t (a gap's start: what the host was doing)."""
    best = None
    for e in host:
        if e.time_range.start > t:
            break
        if e.time_range.end >= t and (best is None or e.time_range.start >= best.time_range.start):
            best = e
    return best.name if best is not None else ""
