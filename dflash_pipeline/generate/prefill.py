"""Prefill several rows of the decoding runner in one forward.

Why: the runner prefills one row per eager forward, and an eager forward costs hundreds of kernel
launches of host time whatever its size (on the GPU machine's host about as long as transformers'
whole `generate()` step, ~100 ms). Generation refills a row every few steps, so one-row prefills
would cost more host time than the graphed decode steps between them. Here the prompts of several
freed rows go through one forward, right-padded to the longest, in chunks of at most `chunk` tokens
per row and `max_tokens` padded tokens per forward.

How: it is the runner's own step machinery (its attention function, static K/V buffers, slot and
position bookkeeping) over an arbitrary set of rows instead of a contiguous slice: `RowsState` writes
each row's new keys and values into the runner's buffers at (row, slot) and attends over a gathered
copy of those rows. Padding tokens sit after each row's real tokens, so causal attention hides them
from real tokens; they are written to slots past the row's new length, which stay invisible (the
runner's rule for uncommitted slots) and are overwritten later. The LM head runs only on each row's
last prompt token (the base model's output gathered there, then the target's head with its logit
scale and soft-capping), so no [rows, tokens, vocabulary] tensor exists.

Legend: n rows in the forward, q tokens per row in this chunk, S attended slots, hk KV heads, D head
dim, V vocabulary.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from dflash_pipeline.decoding.attention import StepState, active
from dflash_pipeline.decoding.runner import SLOT_ROUND, DecodingRunner, round_up
from dflash_pipeline.extract.target import base_model


class RowsState(StepState):
    """A `StepState` over the rows `rows_n` (any set, any order) of the runner's buffers."""

    def __init__(self, runner: DecodingRunner, rows_n: torch.Tensor, q: int, slots: int):
        n, dev = rows_n.numel(), runner.device
        lengths_n = runner.lengths_R.index_select(0, rows_n)
        self.rows_n = rows_n
        self.write_nq = lengths_n[:, None] + torch.arange(q, device=dev)
        slot_pos_nS = runner.slot_pos_RS.index_select(0, rows_n)
        super().__init__(runner.kv, rows_n, lengths_n, torch.arange(q, device=dev)[None].expand(n, q),
                         torch.ones(q, q, dtype=torch.bool, device=dev).tril()[None].expand(n, q, q),
                         slot_pos_nS, slots, groups=runner.groups, windows=runner.windows)
        runner.slot_pos_RS.index_copy_(0, rows_n, slot_pos_nS)  # the new tokens' positions, for sliding windows

    def write(self, layer: int, key_nkqD: torch.Tensor, value_nkqD: torch.Tensor):
        n, hk, q, _ = key_nkqD.shape
        at = (self.rows_n[:, None, None].expand(n, hk, q), torch.arange(hk, device=key_nkqD.device)[None, :, None]
              .expand(n, hk, q), self.write_nq[:, None, :].expand(n, hk, q))
        k_buf, v_buf = self.kv.keys_L[layer], self.kv.values_L[layer]   # [R, hk, S, D]
        k_buf.index_put_(at, key_nkqD.to(k_buf.dtype))
        v_buf.index_put_(at, value_nkqD.to(v_buf.dtype))
        # Only the attended slots of these rows are copied.
        return (k_buf[:, :, :self.slots].index_select(0, self.rows_n),
                v_buf[:, :, :self.slots].index_select(0, self.rows_n))


@torch.inference_mode()
def _forward(runner: DecodingRunner, rows: list[int], chunks: list[torch.Tensor],
             head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One forward of each row's next chunk (appended at its length, then committed); fp32 logits [n, V]
    at each chunk's last token."""
    n, q = len(rows), max(c.numel() for c in chunks)
    ids_nq = torch.zeros(n, q, dtype=torch.long, device=runner.device)
    for i, c in enumerate(chunks):
        ids_nq[i, :c.numel()] = c
    longest = max(runner.length(r) + q for r in rows)
    rows_n = torch.tensor(rows, dtype=torch.long).to(runner.device)
    state = RowsState(runner, rows_n, q, min(runner.slots, round_up(longest, SLOT_ROUND)))
    with active(state):
        hidden_nqH = base_model(runner.model)(input_ids=ids_nq, position_ids=state.pos_Rq,
                                              use_cache=False).last_hidden_state
    for r, c in zip(rows, chunks):
        runner.set_length(r, runner.length(r) + c.numel())
    last_n = torch.tensor([c.numel() - 1 for c in chunks]).to(runner.device)
    return head(hidden_nqH[torch.arange(n, device=runner.device), last_n])


def prefill_rows(runner: DecodingRunner, rows: Sequence[int], prompts: Sequence[torch.Tensor], *,
                 head: Callable[[torch.Tensor], torch.Tensor], chunk: int, max_tokens: int) -> torch.Tensor:
    """Reset `rows` and write `prompts` into them; fp32 logits [n, V] at each prompt's last token.
    `head`: final hidden states [n, H] -> the target's fp32 logits (eval.models.Target.logits).

    Rows go in groups of similar length (longest first) of at most `max_tokens` padded tokens per
    forward; a prompt longer than `chunk` runs in several forwards.
    """
    out = [None] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: -prompts[i].numel())
    for r in rows:
        runner.reset(r)
    group: list[int] = []
    for i in order + [None]:
        width = min(chunk, prompts[group[0]].numel()) if group else 0
        if i is not None and (not group or (len(group) + 1) * width <= max_tokens):
            group.append(i)
            continue
        done = {g: 0 for g in group}   # tokens of each prompt already written
        while done:
            live = list(done)
            pieces = [prompts[g][done[g]:done[g] + chunk] for g in live]
            logits = _forward(runner, [rows[g] for g in live], pieces, head)
            for j, g in enumerate(live):
                done[g] += pieces[j].numel()
                if done[g] == prompts[g].numel():
                    out[g] = logits[j]
                    del done[g]
        group = [i] if i is not None else []
    return torch.stack(out)
