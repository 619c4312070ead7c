"""Decode-step attention that reads each row's own slots only: a split-KV ("flash-decoding") Triton kernel.

Why: at `dflash generate`'s shape (Qwen3-8B, 128 rows) the attention was most of a decode step. The
step attends to a power-of-two bucket of slots that holds its longest row, so a row of 400 tokens in a
bucket of 1,024 read 2.5x its K/V; SDPA reads each KV head once per query head of its group
(4x for Qwen3); and the written-out kernel (attention.py) materialises the scores between two GEMMs.
Here one program owns one (row, KV head) and a chunk of its slots, holds the g query heads of the group
together (K and V are read once per group), stops at the row's own length (slots past it are never
read: the bucket only bounds the grid), and keeps a running softmax in fp32. When the rows x KV heads
fill the GPU (generation) one chunk covers the whole row and the output is written at once; when they do
not (batch-1 decoding) the slots are split over several programs and a second kernel merges their
partial softmaxes.

Numerics: scores come out of the bf16 dot in fp32 and are scaled in fp32, as the written-out kernel does;
probabilities are rounded to the value dtype before the P V product (as every bf16 attention kernel
does). bf16 and fp16 only: fp32 decoding (the exact lossless check) keeps the written-out kernel.

Scope: one new token per row (a decode step, q = 1), whose query sees its row's committed slots [0, len)
and its own slot len; sliding windows by positions (query position - slot position < W); no soft-capping
(Gemma 2 keeps the written-out kernel). attention.py decides when this runs (`DFLASH_DECODE_ATTENTION`).

Triton is imported on first use. On a machine without a GPU the kernels run in Triton's interpreter
(TRITON_INTERPRET=1), which is how the CPU tests check them against an fp64 reference; there the dots
take fp32 operands (the interpreter multiplies bf16 as raw bits), exact for bf16 products, so the CPU
tests check everything but the tensor-core dot itself (tests/test_decoding_cuda.py does).

Legend: R rows, hk KV heads, G query heads per KV head (g, as q = 1), S attended slots, D head dim,
P splits per (row, KV head).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

BLOCK_N = 64          # slots per tile
PROGRAMS_PER_SM = 4   # split a row's slots until rows x KV heads x splits reach this many programs per SM


def available() -> bool:
    """Triton is importable (the CUDA images ship it; the CPU one need not)."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def _partial_kernel(interpret: bool):
    """The first kernel, decorated on first use (`interpret`: part of the cache key only, as triton reads
    TRITON_INTERPRET when it decorates): each program's running softmax over its chunk of slots."""
    import triton
    import triton.language as tl

    del interpret

    @triton.jit
    def partial_kernel(Q, K, V, NVis, QPos, SlotPos, Out, OPart, MPart, LPart,
                       s_qr, s_qh, s_qg, s_kr, s_kh, s_ks, s_vr, s_vh, s_vs, s_pr,
                       hk, G, D, chunk, splits, scale, window,
                       BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
                       WINDOW: tl.constexpr, SINGLE: tl.constexpr, UPCAST: tl.constexpr):
        rh = tl.program_id(0)
        split = tl.program_id(1)
        r = rh // hk
        h = rh % hk
        n = tl.load(NVis + r).to(tl.int32)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_t = tl.arange(0, BLOCK)
        g_ok = offs_g < G
        d_ok = offs_d < D
        q = tl.load(Q + r * s_qr + h * s_qh + offs_g[:, None] * s_qg + offs_d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        start = split * chunk
        end = tl.minimum(start + chunk, n)
        if WINDOW:
            q_pos = tl.load(QPos + r)
        k_base = K + r * s_kr + h * s_kh
        v_base = V + r * s_vr + h * s_vh
        for s0 in range(start, end, BLOCK):
            offs_s = s0 + offs_t
            s_ok = offs_s < end
            kv_mask = s_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + offs_s[:, None] * s_ks + offs_d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * scale
            else:
                scores = tl.dot(q, tl.trans(k)) * scale
            if WINDOW:
                slot_pos = tl.load(SlotPos + r * s_pr + offs_s, mask=s_ok, other=0)
                s_ok = s_ok & (q_pos - slot_pos < window)
            scores = tl.where(s_ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # a tile with nothing visible yet
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(scores - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + offs_s[:, None] * s_vs + offs_d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out_mask = g_ok[:, None] & d_ok[None, :]
        if SINGLE:
            # one split holds the whole row (n >= 1: the query sees itself, so l_i > 0)
            o = acc / l_i[:, None]
            tl.store(Out + (rh * G + offs_g[:, None]) * D + offs_d[None, :], o.to(Out.dtype.element_ty), mask=out_mask)
        else:
            at = rh * splits + split
            tl.store(OPart + (at * G + offs_g[:, None]) * D + offs_d[None, :], acc, mask=out_mask)
            tl.store(MPart + at * G + offs_g, m_i, mask=g_ok)
            tl.store(LPart + at * G + offs_g, l_i, mask=g_ok)

    return partial_kernel


@functools.lru_cache(maxsize=None)
def _merge_kernel(interpret: bool):
    """The second kernel: a (row, KV head)'s chunks merged into one softmax (only when there are several)."""
    import triton
    import triton.language as tl

    del interpret

    @triton.jit
    def merge_kernel(OPart, MPart, LPart, Out, G, D, splits,
                     BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
        rh = tl.program_id(0)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        g_ok = offs_g < G
        mask = g_ok[:, None] & (offs_d[None, :] < D)
        m_run = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_run = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for split in range(0, splits):
            at = rh * splits + split
            m_s = tl.load(MPart + at * G + offs_g, mask=g_ok, other=float("-inf"))
            l_s = tl.load(LPart + at * G + offs_g, mask=g_ok, other=0.0)
            o_s = tl.load(OPart + (at * G + offs_g[:, None]) * D + offs_d[None, :], mask=mask, other=0.0)
            m_new = tl.maximum(m_run, m_s)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # splits past the row's end hold nothing
            a = tl.exp(m_run - m_use)
            b = tl.exp(m_s - m_use)
            l_run = l_run * a + l_s * b
            acc = acc * a[:, None] + o_s * b[:, None]
            m_run = m_new
        o = acc / tl.where(l_run > 0, l_run, 1.0)[:, None]   # only padded query rows have l = 0
        tl.store(Out + (rh * G + offs_g[:, None]) * D + offs_d[None, :], o.to(Out.dtype.element_ty), mask=mask)

    return merge_kernel


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def plan_splits(rows_heads: int, slots: int, sms: int) -> tuple[int, int]:
    """(splits, chunk): each (row, KV head)'s slots cut into `splits` chunks of `chunk` slots (a multiple
    of BLOCK_N), so that rows x KV heads x splits reach PROGRAMS_PER_SM programs per SM where the slots
    allow; one split when the rows alone fill the GPU."""
    tiles = max(1, -(-slots // BLOCK_N))
    want = max(1, -(-(PROGRAMS_PER_SM * sms) // rows_heads))
    per_split = -(-tiles // min(tiles, want))
    return -(-tiles // per_split), per_split * BLOCK_N


def _run(q_RkGD, k_RkSD, v_RkSD, n_vis_R, q_pos_R, slot_pos_RS, scale: float, window: int) -> torch.Tensor:
    R, hk, G, D = q_RkGD.shape
    S = k_RkSD.shape[2]
    if q_RkGD.stride(3) != 1:
        q_RkGD = q_RkGD.contiguous()
    if k_RkSD.stride(3) != 1 or v_RkSD.stride(3) != 1:
        raise ValueError("split attention: K and V need a contiguous head dimension")
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    partial_kernel, merge_kernel = _partial_kernel(interpret), _merge_kernel(interpret)
    sms = _sm_count(q_RkGD.get_device()) if q_RkGD.is_cuda else 8
    splits, chunk = plan_splits(R * hk, S, sms)
    out = torch.empty((R, hk, G, D), dtype=q_RkGD.dtype, device=q_RkGD.device)
    block_g = max(16, 1 << (G - 1).bit_length())
    block_d = max(16, 1 << (D - 1).bit_length())
    single = splits == 1
    if single:
        o_part = m_part = l_part = out   # unused
    else:
        o_part = torch.empty((R * hk, splits, G, D), dtype=torch.float32, device=q_RkGD.device)
        m_part = torch.empty((R * hk, splits, G), dtype=torch.float32, device=q_RkGD.device)
        l_part = torch.empty_like(m_part)
    # Triton launches on the current device: make it the tensors' one (a process may hold several GPUs)
    with torch.cuda.device(q_RkGD.device) if q_RkGD.is_cuda else contextlib.nullcontext():
        partial_kernel[(R * hk, splits)](
            q_RkGD, k_RkSD, v_RkSD, n_vis_R, q_pos_R, slot_pos_RS, out, o_part, m_part, l_part,
            q_RkGD.stride(0), q_RkGD.stride(1), q_RkGD.stride(2),
            k_RkSD.stride(0), k_RkSD.stride(1), k_RkSD.stride(2),
            v_RkSD.stride(0), v_RkSD.stride(1), v_RkSD.stride(2), slot_pos_RS.stride(0),
            hk, G, D, chunk, splits, scale, window,
            BLOCK_G=block_g, BLOCK_D=block_d, BLOCK=BLOCK_N, WINDOW=window > 0, SINGLE=single, UPCAST=interpret,
            num_warps=4, num_stages=2,
        )
        if not single:
            merge_kernel[(R * hk,)](o_part, m_part, l_part, out, G, D, splits, BLOCK_G=block_g, BLOCK_D=block_d,
                                    num_warps=4)
    return out


@torch.library.custom_op("dflash::split_decode_attention", mutates_args=())
def _split_decode_attention(q_RkGD: torch.Tensor, k_RkSD: torch.Tensor, v_RkSD: torch.Tensor, n_vis_R: torch.Tensor,
                            q_pos_R: torch.Tensor, slot_pos_RS: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    # an opaque op: torch.compile treats the Triton launch as one call (the runner's compiled layers)
    return _run(q_RkGD, k_RkSD, v_RkSD, n_vis_R, q_pos_R, slot_pos_RS, scale, window)


@_split_decode_attention.register_fake
def _(q_RkGD, k_RkSD, v_RkSD, n_vis_R, q_pos_R, slot_pos_RS, scale, window):
    return q_RkGD.new_empty(q_RkGD.shape)


def split_decode_attention(q_RkGD: torch.Tensor, k_RkSD: torch.Tensor, v_RkSD: torch.Tensor, n_vis_R: torch.Tensor,
                           scale: float, *, window: int | None = None, q_pos_R: torch.Tensor | None = None,
                           slot_pos_RS: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(Q K^T * scale) V over each row's first n_vis_R[r] slots; [R, hk, G, D] in Q's dtype.

    q_RkGD: the G query heads of each KV head (one new token per row); k/v_RkSD: the attended slots (a
    view of the cache: any strides with a contiguous head dim); n_vis_R: visible slots per row (committed
    + 1). With `window`, slot s is visible only while q_pos_R[r] - slot_pos_RS[r, s] < window."""
    if window:
        if q_pos_R is None or slot_pos_RS is None:
            raise ValueError("split attention: a window needs the query and slot positions")
    else:
        window, q_pos_R, slot_pos_RS = 0, n_vis_R, n_vis_R[:, None]   # placeholders the kernel never reads
    return _split_decode_attention(q_RkGD, k_RkSD, v_RkSD, n_vis_R, q_pos_R, slot_pos_RS, float(scale), int(window))


def reference(q_RkGD, k_RkSD, v_RkSD, n_vis_R, scale, window=None, q_pos_R=None, slot_pos_RS=None) -> torch.Tensor:
    """The same attention in fp64, written out (tests and benchmarks)."""
    S = k_RkSD.shape[2]
    vis_RS = torch.arange(S, device=n_vis_R.device)[None] < n_vis_R[:, None]
    if window:
        vis_RS = vis_RS & (q_pos_R[:, None] - slot_pos_RS[:, :S] < window)
    scores = torch.matmul(q_RkGD.double(), k_RkSD.double().transpose(2, 3)) * scale
    scores = scores.masked_fill(~vis_RS[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v_RkSD.double())


__all__ = ["available", "plan_splits", "split_decode_attention", "reference", "BLOCK_N"]
