"""Attention over a static KV cache, plugged into transformers as an attention function.

Why this design: transformers' own static cache changed its API between the versions we run on
(5.17 on the GPU image, 5.24 here) and failed under `torch.compile(mode="reduce-overhead")` on 5.17
(its `cumulative_length` update read a graph output that a later replay had overwritten). Instead the
model runs with no cache at all (`past_key_values=None`, `use_cache=False`), and the attention function
registered here under `STATIC_ATTENTION` owns the cache: each layer (by `module.layer_idx`) writes its
new keys and values (already RoPE'd by the model) into static buffers at the slots the runner chose,
and attends to those buffers with a mask the runner built from per-row lengths. The model's own code
still computes everything else (norms, RoPE at the positions we pass, Gemma's embedding scale and
query scaling, logit soft-capping), so any model that calls the attention interface runs unchanged.
No mask function is registered under our name: transformers then builds no mask at all (both versions
return early for attention implementations without one), which also skips its packed-sequence check,
a host sync.

Slots and positions are separate: a row's committed tokens sit at cache slots [0, len); a step writes
its q tokens at slots [len, len + q), at RoPE positions len + offset (offset = index in the block for
a chain, depth for a tree, so siblings share a position), and query i sees committed slots plus block
slots j where `block_mask[i, j]` (causal by default; an ancestor mask for trees). Sliding windows are
decided by positions (query position - key position < W, as transformers' overlay does).

GQA without repeated K/V: the g query heads of one KV head are folded into the query length
([R, h, q, D] -> [R, h_kv, g*q, D]), so one SDPA call reads each KV head once, and the folded mask
is a plain [R, 1, g*q, S] additive bias that the memory-efficient kernel takes.

The kernel (`DFLASH_DECODE_ATTENTION`, read once at import):
- `auto` (default): one-token steps in bf16/fp16 on CUDA run `split` where the runner asks for it
  (`split_decode`: `dflash generate`; decoding/split_attention.py, a Triton split-KV kernel that reads
  each row's own slots only, K/V once per KV head); everything else runs `math` on CUDA and `sdpa`
  elsewhere, and `sdpa` for a call whose scores would pass WRITTEN_OUT_MAX_SCORE_BYTES (a multi-row
  prefill);
- `split`: as `auto`, and those one-token steps take the Triton kernel wherever Triton runs (its
  interpreter on the CPU, for tests);
- `sdpa`: the memory-efficient SDPA kernel;
- `math`: the attention written out (Q K^T with the scores in fp32, softmax, P V), two batched GEMMs
  that cuBLAS spreads over the whole GPU where SDPA's grid is one block per (row, KV head) at decoding's
  few folded queries. On CUDA the scores come out of the bf16 GEMM in fp32 (`out_dtype`), so K is never
  copied; elsewhere Q and K are upcast first.
Measured on an H200 (BENCHMARKS.md): 1.3-2.6x faster than SDPA at every decode, verify, tree and
generation shape, with errors against fp32 within 2x of SDPA's; in the bf16 tie calibration on the real
SmolLM2 it moved the top-2 margin between the decode step and chain / tree verify steps by at most 3 /
11 ulp (8 / 7 in its upcast form) where SDPA's tree verify moved it by 46. On the CPU SDPA is the tighter one
(4-5.5 ulp against 8-9), so `auto` keeps it there. Soft-capped models (Gemma 2) always use `math`: SDPA
has no soft-capping.

Legend: R rows in the call, q new tokens per row, S attended cache slots, h query heads, hk KV heads,
g = h / hk, D head dim.
"""

from __future__ import annotations

import functools
import os
import threading
from contextlib import contextmanager
from typing import Iterable

import torch

from dflash_pipeline.errors import DFlashError
from dflash_pipeline.train.masks import attend

STATIC_ATTENTION = "static_kv"  # no "flash" in the name: transformers reads that as a flash kernel
_ACTIVE = threading.local()
KERNEL_ENV = "DFLASH_DECODE_ATTENTION"
KERNELS = ("auto", "sdpa", "math", "split")


def kernel_from_env() -> str:
    name = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if name not in KERNELS:
        raise DFlashError(f"{KERNEL_ENV}={name!r}: expected one of {', '.join(KERNELS)}")
    return name


KERNEL = kernel_from_env()  # module state, not read per call: a compiled or captured step sees a constant
# bf16 x bf16 -> fp32 batched GEMM (`torch.bmm(..., out_dtype=torch.float32)`): CUDA builds of recent torch
_BMM_FP32_OUT = "dtype" in torch.ops.aten.bmm.overloads()


# The written-out kernel materialises the scores ([R, h, q, S] fp32, then the softmax beside them): `auto`
# takes it only while they stay this small. Decoding's steps are far below (Qwen3-8B, 128 rows x 4K slots:
# 64 MiB); a multi-row prefill of `dflash generate` (8K tokens per forward) is far above and runs on SDPA.
WRITTEN_OUT_MAX_SCORE_BYTES = 256 << 20
WRITTEN_OUT_BYTES_PER_SCORE = 12  # its peak per score: fp32 scores, fp32 softmax, bf16 probabilities


def kernel_for(device: torch.device | str, scores: int = 0) -> str:
    """The kernel a call with `scores` = R * h * q * S attention scores uses on `device` (`auto` resolved)
    where the split kernel does not run: what `folded_attention` runs."""
    if KERNEL not in ("auto", "split"):
        return KERNEL
    small = scores * 4 <= WRITTEN_OUT_MAX_SCORE_BYTES
    # without the fp32-out GEMM (older torch) the written-out form upcasts K per call: slower than SDPA at
    # generation's batches, so `auto` keeps SDPA there
    return "math" if torch.device(device).type == "cuda" and small and _BMM_FP32_OUT else "sdpa"


@functools.lru_cache(maxsize=None)
def _split_available() -> bool:
    from dflash_pipeline.decoding import split_attention

    return split_attention.available()


@functools.lru_cache(maxsize=None)
def _tensor_core_dots(index: int) -> bool:
    """Triton's bf16 dot needs Ampere or newer (compute capability 8.0)."""
    return torch.cuda.get_device_capability(index) >= (8, 0)


def split_for(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether one-token steps (q = 1) of a `dtype` cache on `device` run the split kernel (without soft-capping)."""
    if KERNEL not in ("auto", "split") or dtype not in (torch.bfloat16, torch.float16):
        return False
    device = torch.device(device)
    if KERNEL == "auto" and device.type != "cuda":
        return False
    if device.type == "cuda" and torch.cuda.is_available() and not _tensor_core_dots(
            torch.cuda.current_device() if device.index is None else device.index):
        return False
    return _split_available()


def kernels_label(device: torch.device | str, dtype: torch.dtype, split_decode: bool) -> str:
    """What reports name: the one-token steps' kernel, then the other steps' ('split/math'), or one name
    (`split_decode`: the runner's option)."""
    other = kernel_for(device)
    return f"split/{other}" if split_decode and split_for(device, dtype) else other


def written_out_workspace(scores: int) -> int:
    """Bytes the written-out kernel may need beside its inputs for a call of `scores` scores under `auto`
    (0 where `auto` runs SDPA), for memory plans that must not guess (generate/rows.py)."""
    return scores * WRITTEN_OUT_BYTES_PER_SCORE if kernel_for("cuda", scores) == "math" else 0


class StaticKV:
    """Key and value buffers of every layer, [layers, rows, hk, slots, D] each: the whole cache,
    allocated once. One tensor per kind, indexed by the layer number, so that a compiled layer reads
    its buffer with the same code whatever its index."""

    def __init__(self, num_layers: int, rows: int, kv_heads: int, slots: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, rows, kv_heads, slots, head_dim)
        self.keys_L = torch.zeros(shape, dtype=dtype, device=device)
        self.values_L = torch.zeros(shape, dtype=dtype, device=device)
        self.slots, self.kv_heads, self.head_dim, self.dtype = slots, kv_heads, head_dim, dtype

    def copy_slots(self, row: int, src_n: torch.Tensor, dst_n: torch.Tensor) -> None:
        """Move the entries of one row's slots `src_n` to slots `dst_n` in every layer."""
        for buf in (self.keys_L, self.values_L):
            buf[:, row].index_copy_(2, dst_n, buf[:, row].index_select(2, src_n))


def target_visible(lengths_R: torch.Tensor, block_mask_Rqq: torch.Tensor, slots: int) -> torch.Tensor:
    """[R, q, S] bool: query i of row r sees committed slots (< len_r) and block slots len_r + j where
    block_mask[r, i, j]; nothing else (stale slots past the block are invisible)."""
    R, q, _ = block_mask_Rqq.shape
    slot_S = torch.arange(slots, device=lengths_R.device)
    rel_RS = slot_S[None] - lengths_R[:, None]
    committed_RS = rel_RS < 0
    in_block_RS = (rel_RS >= 0) & (rel_RS < q)
    in_block_RqS = block_mask_Rqq.gather(2, rel_RS.clamp(0, q - 1)[:, None, :].expand(R, q, slots))
    return committed_RS[:, None, :] | (in_block_RqS & in_block_RS[:, None, :])


def fold_mask(visible_RqS: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive bias [R, 1, g*q, S] of folded queries (index j*q + t = group j, query t)."""
    R, q, S = visible_RqS.shape
    vis = visible_RqS[:, None].expand(R, groups, q, S).reshape(R, 1, groups * q, S)
    return torch.zeros(vis.shape, dtype=dtype, device=vis.device).masked_fill_(~vis, float("-inf"))


def folded_attention(query_RhqD: torch.Tensor, key_RkSD: torch.Tensor, value_RkSD: torch.Tensor,
                     bias_R1GS: torch.Tensor, scale: float, softcap: float | None = None) -> torch.Tensor:
    """Attention of h query heads over hk KV heads without repeating K/V; returns [R, q, h, D]."""
    R, h, q, D = query_RhqD.shape
    hk = key_RkSD.shape[1]
    g = h // hk
    q_RkGD = query_RhqD.reshape(R, hk, g * q, D)
    if softcap or kernel_for(query_RhqD.device, R * h * q * key_RkSD.shape[2]) == "math":
        out = written_out_attention(q_RkGD, key_RkSD, value_RkSD, bias_R1GS, scale, softcap)
    else:
        out = attend(q_RkGD, key_RkSD, value_RkSD, bias_R1GS, scale)
    return out.view(R, hk, g, q, D).reshape(R, h, q, D).transpose(1, 2)


def written_out_attention(q_RkGD: torch.Tensor, key_RkSD: torch.Tensor, value_RkSD: torch.Tensor,
                          bias_R1GS: torch.Tensor, scale: float, softcap: float | None = None) -> torch.Tensor:
    """softmax(Q K^T * scale (soft-capped) + bias) V with the scores and softmax in fp32: bf16 scores would
    round a score of 16 to steps of 0.125 and carry 2-4x SDPA's error into the logits that the lossless
    check's tie rule compares. On CUDA the bf16 GEMM writes fp32 scores itself (upcasting K instead made a
    128-row generation step's attention 3x slower than SDPA's); the scale is applied in fp32, with the bias
    in the same kernel."""
    R, hk, G, D = q_RkGD.shape
    S = key_RkSD.shape[2]
    if q_RkGD.is_cuda and q_RkGD.dtype != torch.float32 and _BMM_FP32_OUT:
        # [R, hk] merge into one batch dimension without a copy: the cache's rows and heads are laid out
        # contiguously (only the slot dimension is cut to the attended bucket)
        scores = torch.bmm(q_RkGD.reshape(R * hk, G, D), key_RkSD.reshape(R * hk, S, D).transpose(1, 2),
                           out_dtype=torch.float32).view(R, hk, G, S)
    else:
        scores = torch.matmul(q_RkGD.float(), key_RkSD.float().transpose(2, 3))
    if softcap:
        scores = torch.tanh(scores * (scale / softcap)) * softcap + bias_R1GS
    else:
        scores = torch.add(bias_R1GS, scores, alpha=scale)
    probs = torch.softmax(scores, dim=-1)
    del scores
    return torch.matmul(probs.to(value_RkSD.dtype), value_RkSD)


class StepState:
    """Where one forward over some rows writes, and what each of its queries may see.

    Built at the start of a step (inside the captured graph on CUDA): the slots and positions of the
    new tokens, their positions recorded per slot (for sliding windows), and one additive mask per
    sliding window the model's layers use (`windows`, None = full attention), shared by those layers.
    Everything a layer reads is made here, before the model runs, so that a compiled layer finds the
    same structure at every call.
    """

    def __init__(self, kv: StaticKV, rows: slice, lengths_R: torch.Tensor, offsets_Rq: torch.Tensor,
                 block_mask_Rqq: torch.Tensor, slot_pos_RS: torch.Tensor, slots: int, *, groups: int,
                 windows: Iterable[int | None] = (None,), capture=None, split: bool = False):
        R, q = offsets_Rq.shape
        self.kv, self.rows, self.slots, self.groups, self.capture = kv, rows, slots, groups, capture
        # a slice of rows as plain ints, for the compiled write: torch 2.11's dynamo cannot trace slice.indices
        # and broke every compiled layer's graph there (seen on the GPU image; 2.13 traces it)
        if isinstance(rows, slice):
            start, stop, _ = rows.indices(kv.keys_L.shape[1])
            self.row0, self.num_rows = start, stop - start
        self.block_mask_Rqq, self.lengths_R = block_mask_Rqq, lengths_R
        write_Rq = lengths_R[:, None] + torch.arange(q, device=lengths_R.device)
        self.pos_Rq = lengths_R[:, None] + offsets_Rq
        slot_pos_RS.scatter_(1, write_Rq, self.pos_Rq)
        self.slot_pos_RS = slot_pos_RS[:, :slots]
        self.index_RkqD = write_Rq[:, None, :, None].expand(R, kv.kv_heads, q, kv.head_dim)
        # split: a one-token step whose layers run the split kernel (the caller knows the model has no
        # soft-capping), which reads the rows' lengths instead of a mask: the query sees its committed
        # slots and its own (a one-token block always sees itself), so no mask is built
        self.split = split and q == 1 and split_for(lengths_R.device, kv.dtype)
        self.n_vis_R = lengths_R + 1 if self.split else None
        self.masks: dict[int | None, torch.Tensor] = {}
        if not self.split:
            vis = target_visible(lengths_R, block_mask_Rqq, slots)
            self.masks = {w: self._mask(w, vis) for w in set(windows)}

    def _mask(self, window: int | None, vis: torch.Tensor | None = None) -> torch.Tensor:
        if vis is None:
            vis = target_visible(self.lengths_R, self.block_mask_Rqq, self.slots)
        if window is not None:
            vis = vis & (self.pos_Rq[:, :, None] - self.slot_pos_RS[:, None, :] < window)
        return fold_mask(vis, self.groups, self.kv.dtype)

    def write(self, layer: int, key_RkqD: torch.Tensor, value_RkqD: torch.Tensor):
        """Store the new keys/values at the step's slots; the layer's attended K and V [R, hk, S, D]."""
        key_RkqD, value_RkqD = key_RkqD.to(self.kv.dtype), value_RkqD.to(self.kv.dtype)
        if torch.compiler.is_compiling():
            # In a compiled layer the write is one opaque op on the whole buffers: written as an in-place
            # scatter into a view, functionalisation made Inductor copy the layer's K and V whole at every
            # step (a 128-row Qwen3-8B generation step went from 12.7 to 23.3 ms), and a mutating op on
            # the view itself was given the wrong layer's offset once the layer index became symbolic.
            torch.ops.dflash.write_kv(self.kv.keys_L, self.kv.values_L, layer, self.row0, self.num_rows,
                                      self.index_RkqD, key_RkqD, value_RkqD)
        else:
            _write_kv(self.kv.keys_L, self.kv.values_L, layer, self.rows, self.index_RkqD, key_RkqD, value_RkqD)
        k_buf, v_buf = self.kv.keys_L[layer][self.rows], self.kv.values_L[layer][self.rows]
        return k_buf[:, :, :self.slots], v_buf[:, :, :self.slots]

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:  # a window the runner did not foresee: made once, then shared
            self.masks[window] = self._mask(window)
        return self.masks[window]


def _write_kv(keys_L: torch.Tensor, values_L: torch.Tensor, layer: int, rows: slice, index_RkqD: torch.Tensor,
              key_RkqD: torch.Tensor, value_RkqD: torch.Tensor) -> None:
    keys_L[layer][rows].scatter_(2, index_RkqD, key_RkqD)
    values_L[layer][rows].scatter_(2, index_RkqD, value_RkqD)


@torch.library.custom_op("dflash::write_kv", mutates_args=("keys_L", "values_L"))
def _write_kv_op(keys_L: torch.Tensor, values_L: torch.Tensor, layer: int, row0: int, num_rows: int,
                 index_RkqD: torch.Tensor, key_RkqD: torch.Tensor, value_RkqD: torch.Tensor) -> None:
    _write_kv(keys_L, values_L, layer, slice(row0, row0 + num_rows), index_RkqD, key_RkqD, value_RkqD)


@_write_kv_op.register_fake
def _(keys_L, values_L, layer, row0, num_rows, index_RkqD, key_RkqD, value_RkqD):
    return None


@contextmanager
def active(state: StepState):
    """Make `state` the one the attention function and the feature hooks of this thread use."""
    prev = getattr(_ACTIVE, "state", None)
    _ACTIVE.state = state
    try:
        yield state
    finally:
        _ACTIVE.state = prev


def active_state() -> StepState | None:
    return getattr(_ACTIVE, "state", None)


def static_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                     softcap=None, **kwargs):
    """The transformers attention function (signature of its interface); `attention_mask` is ignored."""
    state = active_state()
    if state is None:
        raise RuntimeError(f"attention '{STATIC_ATTENTION}' runs only inside a DecodingRunner step")
    k_all, v_all = state.write(module.layer_idx, key, value)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if state.split and not softcap:
        from dflash_pipeline.decoding.split_attention import split_decode_attention

        R, h, _, D = query.shape
        out = split_decode_attention(query.reshape(R, state.kv.kv_heads, h // state.kv.kv_heads, D), k_all, v_all,
                                     state.n_vis_R, scale, window=sliding_window, q_pos_R=state.pos_Rq[:, 0],
                                     slot_pos_RS=state.slot_pos_RS)
        return out.view(R, h, 1, D).transpose(1, 2), None
    bias = state.mask(sliding_window).to(query.dtype)
    return folded_attention(query, k_all, v_all, bias, scale, softcap), None


def register() -> None:
    """Register the attention function (idempotent). No mask function on purpose: see the docstring."""
    from transformers import AttentionInterface

    AttentionInterface.register(STATIC_ATTENTION, static_attention)


__all__ = ["STATIC_ATTENTION", "KERNEL_ENV", "kernel_for", "split_for", "kernels_label", "written_out_workspace", "StaticKV", "StepState", "active",
           "active_state", "target_visible", "fold_mask", "folded_attention", "written_out_attention",
           "static_attention", "register"]
