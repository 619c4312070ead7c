"""Choosing the next token of every row on the device, each row with its own seeded random stream.

Why not `torch.multinomial` with a generator: one generator serves a whole call, so a row's sample
would depend on which other rows share the batch and in which order; a generator per row would cost a
kernel launch per row per step. Instead every row draws from a counter-based stream: the uniform
number for candidate token v of row r at its n-th generated token is a hash of (the row's seed, n, v)
(splitmix64's finaliser in int64 arithmetic, on the device, no state). Sampling is then the Gumbel-max
rule, argmax over candidates of logits / T + Gumbel(u), which draws exactly from softmax(logits / T)
over the candidates. A row's tokens therefore depend only on its seed (from --seed, the sample id and
the turn) and its own logits: not on batch composition, row order, GPU count or a resumed run, as far
as the logits themselves do not.

top-k keeps the k largest logits; top-p then keeps the smallest prefix of the (temperature-scaled,
renormalised) candidates, by decreasing probability, whose mass reaches p (HF's order of processors:
temperature, top-k, top-p). Temperature 0 is greedy (argmax) and ignores both, as HF does.

Legend: R rows, V vocabulary, K candidates per row (V without top-k/top-p).
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 value torch stores for it."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def _mix_int(x: int) -> int:
    """splitmix64's finaliser on a Python int (host side)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return x ^ (x >> 31)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors; multiplication wraps modulo 2^64 as in C."""
    x = (x ^ _shr(x, 30)) * _signed(_M1)
    x = (x ^ _shr(x, 27)) * _signed(_M2)
    return x ^ _shr(x, 31)


def row_seed(seed: int, sample_id: int, turn: int) -> int:
    """The random stream of one reply: from the run's seed, the conversation and the reply slot."""
    return _signed(_mix_int(_mix_int(_mix_int(seed) + sample_id * _GOLDEN) + (turn + 1) * _GOLDEN))


def uniform(seed_R: torch.Tensor, counter_R: torch.Tensor, ids_RK: torch.Tensor) -> torch.Tensor:
    """float32 [R, K] in (0, 1): row r's number for token ids_RK[r, k] at its counter_R[r]-th token."""
    step_R = _mix(seed_R + (counter_R + 1) * _signed(_GOLDEN))
    bits_RK = _mix(step_R[:, None] + (ids_RK + 1) * _signed(_GOLDEN))
    # 23 bits, centred: (k + 0.5) / 2^23 is exact in float32 and never 0 or 1, so the log-logs stay finite.
    return (_shr(bits_RK, 41).to(torch.float32) + 0.5) * (2.0 ** -23)


def candidates(logits_RV: torch.Tensor, temperature: float, top_k: int,
               top_p: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scaled logits [R, K] with -inf where excluded, their token ids [R, K] or None for 0..V-1)."""
    scaled = logits_RV.float() / temperature
    if top_k <= 0 and top_p >= 1.0:
        return scaled, None
    if 0 < top_k < scaled.shape[-1]:
        vals_RK, ids_RK = scaled.topk(top_k, dim=-1)  # sorted, largest first
    else:
        vals_RK, ids_RK = scaled.sort(dim=-1, descending=True)
    if top_p < 1.0:
        probs_RK = torch.softmax(vals_RK, dim=-1)
        before_RK = probs_RK.cumsum(-1) - probs_RK  # mass of the more likely candidates
        vals_RK = vals_RK.masked_fill(before_RK >= top_p, float("-inf"))  # the first is always kept
    return vals_RK, ids_RK


def sample_rows(logits_RV: torch.Tensor, seed_R: torch.Tensor, counter_R: torch.Tensor, *, temperature: float,
                top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The next token of every row, int64 [R], on the logits' device; no host synchronisation."""
    if temperature == 0:
        return logits_RV.argmax(dim=-1)
    vals_RK, ids_RK = candidates(logits_RV, temperature, top_k, top_p)
    ids = ids_RK if ids_RK is not None else torch.arange(vals_RK.shape[-1], device=vals_RK.device)[None, :]
    u_RK = uniform(seed_R, counter_R, ids.expand_as(vals_RK))
    pick_R = (vals_RK - torch.log(-torch.log(u_RK))).argmax(dim=-1)
    return pick_R if ids_RK is None else ids_RK.gather(-1, pick_R[:, None])[:, 0]
