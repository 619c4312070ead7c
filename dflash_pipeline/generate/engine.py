"""Continuous batching: R rows decode at once, and a row whose reply ends takes the next prompt.

The decoding itself (static KV cache, one graph launch per step) belongs to a row runner behind the
`DecodeRows` protocol: reset a row, prefill a row with a prompt, step every row by one token. This
module only decides what each row does, and keeps the device busy while deciding:

- Tokens never leave the device on their way to the next step: a step's sampled tokens are the next
  step's input (`sampling.sample_rows`, no host synchronisation).
- The host reads them one step late. Before each step it copies the step's input tokens (the previous
  step's samples, and a new row's first token) into pinned memory asynchronously, launches the step,
  and only then waits for the copy, which finished before the step began: the host's bookkeeping
  (stop tokens, limits, the next prompt's tokenization) overlaps the GPU's step. The price is one
  wasted step per finished reply: the row has been stepped once more when the host sees its stop
  token. That step writes one K/V slot past the reply, inside the row's capacity (a reply may use
  `capacity - prompt` tokens, and that last slot is the one the wasted step fills); the row is
  reset before its next prompt.
- A row is reset as soon as its reply ends. Rows without work (waiting for a refill, or at the end
  of a run) keep stepping, since the step's shape is fixed, and are reset every `PARK_AT` steps: a
  runner may attend to as many slots as its longest row needs, and idle rows must not be that row.
- Freed rows are refilled together once `refill_at` of them (1/16 of the rows) are free, or when no
  row is busy: one prefill forward for many prompts instead of one each (an eager forward costs the
  same host time whatever its size). The rows waiting meanwhile cost a few steps of 1/16 of the batch.

Legend: R rows, V vocabulary, P prompt tokens.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from dflash_pipeline.generate.sampling import sample_rows

PARK_AT = 64   # an idle row is reset after this many steps (it must never be a runner's longest row)


class DecodeRows(Protocol):
    """A row runner: R sequences over a static KV cache of `capacity` slots each."""

    num_rows: int
    capacity: int
    device: torch.device

    def reset_row(self, row: int) -> None:
        """Forget the row's sequence (length 0)."""

    def prefill_rows(self, rows: list[int], prompts: list[torch.Tensor]) -> torch.Tensor:
        """Reset the rows and write one prompt into each; fp32 logits [n, V] at each prompt's last token."""

    def step(self, tokens_R: torch.Tensor) -> torch.Tensor:
        """Append one token to every row at its next position; fp32 logits [R, V]."""

    def close(self) -> None:
        """Release the runner (the model is usable on its own again)."""


@dataclass
class Request:
    key: Any                 # the caller's handle, given back with the reply
    prompt: Sequence[int]
    seed: int                # the reply's random stream (sampling.row_seed)
    max_tokens: int          # tokens it may generate, its stop token included
    limit_reason: str        # why it ends if it reaches max_tokens ('length' or 'context')


@dataclass
class Finished:
    request: Request
    tokens: list[int]        # generated tokens, the stop token included when there is one
    finish: str              # 'stop' or request.limit_reason


class RequestSource(Protocol):
    def next_request(self) -> Request | None:
        """A request to start now, or None (nothing ready)."""

    def finished(self, done: Finished) -> None:
        """A reply ended; the source may now have a follow-up request ready."""

    def exhausted(self) -> bool:
        """True when no request will ever come again."""


@dataclass
class EngineStats:
    steps: int = 0
    tokens: int = 0                  # generated tokens, stop tokens included
    replies: int = 0
    prefill_tokens: int = 0
    prefills: int = 0                # prefill calls (each of one or more rows)
    finish: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    busy_row_steps: int = 0          # sum over steps of rows with a reply in progress
    context_row_steps: int = 0       # sum over steps and busy rows of the tokens each row attended to

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "tokens": self.tokens, "replies": self.replies,
                "prefill_tokens": self.prefill_tokens, "prefills": self.prefills, "finish": dict(self.finish), "seconds": self.seconds,
                "tokens_per_second": self.tokens / self.seconds if self.seconds else 0.0,
                "busy_rows_per_step": self.busy_row_steps / max(self.steps, 1),
                "mean_context": self.context_row_steps / max(self.busy_row_steps, 1)}


class Engine:
    """Runs requests from a source on a row runner until the source is exhausted and every row is idle."""

    def __init__(self, rows: DecodeRows, *, stop_ids: Sequence[int], temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, refill_at: int | None = None):
        self.rows = rows
        self.R = rows.num_rows
        self.refill_at = refill_at or max(1, self.R // 16)
        self.device = rows.device
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        self.stats = EngineStats()
        self.tokens_R = torch.zeros(self.R, dtype=torch.long, device=self.device)
        self.seed_R = torch.zeros(self.R, dtype=torch.long, device=self.device)
        self.counter_R = torch.zeros(self.R, dtype=torch.long, device=self.device)
        self._host_R = torch.zeros(self.R, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self._req: list[Request | None] = [None] * self.R
        self._out: list[list[int]] = [[] for _ in range(self.R)]
        self._idle_steps = [0] * self.R   # steps an idle row took since its reset

    # -- rows ------------------------------------------------------------------------------------

    def _fill(self, source: RequestSource) -> None:
        """Start requests on the free rows (all in one prefill), once enough rows are free."""
        free = [row for row in range(self.R) if self._req[row] is None]
        if not free or (len(free) < self.R and len(free) < self.refill_at):
            return
        starts: list[tuple[int, Request]] = []
        for row in free:
            req = source.next_request()
            if req is None:
                break
            if not 1 <= req.max_tokens <= self.rows.capacity - len(req.prompt):
                raise ValueError(f"request of {len(req.prompt)} prompt tokens and {req.max_tokens} new tokens "
                                 f"does not fit a row of {self.rows.capacity}")
            starts.append((row, req))
        if not starts:
            return
        rows = [row for row, _ in starts]
        prompts = [torch.as_tensor(np.asarray(req.prompt, dtype=np.int64)).to(self.device, non_blocking=True)
                   for _, req in starts]
        logits_nV = self.rows.prefill_rows(rows, prompts)
        rows_n = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        seed_n = torch.tensor([req.seed for _, req in starts], dtype=torch.long).to(self.device, non_blocking=True)
        first_n = sample_rows(logits_nV, seed_n, torch.zeros_like(seed_n), **self.sampling)
        self.tokens_R.index_copy_(0, rows_n, first_n)
        self.seed_R.index_copy_(0, rows_n, seed_n)
        self.counter_R.index_fill_(0, rows_n, 1)
        for row, req in starts:
            self._req[row] = req
            self._out[row] = []
            self.stats.prefill_tokens += len(req.prompt)
        self.stats.prefills += 1

    def _read(self, host_R: np.ndarray, source: RequestSource) -> None:
        """Take each busy row's newest token; end the replies that stop or reach their limit."""
        for row in range(self.R):
            req = self._req[row]
            if req is None:
                continue
            tok = int(host_R[row])
            out = self._out[row]
            out.append(tok)
            self.stats.context_row_steps += len(req.prompt) + len(out)
            if tok in self.stop_ids:
                finish = "stop"
            elif len(out) >= req.max_tokens:
                finish = req.limit_reason
            else:
                continue
            self._req[row] = None
            self.rows.reset_row(row)  # after the step already launched for it, in stream order
            self._idle_steps[row] = 0
            self.stats.replies += 1
            self.stats.tokens += len(out)
            self.stats.finish[finish] += 1
            source.finished(Finished(req, out, finish))

    def _park_idle(self) -> None:
        """Reset idle rows before their ever-stepping sequence grows long (or reaches the capacity)."""
        for row in range(self.R):
            if self._req[row] is None:
                self._idle_steps[row] += 1
                if self._idle_steps[row] >= min(PARK_AT, self.rows.capacity - 1):
                    self.rows.reset_row(row)
                    self._idle_steps[row] = 0

    # -- the loop --------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, source: RequestSource, on_step=None) -> EngineStats:
        """Decode until the source is exhausted and no reply is in progress; `on_step(stats)` after each step."""
        t0 = time.perf_counter()
        while True:
            self._fill(source)
            busy = sum(r is not None for r in self._req)
            if busy == 0:
                if source.exhausted():
                    break
                raise RuntimeError("the request source has nothing to start, yet no reply is in progress")
            # One buffer suffices: it is read (below) before the next copy into it is queued.
            self._host_R.copy_(self.tokens_R, non_blocking=True)
            event = None
            if self.device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
            logits_RV = self.rows.step(self.tokens_R)
            self.tokens_R = sample_rows(logits_RV, self.seed_R, self.counter_R, **self.sampling)
            self.counter_R += 1
            self._park_idle()
            if event is not None:
                event.synchronize()
            self.stats.steps += 1
            self.stats.busy_row_steps += busy
            self._read(self._host_R.numpy(), source)
            if on_step is not None:
                on_step(self.stats)
        self.stats.seconds += time.perf_counter() - t0
        return self.stats
