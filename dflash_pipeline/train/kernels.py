"""The drafter layers' elementwise chains, written once and compiled into fused kernels on CUDA.

Between its matrix products a drafter layer runs chains of small elementwise operations over every
block token: RMSNorm (cast to fp32, square, mean, rsqrt, scale, cast back, weight), the residual add,
q/k norms followed by RoPE. Run op by op in eager PyTorch, each link reads and writes the whole
activation in fp32; on the H200 profile of the 8B-shaped step these chains cost ~150 ms of a 745 ms step
(as much as the attention). Compiled, each chain is one kernel that reads its inputs once and writes
its output once, in the dtype the next matrix product consumes.

The math is the eager math, operation for operation (HF Qwen3RMSNorm: statistics in fp32, normalised
value cast to the input dtype before the weight), so the CPU path, the tests' references and the
exported model agree; only `out_dtype` differs: under autocast the chains end in the autocast dtype
(the next matmul would cast to it anyway) instead of fp32.

`kernels(compiled)` returns the set to use. The compiled set is only used on CUDA and outside
activation checkpointing (whose saved-tensor hooks compiled autograd functions do not see through).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    xf = x.float()
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if out_dtype is None else y.to(out_dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)): the residual add and the next norm in one pass."""
    h = h + delta
    return h, rms_norm(h, weight, eps, out_dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def norm_rope(x_RLhD: torch.Tensor, weight: torch.Tensor, eps: float, cos_RLD: torch.Tensor, sin_RLD: torch.Tensor,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Per-head RMSNorm (q_norm / k_norm) then RoPE, on [R, L, heads, D]; the result is [R, heads, L, D]."""
    y = rms_norm(x_RLhD, weight, eps)
    cos, sin = cos_RLD.unsqueeze(2), sin_RLD.unsqueeze(2)
    y = y * cos + _rotate_half(y) * sin
    if out_dtype is not None:
        y = y.to(out_dtype)
    return y.transpose(1, 2)


class Kernels(NamedTuple):
    rms_norm: callable
    add_rms_norm: callable
    norm_rope: callable


EAGER = Kernels(rms_norm, add_rms_norm, norm_rope)


# Dynamo keeps at most 8 compiled versions of a function by default, and one process can guard more: the
# memory search's probes (layer counts, row chunks), the steps, checkpointed recomputes (inputs with and
# without grad), held-out passes (no grad, other shapes), autocast on and off. Past the limit a fullgraph
# function fails hard and flex attention falls back to eager (device syncs, score matrices in memory);
# both happened on an H100 (2026-12-06): the memory-search benchmark's second model, and the no-sync step
# test after other CUDA tests.
RECOMPILE_LIMIT = 64


def allow_recompiles() -> None:
    """Raise dynamo's per-function recompile limit to RECOMPILE_LIMIT for this process (never lower it)."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)


@functools.cache
def _compiled_set() -> Kernels:
    allow_recompiles()
    # dynamic=None: the first shape compiles static, a second one recompiles with its varying sizes
    # symbolic (the anchor count varies between steps; the hidden size never does).
    return Kernels(*(torch.compile(fn, dynamic=None, fullgraph=True) for fn in EAGER))


def kernels(compiled: bool) -> Kernels:
    return _compiled_set() if compiled else EAGER


def out_dtype_for(device: torch.device) -> torch.dtype | None:
    """The dtype elementwise chains end in: the autocast dtype under autocast, else None (keep)."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None
