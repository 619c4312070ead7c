"""The split-KV decode kernel (decoding/split_attention.py) in Triton's interpreter, on the CPU.

Against an fp64 reference: every split plan (one chunk per row, many chunks merged), rows of different
lengths (one slot to the whole bucket), slots past a row's length never read (they hold NaN here),
sliding windows, K/V read in place from a cache view, bf16 and fp16, head dims that are not powers of
two. Then inside the runner (`split_decode`, as `dflash generate` runs it), rows of different lengths in
one step, bf16: the split kernel's logits equal the written-out kernel's within bf16 noise and pick the
same tokens wherever the margin is clear of it (GQA, sliding-window layers, Gemma 3's query scaling);
soft-capped models, and runners that did not ask for it, keep the written-out kernel. The tensor-core
dot itself runs only on a GPU (tests/test_decoding_cuda.py).
"""

from __future__ import annotations

import pytest
import torch

from dflash_pipeline.decoding import attention, split_attention
from dflash_pipeline.decoding.runner import DecodingRunner
from decoding_helpers import tiny_causal_lm as tiny

pytestmark = pytest.mark.skipif(not split_attention.available(), reason="triton is not installed")


def cache_view(R, hk, S, D, dtype, gen, spare=64):
    """K or V as the runner passes them: the first S slots of a longer buffer (strided), NaN beyond."""
    buf = torch.randn(R, hk, S + spare, D, generator=gen).to(dtype)
    return buf[:, :, :S]


@pytest.mark.parametrize("R,hk,G,D,S,dtype", [
    (3, 2, 4, 64, 200, torch.bfloat16),    # Qwen3's group of 4; rows split over chunks
    (1, 3, 3, 64, 512, torch.bfloat16),    # SmolLM2's heads at batch 1: many chunks merged
    (40, 2, 4, 128, 130, torch.bfloat16),  # rows x heads fill the (8-SM) grid: one chunk per row, no merge
    (2, 1, 5, 80, 130, torch.float16),     # a head dim that is not a power of two, fp16
])
def test_split_kernel_equals_the_reference_and_reads_only_each_rows_slots(interpreter, R, hk, G, D, S, dtype):
    gen = torch.Generator().manual_seed(R * 1000 + S)
    q = torch.randn(R, hk, G, D, generator=gen).to(dtype)
    k, v = cache_view(R, hk, S, D, dtype, gen), cache_view(R, hk, S, D, dtype, gen)
    n = torch.randint(1, S + 1, (R,), generator=gen)
    n[0], n[-1] = S, 1                                  # the whole bucket, and only the query's own slot
    for r in range(R):                                  # what lies past a row's slots must never be read
        k[r, :, n[r]:] = float("nan")
        v[r, :, n[r]:] = float("nan")
    scale = D ** -0.5
    out = split_attention.split_decode_attention(q, k, v, n, scale)
    assert out.shape == (R, hk, G, D) and out.dtype == dtype
    ref = split_attention.reference(q, k.nan_to_num(), v.nan_to_num(), n, scale)
    eps = torch.finfo(dtype).eps
    assert torch.isfinite(out).all()
    # the output rounded once to the dtype, plus the probabilities' rounding: well under 2 ulp of |V|'s max
    assert (out.double() - ref).abs().max() <= 2 * eps * v.nan_to_num().abs().max()
    assert torch.equal(out[-1].float(), v[-1, :, :1].float().expand(hk, G, D))   # one visible slot: V itself
    splits, chunk = split_attention.plan_splits(R * hk, S, 8)
    assert splits * chunk >= S and chunk % split_attention.BLOCK_N == 0


def test_split_kernel_applies_sliding_windows_by_position(interpreter):
    R, hk, G, D, S = 3, 2, 4, 64, 300
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(R, hk, G, D, generator=gen).bfloat16()
    k, v = cache_view(R, hk, S, D, torch.bfloat16, gen), cache_view(R, hk, S, D, torch.bfloat16, gen)
    n = torch.tensor([300, 45, 7])
    slot_pos = torch.arange(S + 64)[None].repeat(R, 1) + torch.tensor([[0], [10], [3]])   # positions != slots
    q_pos = slot_pos.gather(1, (n - 1)[:, None])[:, 0]
    out = split_attention.split_decode_attention(q, k, v, n, 0.125, window=37, q_pos_R=q_pos, slot_pos_RS=slot_pos)
    ref = split_attention.reference(q, k, v, n, 0.125, 37, q_pos, slot_pos)
    assert (out.double() - ref).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * v.abs().max()
    full = split_attention.reference(q, k, v, n, 0.125)
    assert (full - ref).abs().max() > 0.05   # the window changed the first row's answer: it was applied


def decode_rows(model, prompts, n, *, split_decode, forced=None, compile=False):
    """Rows of different lengths decoding together on the runner, one token per step: the step logits
    [n, R, V] and the tokens fed (each row's greedy choice, or `forced` [n, R]: the same inputs for both
    kernels, so that one near-tie cannot send the runs apart)."""
    runner = DecodingRunner(model, rows=len(prompts), max_len=96, prefill_chunk=8, split_decode=split_decode,
                            compile=compile)
    toks = [[int(runner.prefill(r, p)[0][-1].argmax()) for r, p in enumerate(prompts)]]
    io, logits = runner.inputs(1), []
    for i in range(n):
        feed = forced[i] if forced is not None else toks[-1]
        io.ids_Rq[:, 0] = torch.tensor(feed, device=io.ids_Rq.device)
        runner.step(1)
        logits.append(io.logits_RqV[:, 0].float().cpu().clone())
        runner.advance(1)
        toks.append(io.argmax_Rq[:, 0].tolist())
    runner.close()
    return toks, torch.stack(logits)


def assert_same_decoding(want, got):
    """Logits within bf16 noise of each other, and the same greedy token wherever the reference's top-2
    margin is clear of that noise."""
    diff = (got - want).abs().max()
    assert diff <= 0.05 * want.abs().max(), diff
    top2 = want.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * diff
    assert clear.float().mean() > 0.8                          # the comparison is not vacuous
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


PROMPTS = [[5, 17, 3, 44, 9, 12, 80, 1, 33], [3, 9], [4, 9, 27, 4, 50, 6]]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3", "gemma2"])
def test_runner_decodes_with_the_split_kernel_as_with_the_written_out_one(interpreter, monkeypatch, kind):
    """bf16, 3 rows of different lengths, past every sliding window (qwen3: 5, gemma3: 4): the split
    kernel (the runner's `split_decode`) gives the written-out kernel's logits within bf16 noise. Gemma 2
    (soft-capping) keeps the written-out kernel, and so does a runner that did not ask for the split one."""
    model = tiny(kind).to(torch.bfloat16)
    monkeypatch.setattr(split_attention, "PROGRAMS_PER_SM", 1)   # 2 chunks per row, merged: fewer interpreted programs
    monkeypatch.setattr(attention, "KERNEL", "math")
    want_toks, want = decode_rows(model, PROMPTS, 9, split_decode=True)
    monkeypatch.setattr(attention, "KERNEL", "split")
    calls = []
    real = split_attention._run
    monkeypatch.setattr(split_attention, "_run", lambda *a: calls.append(1) or real(*a))
    decode_rows(model, PROMPTS, 2, split_decode=False, forced=want_toks[:2])
    assert not calls                                             # not asked for: never the split kernel
    _, got = decode_rows(model, PROMPTS, 9, split_decode=True, forced=want_toks)
    if kind == "gemma2":
        assert not calls and torch.equal(got, want)
    else:
        assert len(calls) == 9 * model.config.num_hidden_layers   # every layer of every one-token step
        assert_same_decoding(want, got)


def test_split_dispatch(monkeypatch):
    monkeypatch.setattr(attention, "KERNEL", "auto")
    assert not attention.split_for("cpu", torch.bfloat16)                      # auto: CUDA only
    assert attention.split_for("cuda", torch.bfloat16) == split_attention.available()
    assert not attention.split_for("cuda", torch.float32)                      # fp32 keeps the exact kernel
    assert attention.kernels_label("cpu", torch.bfloat16, True) == "sdpa"
    assert attention.kernels_label("cuda", torch.bfloat16, True) in ("split/math", "split/sdpa")
    assert attention.kernels_label("cuda", torch.bfloat16, False) in ("math", "sdpa")
    monkeypatch.setattr(attention, "KERNEL", "split")
    assert attention.split_for("cpu", torch.float16) and attention.kernel_for("cuda") == "math"
    monkeypatch.setattr(attention, "KERNEL", "math")
    assert not attention.split_for("cuda", torch.bfloat16)
