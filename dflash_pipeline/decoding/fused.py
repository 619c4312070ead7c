"""Fused projections: q|k|v as one matrix product per layer, gate|up as another.

Why: a decode step reads every weight once, and at a few rows per step a matrix product runs at the
speed it streams its weight. transformers runs seven products per layer (q, k, v, o, gate, up, down);
the small k and v ones stay far below the memory bandwidth. On an H200 (bf16, Qwen3-8B shape, 36 layers
and the LM head in one CUDA graph; bench/gemv.py) the seven took 4.865 ms at batch 1, and with q|k|v and
gate|up fused 4.190 ms (1.16x; 4.90 -> 4.27 ms at 16 rows, 5.45 -> 4.86 ms at 128).

How, without touching the model's code: the weights of q, k and v become row views of one contiguous
buffer (the separate tensors are freed, so no second copy exists), and the three modules are replaced:
`q_proj` computes the whole product once, keeps the k and v slices on a small holder shared with the
other two, and returns q; `k_proj` and `v_proj` return their slice. Likewise gate_proj and up_proj. The
model's attention and MLP code calls them in that order on one input; any other use (another order,
another input, a second call) raises instead of computing wrong numbers. The holder lets go of the
product once every slice was taken, so no activation outlives its layer.

Under `torch.compile` (the runner compiles each decoder layer's forward) the modules trace into the
layer's graph: the holder is a plain Python object, whose attribute writes dynamo applies after the graph
has run, and the identity check is decided while tracing. Checked on the CPU: no graph break (fullgraph
traces), and one compiled code still serves every layer (as many graphs and frames as unfused).

Only exact `nn.Linear` modules (no quantized or adapter subclasses, no accelerate offload hooks, no
forward hooks) on one device and dtype are fused; a layer that does not match is left as it is (Phi-3's
projections are fused in the checkpoint already). While fused the weights do not require gradients (the
product reads the fused buffer, not the views); `restore()` gives the flag back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dflash_pipeline.errors import DFlashError
from dflash_pipeline.extract.target import decoder_layers

GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
FUSE_ENV = "DFLASH_FUSE_PROJECTIONS"


def fuse_from_env() -> bool:
    """`DFLASH_FUSE_PROJECTIONS=0` runs transformers' separate products (default 1): a way back for a model
    whose code calls its projections in another order than the fused modules accept."""
    value = os.environ.get(FUSE_ENV, "1").strip().lower() or "1"
    if value not in ("0", "1"):
        raise DFlashError(f"{FUSE_ENV}={value!r}: expected 0 or 1")
    return value == "1"


class _Pending:
    """The slices of one fused product that the later projections of its group have not taken yet."""

    def __init__(self, where: str):
        self.where = where
        self.x: torch.Tensor | None = None  # the input the product was computed from
        self.slices: dict[str, torch.Tensor] = {}

    def take(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if x is not self.x or name not in self.slices:
            raise RuntimeError(f"{self.where}.{name}: fused projections are called out of order (its slice is "
                               f"taken from the first projection's product on the same input); run the model "
                               f"unfused ({FUSE_ENV}=0, or DecodingRunner(fuse=False))")
        out = self.slices.pop(name)
        if not self.slices:
            self.x = None
        return out


class _FusedFirst(nn.Module):
    """The group's first projection: computes the whole product, keeps the other slices, returns its own."""

    def __init__(self, first: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None, names: list[str],
                 sizes: list[int], pending: _Pending):
        super().__init__()
        self.register_buffer("fused_weight", weight, persistent=False)
        self.register_buffer("fused_bias", bias, persistent=False)
        self.weight, self.bias = first.weight, first.bias  # the row views: code reading shape or dtype works
        self.in_features, self.out_features = first.in_features, first.out_features
        self.names, self.sizes, self.pending = names, sizes, pending

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        own, *rest = F.linear(x, self.fused_weight, self.fused_bias).split(self.sizes, dim=-1)
        self.pending.x = x
        self.pending.slices = dict(zip(self.names, rest))
        return own


class _FusedSlice(nn.Module):
    """A later projection of the group: its slice of the product the first one computed."""

    def __init__(self, linear: nn.Linear, name: str, pending: _Pending):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.name, self.pending = name, pending

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pending.take(self.name, x)


@dataclass
class FusedProjections:
    """What `fuse_projections` replaced; `restore()` puts the nn.Linear modules back (their weights stay
    views of the fused buffers: the same memory)."""

    layers: int = 0  # decoder layers with at least one fused group
    groups: int = 0
    _replaced: list[tuple[nn.Module, str, nn.Linear, bool]] = field(default_factory=list, repr=False)

    def restore(self) -> None:
        for parent, name, linear, requires_grad in reversed(self._replaced):
            setattr(parent, name, linear)
            for p in (linear.weight, linear.bias):
                if p is not None:
                    p.requires_grad_(requires_grad)
        self._replaced = []


def _plain(m) -> bool:
    """An exact nn.Linear that nothing hooks into: replacing it changes no one's behaviour but its own."""
    return (type(m) is nn.Linear and not hasattr(m, "_hf_hook") and "forward" not in m.__dict__
            and not (m._forward_hooks or m._forward_pre_hooks))


def _fusable(linears: list) -> bool:
    first = linears[0]
    if not all(_plain(m) for m in linears):
        return False
    w = first.weight
    return (w.device.type != "meta"
            and all(m.weight.device == w.device and m.weight.dtype == w.dtype for m in linears)
            and all(m.in_features == first.in_features for m in linears)
            and len({m.bias is None for m in linears}) == 1
            and all(m.bias is None or (m.bias.device == w.device and m.bias.dtype == w.dtype) for m in linears))


def _as_views(linears: list[nn.Linear], attr: str) -> torch.Tensor | None:
    """One buffer of the modules' `attr` (weight or bias) stacked by rows; the modules' own become views."""
    if getattr(linears[0], attr) is None:
        return None
    buf = torch.cat([getattr(m, attr) for m in linears])
    row = 0
    for m in linears:
        n = m.out_features
        setattr(m, attr, nn.Parameter(buf[row:row + n], requires_grad=False))  # the old tensor is freed here
        row += n
    return buf


def _fuse_group(parent: nn.Module, names: tuple[str, ...], where: str, done: FusedProjections) -> bool:
    linears = [getattr(parent, n, None) for n in names]
    if not _fusable(linears):
        return False
    requires_grad = linears[0].weight.requires_grad
    weight, bias = _as_views(linears, "weight"), _as_views(linears, "bias")
    pending = _Pending(where)
    first, *rest = linears
    modules = [_FusedFirst(first, weight, bias, list(names[1:]), [m.out_features for m in linears], pending)]
    modules += [_FusedSlice(m, n, pending) for m, n in zip(rest, names[1:])]
    for name, linear, module in zip(names, linears, modules):
        setattr(parent, name, module)
        done._replaced.append((parent, name, linear, requires_grad))
    return True


@torch.no_grad()
def fuse_projections(model) -> FusedProjections:
    """Fuse q|k|v and gate|up in every decoder layer of `model` where they are plain nn.Linear modules."""
    done = FusedProjections()
    for i, layer in enumerate(decoder_layers(model)):
        fused = 0
        for part, names in GROUPS:
            parent = getattr(layer, part, None)
            fused += parent is not None and _fuse_group(parent, names, f"layer {i}: {part}", done)
        done.layers += fused > 0
        done.groups += fused
    if done.groups and torch.cuda.is_initialized():
        # The separate weights' memory went back to the caching allocator, in blocks too small for anything
        # but smaller tensors; give it back to the device, so that free memory reads true again (a memory
        # plan made after this, another process on the GPU).
        torch.cuda.empty_cache()
    return done


__all__ = ["FUSE_ENV", "FusedProjections", "fuse_from_env", "fuse_projections"]
