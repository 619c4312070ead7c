"""A reference `DecodeRows`: plain HF decoding of each row alone, with its own DynamicCache.

Slow and unbatched on purpose: it is what a batched row runner must reproduce, and it lets the
continuous-batching loop be tested apart from any runner.
"""

from __future__ import annotations

import torch

from dflash_pipeline.eval.models import Target


class NaiveRows:
    def __init__(self, model, num_rows: int, capacity: int):
        self.target = Target(model)
        self.num_rows, self.capacity = num_rows, capacity
        self.device = self.target.device
        self.caches = [None] * num_rows
        self.lengths = [0] * num_rows
        self.prompts: list[list[int]] = []   # every prompt prefilled, in order (tests read them)

    def reset_row(self, row: int) -> None:
        self.caches[row], self.lengths[row] = None, 0

    def prefill_rows(self, rows: list[int], prompts: list[torch.Tensor]) -> torch.Tensor:
        out = []
        for row, ids_P in zip(rows, prompts):
            assert len(ids_P) < self.capacity
            self.prompts.append(ids_P.tolist())
            self.caches[row] = self.target.new_cache()
            logits, _ = self.target.forward(ids_P.tolist(), 0, self.caches[row], last_only=True)
            self.lengths[row] = len(ids_P)
            out.append(logits[-1])
        return torch.stack(out)

    def close(self) -> None:
        self.target.close()

    def step(self, tokens_R: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.num_rows, self.target.model.config.vocab_size)
        for row in range(self.num_rows):
            assert self.lengths[row] < self.capacity, "a row was stepped past its capacity"
            if self.caches[row] is not None:  # an idle row's step computes nothing anyone reads
                logits, _ = self.target.forward([int(tokens_R[row])], self.lengths[row], self.caches[row],
                                                last_only=True)
                out[row] = logits[-1]
            self.lengths[row] += 1
        return out


class naive_rows_factory:
    """`rows_factory` for run_generate (picklable, for spawned worker processes)."""

    def __init__(self, num_rows: int):
        self.num_rows = num_rows

    def __call__(self, model, cfg, device, line, max_rows):
        return NaiveRows(model, min(self.num_rows, max_rows), cfg.max_length)
