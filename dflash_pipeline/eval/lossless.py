"""Is greedy speculative decoding lossless? The rule, per dtype, as small pure functions.

At temperature 0 speculative decoding must commit exactly the target's greedy tokens. In fp32 the
target's verify pass (a block of tokens) and its one-token decode step agree far below any logit
margin that occurs in practice, so the check is exact: any difference fails.

In bf16/fp16 the passes are different kernels (different reduction orders, different tiles), and the
logits they produce legitimately differ by a few rounding steps: every layer's output is rounded, so
the difference is not one rounding of the final logit but what every layer's roundings add up to. Where
the target's top two logits are that close, the passes may pick different tokens: a **tie
divergence**, a fact of the arithmetic, not a bug. The rule:

    a divergence at position i is a tie iff  top1_i - top2_i <= TIE_ULPS * ulp(dtype, max(|top1_i|, |top2_i|))

where ulp(dtype, x) is the spacing of the dtype's numbers at magnitude x (bf16: 2^(e - 7) for
x in [2^e, 2^(e+1)); a bf16 logit near 20 has ulp 0.125, so TIE_ULPS = 12 excuses margins up to 1.5
there). A divergence at a clear margin is a failure.

TIE_ULPS is measured, not assumed (`bench/tie_rule.py`): the real SmolLM2-135M in bf16, 2,048 greedy
positions, puts the same top-2 margin this far apart between its one-token decode step and a chain
verify (blocks of 16 or 65), a tree-laid-out verify and a plain forward (transformers' own, another
algorithm altogether):
- on an H200 with the default kernel there (`math`, fp32 scores; decoding/attention.py): in its current
  form (the bf16 GEMM writing fp32 scores) p99 2, p99.9 2-4, max 3 (chain) and **11** (tree), 7 against
  the plain forward; in its first form (Q and K upcast before the product) max 8 (chain) and 7 (tree);
  with SDPA the chain's max was 3 but the tree verify's 46;
- on the CPU with the default kernel there (SDPA): p99 2-3, p99.9 4, max 4 (chain) and 5.5 (tree); the
  written-out kernel: max 8-9, 12 against the plain forward.
- with the steps compiled (`dflash eval --compile`: Inductor's fused kernels around the same products), on
  an H100: p99 2, p99.9 6, max **13** (chain) and 7 (tree). Inductor's fusions round at other places than
  the eager kernels, so the compiled steps get their own tolerance, TIE_ULPS_COMPILED = 16 (3 ulp above
  the widest gap measured; the rare tail is why the margin is kept); the report states which.
The first rule (2 ulp: one rounding per pass) failed correct GPU tree runs at 4 ulp although fp32 was
exact on the same prompts; the second (8) covered every gap then measured, until the GPU kernel's
current form put one tree-verify position of 2,048 at 11. 12 covers every gap measured between the
decoding passes of each device's default kernel; the gap is heavy-tailed, so a rare divergence past it
on a correct run stays possible (that is what fp32 settles). What the rule gives up is the check at
the positions whose margin is that small (about 40% of them for SmolLM2 on chat prompts), where a bug
would pass as a tie: a bug shows at the others, and fp32 (`--dtype fp32`) stays exact everywhere.

After a tie the two outputs continue from different prefixes, so comparing them further says nothing.
The speculative output is then checked against the target's own greedy choice along the speculative
path itself: one forward pass over prompt + speculative tokens (teacher forcing) gives, at every
later position, the target's argmax and its top-two logits given exactly the tokens speculative
decoding committed; each disagreement is again a tie (counted) or a failure (reported). tau is
measured on the speculative path, as it was decoded.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch

TIE_ULPS = 12  # the spread of the target's own passes, measured (module docstring)
TIE_ULPS_COMPILED = 16  # the same, with the passes compiled (their fusions round elsewhere; measured)


def tie_ulps_for(compiled: bool) -> int:
    """The tie tolerance of a run whose decode and verify steps are (or are not) torch.compile'd."""
    return TIE_ULPS_COMPILED if compiled else TIE_ULPS

_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}


def logit_ulp(value: float, dtype: torch.dtype) -> float:
    """Spacing of `dtype`'s representable numbers at magnitude |value| (the smallest normal's below it)."""
    bits = _MANTISSA_BITS[dtype]
    tiny = torch.finfo(dtype).tiny
    exponent = math.floor(math.log2(max(abs(value), tiny)))
    return 2.0 ** (exponent - bits)


def is_exact_dtype(dtype: torch.dtype) -> bool:
    """fp32/fp64: greedy output must equal plain decoding token for token."""
    return dtype in (torch.float32, torch.float64)


def is_tie(top1: float, top2: float, dtype: torch.dtype, ulps: int = TIE_ULPS) -> bool:
    """The target's top two logits are within `ulps` of the dtype's rounding of each other (never in fp32)."""
    if is_exact_dtype(dtype):
        return False
    return top1 - top2 <= ulps * logit_ulp(max(abs(top1), abs(top2)), dtype)


def rule_text(dtype: torch.dtype, ulps: int = TIE_ULPS) -> str:
    if is_exact_dtype(dtype):
        return "exact: token for token equal to plain greedy decoding"
    name = str(dtype).removeprefix("torch.")
    return (f"equal to plain greedy decoding except at ties: top-2 logit margin <= {ulps} ulp of {name} "
            f"at the logit's magnitude; after a tie, each token is the target's argmax along the speculative path")


@dataclass
class Divergence:
    """Where the speculative output left the target's greedy choice, and how close the target was."""

    prompt: int
    position: int            # index into the generated tokens
    spec_token: int | None
    target_token: int | None
    top1: float | None       # the target's top two logits at that position (None: not known)
    top2: float | None
    tie: bool
    against: str             # "plain" (plain decoding's output) or "path" (teacher forcing along the spec path)

    @property
    def margin(self) -> float | None:
        return None if self.top1 is None else self.top1 - self.top2

    def to_dict(self) -> dict:
        return {**asdict(self), "margin": self.margin}


@dataclass
class LosslessCheck:
    failure: Divergence | None     # the first divergence at a clear margin, if any
    ties: list[Divergence]         # tie divergences, in order
    tie_ulps: int = TIE_ULPS       # the tolerance it was judged with


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where a and b differ (a shorter list differs at its end), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _at(seq: Sequence, i: int):
    return seq[i] if i < len(seq) else None


PathScores = Callable[[], tuple[list[int], list[float], list[float]]]
"""Teacher forcing along the speculative path: (argmax, top1 logit, top2 logit) per generated position."""


def check_greedy(prompt: int, spec: Sequence[int], plain: Sequence[int], plain_top1: Sequence[float],
                 plain_top2: Sequence[float], dtype: torch.dtype, path_scores: PathScores, *,
                 tie_ulps: int = TIE_ULPS) -> LosslessCheck:
    """Classify where `spec` leaves the target's greedy output (see the module docstring for the rule).

    plain_top1/plain_top2: the target's two largest logits at each position of plain decoding.
    path_scores is only called after a tie (it costs one forward over the whole sequence).
    tie_ulps: the tolerance of the passes that produced both outputs (`tie_ulps_for`).
    """
    i = first_difference(spec, plain)
    if i is None:
        return LosslessCheck(None, [], tie_ulps)
    top1, top2 = _at(plain_top1, i), _at(plain_top2, i)
    first = Divergence(prompt, i, _at(spec, i), _at(plain, i), top1, top2,
                       tie=top1 is not None and _at(spec, i) is not None and is_tie(top1, top2, dtype, tie_ulps),
                       against="plain")
    if not first.tie:
        return LosslessCheck(first, [], tie_ulps)
    ties = [first]
    argmax, path_top1, path_top2 = path_scores()
    for j in range(i + 1, len(spec)):
        if spec[j] == argmax[j]:
            continue
        d = Divergence(prompt, j, spec[j], argmax[j], path_top1[j], path_top2[j],
                       tie=is_tie(path_top1[j], path_top2[j], dtype, tie_ulps), against="path")
        if not d.tie:
            return LosslessCheck(d, ties, tie_ulps)
        ties.append(d)
    return LosslessCheck(None, ties, tie_ulps)


def top2_logits(logits_nV: torch.Tensor) -> tuple[list[float], list[float]]:
    """(top-1, top-2) logit values per row, as Python floats (one device-to-host copy)."""
    top = logits_nV.float().topk(2, dim=-1).values.cpu()
    return top[:, 0].tolist(), top[:, 1].tolist()


@torch.inference_mode()
def teacher_forcing(target, prompt: Sequence[int], generated: Sequence[int],
                    chunk: int = 512) -> tuple[list[int], list[float], list[float]]:
    """The `PathScores` of a generated sequence: the target's argmax, top-1 and top-2 logit at every
    generated position, given the prompt and the generated tokens before it.

    One forward of the target (eval.speculative.TargetLike: the eager one, or the graphed one's
    prefill) over prompt + generated[:-1] on a fresh cache, in chunks whose logits are reduced at once,
    so no [tokens, vocabulary] tensor outlives a chunk. Only called after a tie.
    """
    ids = [int(t) for t in prompt] + [int(t) for t in generated[:-1]]
    first = len(prompt) - 1  # the position whose logits predict generated[0]
    cache = target.new_cache()
    argmax_n, top_n2 = [], []
    for a in range(0, len(ids), chunk):
        logits_cV, _ = target.forward(ids[a:a + chunk], a, cache)
        logits_cV = logits_cV[max(first - a, 0):]
        argmax_n.append(logits_cV.argmax(-1))
        top_n2.append(logits_cV.float().topk(2, dim=-1).values)
    top = torch.cat(top_n2).T.tolist()
    return torch.cat(argmax_n).tolist(), top[0], top[1]


__all__ = ["TIE_ULPS", "TIE_ULPS_COMPILED", "tie_ulps_for", "logit_ulp", "is_tie", "is_exact_dtype", "rule_text", "Divergence", "LosslessCheck",
           "first_difference", "check_greedy", "top2_logits", "teacher_forcing"]
