"""Capture once, replay many: a step as one CUDA graph launch, and per-step timers.

A `GraphedStep` wraps a function of no arguments that reads and writes only static buffers (its
inputs are written into buffers before a call, its outputs copied into buffers inside it). On CUDA the
first call warms it up on a side stream (kernel selection, lazy allocations, cuBLAS workspaces), then
captures it; every call after that is one `graph.replay()`. Nothing compiles inside a capture: where a
compiled function's guards fail there, the capture is given up before anything ran, and the step warms
up once more and captures again (`no_compiling`). Nor does Python's cyclic garbage collector run inside
one (`no_collection`): torch no longer collects before a capture (`force_cudagraph_gc`, off by default),
so a collection falling inside it would release whatever earlier code left in reference cycles
(compiled modules, events, other runs' objects), and a CUDA call such a release makes, illegal inside a
capture, would end it. That is our suspect for a Gemma 3 capture test that failed only after other test
files had run in the same process ("operation failed due to a previous error during capture"); not yet
confirmed on a GPU. Elsewhere it is the function itself, so the CPU tests run the same code the GPU replays.

Graphs of one runner share a memory pool: they replay one at a time on one stream, and none of them
leaves a live tensor in the pool (outputs live in buffers allocated outside any capture), so a later
capture may reuse an earlier one's temporaries.

`StepTimer` times named steps without synchronising: CUDA events recorded around each call, read at
the end; the host clock on the CPU.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from typing import Callable

import torch


class GraphedStep:
    def __init__(self, fn: Callable[[], None], device: torch.device, pool=None, enabled: bool | None = None,
                 warmup: int = 2):
        self.fn, self.device, self.pool, self.warmup = fn, device, pool, warmup
        self.enabled = device.type == "cuda" if enabled is None else enabled
        self.graph = None

    def __call__(self) -> None:
        if not self.enabled:
            self.fn()
        elif self.graph is None:
            self._capture()
            self.graph.replay()  # the warm-up runs are not the call: run it once more, as a replay
        else:
            self.graph.replay()

    def _capture(self) -> None:
        side = torch.cuda.Stream(self.device)
        warmup = self.warmup
        for _ in range(CAPTURE_ATTEMPTS):
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    self.fn()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with no_collection(), torch.cuda.graph(graph, pool=self.pool), no_compiling():
                    self.fn()
            except RecompileRequested as e:
                reason, warmup = e, 1   # compile it outside the capture, then capture again
                continue
            self.graph = graph
            return
        raise RuntimeError(f"a graphed step still asked torch.compile to recompile after {CAPTURE_ATTEMPTS} "
                           f"warm-ups; run it without compiling (dflash eval without --compile, dflash generate "
                           f"--no-compile): {reason}") from reason


CAPTURE_ATTEMPTS = 3


class RecompileRequested(RuntimeError):
    """torch.compile wanted to compile a frame again where it must not (inside a CUDA graph capture)."""


@contextmanager
def no_compiling():
    """Inside: a compiled function whose guards fail raises RecompileRequested instead of compiling.

    Compiling inside a CUDA graph capture would break the capture in ways that outlive it: Inductor
    benchmarks candidate kernels with fresh random tensors and synchronisations, which invalidate the
    capture, and a failed capture leaves the CUDA generator mid-capture, so the process's next random op
    fails ("Offset increment outside graph capture"). Raised early, before anything runs, the capture
    ends cleanly and the caller warms up again outside it (a test on the GPU checks this).
    """
    stance = getattr(torch.compiler, "set_stance", None)
    if stance is None:   # torch < 2.6: no stance to ask for
        yield
        return
    try:
        with stance("fail_on_recompile"):
            yield
    except RuntimeError as e:
        if "fail_on_recompile" in str(e) and not isinstance(e, RecompileRequested):
            raise RecompileRequested(str(e)) from e
        raise


@contextmanager
def no_collection():
    """Python's cyclic garbage collector paused inside (as it was outside, after)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def new_pool(device: torch.device):
    """A memory pool for the graphs of one runner (None off CUDA)."""
    return torch.cuda.graph_pool_handle() if device.type == "cuda" else None


class StepTimer:
    """Milliseconds per named step: events on CUDA (no sync until `summary`), host clock elsewhere."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.cuda = device.type == "cuda"
        self.enabled = enabled
        self._events: dict[str, list] = {}
        self._ms: dict[str, list[float]] = {}

    @contextmanager
    def __call__(self, name: str):
        if not self.enabled:
            yield
            return
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            pending = self._events.setdefault(name, [])
            pending.append((start, end))
            if len(pending) > 256:  # read the finished ones without waiting, so events do not pile up
                self._drain(name, pending)
        else:
            t0 = time.perf_counter()
            yield
            self._ms.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)

    def _drain(self, name: str, pending: list) -> None:
        done = 0
        while done < len(pending) and pending[done][1].query():
            done += 1
        self._ms.setdefault(name, []).extend(s.elapsed_time(e) for s, e in pending[:done])
        del pending[:done]

    def times(self, name: str) -> list[float]:
        """Every recorded time of `name` in ms (synchronises once on CUDA)."""
        if self._events.get(name):
            torch.cuda.synchronize()
            self._ms.setdefault(name, []).extend(s.elapsed_time(e) for s, e in self._events.pop(name))
        return list(self._ms.get(name, []))

    def summary(self) -> dict[str, float]:
        """Median ms per step name."""
        out = {}
        for name in sorted({*self._events, *self._ms}):
            ts = sorted(self.times(name))
            if ts:
                out[name] = ts[len(ts) // 2]
        return out


__all__ = ["GraphedStep", "RecompileRequested", "StepTimer", "new_pool", "no_compiling"]
