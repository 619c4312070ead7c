"""The fused chunked head loss equals the naive full-logits loss, and keeps no [N, V] tensor for backward."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_pipeline.train.loss import FusedHeadLoss, fused_head_loss, naive_head_loss

N, H, V, K = 37, 16, 50, 5


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles the chunk's softmax (`COMPILE`) from a fresh cache: the cases differ in dtype,
    chunk shape and loss weights, and together they passed dynamo's recompile limit of 8 on the GPU
    machine (where the CUDA cases run too), which the loss's fullgraph compile turns into an error."""
    torch._dynamo.reset()
    yield


def _inputs(dtype=torch.float32, seed=0, many_correct=False):
    g = torch.Generator().manual_seed(seed)
    head = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    labels = torch.randint(0, V, (N,), generator=g)
    if many_correct:  # CAP only acts where argmax == label
        labels[::2] = (hidden.float() @ head.float().T).argmax(-1)[::2]
    labels[3] = -100
    weights = torch.rand(N, generator=g)
    weights[3] = weights[5] = 0.0
    t_ids = torch.randint(0, V, (N, K), generator=g)
    t_lp = torch.log_softmax(torch.randn(N, K, generator=g), -1) - 0.3  # top-k mass < 1: the tail is dropped
    t_lp[:, -1] = -math.inf  # an unused top-k slot
    return hidden, head, labels, weights, t_ids, t_lp


def _both(dtype, kl, cap, chunk, seed=0):
    hidden, head, labels, weights, t_ids, t_lp = _inputs(dtype, seed, many_correct=True)
    out = []
    for fn, kw in ((fused_head_loss, dict(chunk_size=chunk)), (naive_head_loss, {})):
        h = hidden.clone().requires_grad_(True)
        res = fn(h, head, labels, weights, t_ids, t_lp, kl_weight=kl, cap_weight=cap, **kw)
        (3.0 * res.loss).backward()
        out.append((res, h.grad))
    return out


@pytest.mark.parametrize("kl,cap", [(0.0, 0.0), (0.3, 0.0), (0.0, 0.5), (0.15, 0.1), (1.0, 0.0)])
@pytest.mark.parametrize("chunk", [1, 7, 16, 37, 1000])
def test_fused_equals_naive_fp32(kl, cap, chunk):
    (f, gf), (n, gn) = _both(torch.float32, kl, cap, chunk)
    for a, b in zip(f[:4], n[:4]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(f.correct_N, n.correct_N)
    torch.testing.assert_close(gf, gn, atol=1e-5, rtol=1e-5)
    if cap:
        assert f.cap > 0 and f.correct_N.sum() > N // 3


@pytest.mark.parametrize("kl,cap", [(0.0, 0.0), (0.15, 0.1)])
@pytest.mark.parametrize("chunk", [8, 37])
def test_fused_equals_naive_bf16(kl, cap, chunk):
    (f, gf), (n, gn) = _both(torch.bfloat16, kl, cap, chunk)
    torch.testing.assert_close(f.loss, n.loss, atol=1e-4, rtol=1e-4)  # both reduce in fp32
    assert gf.dtype == torch.bfloat16
    torch.testing.assert_close(gf, gn, atol=2e-3, rtol=2e-2)


@pytest.mark.parametrize("dtype,kl,cap,chunk", [(torch.float32, 0.15, 0.1, 16), (torch.bfloat16, 0.0, 0.0, 37),
                                                 (torch.float32, 1.0, 0.0, 37)])
def test_compiled_chunk_terms_equal_naive(monkeypatch, dtype, kl, cap, chunk):
    """The chunk math compiled into fused kernels (the CUDA path), compiled here on the CPU."""
    import dflash_pipeline.train.loss as loss_mod

    monkeypatch.setattr(loss_mod, "COMPILE", "always")
    (f, gf), (n, gn) = _both(dtype, kl, cap, chunk)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-4, rtol=1e-4)
    for a, b in zip(f[:4], n[:4]):
        torch.testing.assert_close(a, b, **tol)
    assert torch.equal(f.correct_N, n.correct_N)
    torch.testing.assert_close(gf, gn, **(tol if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-2)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kl,cap", [(0.0, 0.0), (0.15, 0.1)])
def test_fused_equals_naive_on_cuda(kl, cap):
    """On CUDA the fused loss takes the compiled path by default; against the naive loss in fp32 and bf16."""
    for dtype in (torch.float32, torch.bfloat16):
        hidden, head, labels, weights, t_ids, t_lp = (t.cuda() for t in _inputs(dtype, 1, many_correct=True))
        out = []
        for fn, kw in ((fused_head_loss, dict(chunk_size=16)), (naive_head_loss, {})):
            h = hidden.clone().requires_grad_(True)
            res = fn(h, head, labels, weights, t_ids, t_lp, kl_weight=kl, cap_weight=cap, **kw)
            res.loss.backward()
            out.append((res, h.grad))
        (f, gf), (n, gn) = out
        tol = dict(atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(f.loss, n.loss, **tol)
        if dtype == torch.float32:  # bf16 logits of differently shaped matmuls may order near-ties differently
            assert torch.equal(f.label_rank_N, n.label_rank_N)
        torch.testing.assert_close(gf.float(), gn.float(), **(tol if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-2)))


def test_kl_term_is_forward_kl_to_renormalised_topk():
    hidden, head, labels, weights, t_ids, t_lp = _inputs()
    res = fused_head_loss(hidden, head, labels, weights, t_ids, t_lp, kl_weight=0.5)
    logp = torch.log_softmax(hidden @ head.T, -1)
    q = torch.softmax(t_lp, -1)
    assert torch.allclose(q.sum(-1), torch.ones(N))
    kl_i = (torch.xlogy(q, q) - q * logp.gather(1, t_ids)).sum(-1)
    torch.testing.assert_close(res.kl, (weights * kl_i).sum() / weights.sum())
    ce_i = -logp.gather(1, labels.clamp_min(0)[:, None])[:, 0]
    torch.testing.assert_close(res.ce, (weights * ce_i).sum() / weights.sum())
    torch.testing.assert_close(res.loss, 0.5 * res.ce + 0.5 * res.kl)


def test_cap_gradient_check():
    hidden, head, labels, weights, t_ids, t_lp = _inputs(torch.float64, many_correct=True)
    n = 12
    hidden = hidden[:n].clone().requires_grad_(True)

    def f(h):
        return fused_head_loss(h, head, labels[:n], weights[:n], t_ids[:n], t_lp[:n], kl_weight=0.2, cap_weight=0.7,
                               chunk_size=5).loss

    assert torch.autograd.gradcheck(f, (hidden,), eps=1e-6, atol=1e-6, fast_mode=True)


def test_backward_keeps_only_grad_h():
    """No tensor of N*V elements (or any vocabulary-sized one) is held by the graph."""
    hidden, head, labels, weights, t_ids, t_lp = _inputs()
    hidden.requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        res = fused_head_loss(hidden, head, labels, weights, t_ids, t_lp, kl_weight=0.3, cap_weight=0.1,
                              chunk_size=8)
    assert saved == [N * H]
    assert isinstance(res.loss.grad_fn, FusedHeadLoss._backward_cls)
    assert [t.shape for t in res.loss.grad_fn.saved_tensors] == [(N, H)]


def test_no_grad_and_zero_weights():
    hidden, head, labels, weights, t_ids, t_lp = _inputs()
    with torch.no_grad():
        res = fused_head_loss(hidden, head, labels, weights, chunk_size=8)
    ref = naive_head_loss(hidden, head, labels, weights)
    torch.testing.assert_close(res.loss, ref.loss)
    h = hidden.clone().requires_grad_(True)
    zero = fused_head_loss(h, head, labels, torch.zeros(N))
    zero.loss.backward()
    assert zero.loss == 0 and h.grad.abs().max() == 0


def test_normalizer_override():
    hidden, head, labels, weights, t_ids, t_lp = _inputs()
    a = fused_head_loss(hidden, head, labels, weights)
    b = fused_head_loss(hidden, head, labels, weights, normalizer=2 * weights.sum())
    torch.testing.assert_close(b.loss, a.loss / 2)


def test_user_errors():
    hidden, head, labels, weights, t_ids, t_lp = _inputs()
    with pytest.raises(ValueError, match="frozen"):
        fused_head_loss(hidden, head.clone().requires_grad_(True), labels, weights)
    with pytest.raises(ValueError, match="teacher"):
        fused_head_loss(hidden, head, labels, weights, kl_weight=0.1)
    with pytest.raises(ValueError):
        fused_head_loss(hidden, head.double(), labels, weights)


def _tied_inputs(dtype):
    """Logits with exact ties: head rows 7 and 11 duplicate rows 2 and 4, positions 0..5 have their maximum on
    the tied pair 2/7, and labels sit on either copy and at every rank up to 11."""
    hidden, head, labels, weights, t_ids, t_lp = _inputs(dtype, seed=2)
    head, hidden, labels = head.clone(), hidden.clone(), labels.clone()
    head[7], head[11] = head[2], head[4]
    hidden[:6] = (head[2].float() * 4).to(dtype)
    labels[0:6] = torch.tensor([2, 7, 4, 11, 2, 7])
    top = (hidden.float() @ head.float().T).topk(12, dim=-1).indices
    labels[6:20] = top[torch.arange(6, 20), torch.arange(14) % 12]
    labels[3] = -100
    return hidden, head, labels, weights


@pytest.mark.parametrize("dtype,compile_mode,chunk", [(torch.float32, "never", 5), (torch.bfloat16, "never", 37),
                                                       (torch.float32, "always", 16), (torch.bfloat16, "always", 37)])
def test_label_rank_and_topk_match_a_full_sort(monkeypatch, dtype, compile_mode, chunk):
    """Top-k accuracy (rank < k) and the per-position top-k, on the eager and the compiled chunk path, equal a
    stable descending sort of the full logits; rank 0 is exactly the argmax hit."""
    import dflash_pipeline.train.loss as loss_mod

    monkeypatch.setattr(loss_mod, "COMPILE", compile_mode)
    hidden, head, labels, weights = _tied_inputs(dtype)
    h = hidden.clone().requires_grad_(True)
    res = fused_head_loss(h, head, labels, weights, chunk_size=chunk, topk=8, rank_limit=12)
    ref = naive_head_loss(hidden, head, labels, weights, topk=8, rank_limit=12)
    x = (hidden @ head.T).float()
    above = torch.tensor([sum(1 for v in x[i].tolist() if v > float(x[i, labels[i]])) if labels[i] >= 0 else V
                          for i in range(N)])
    want = above.clamp_max(12)
    assert torch.equal(res.label_rank_N, want) and torch.equal(ref.label_rank_N, want)
    assert int((above > 12).sum()) > 5  # the limit is exercised
    default = fused_head_loss(hidden, head, labels, weights, chunk_size=chunk)
    assert torch.equal(default.label_rank_N, above.clamp_max(8))
    assert len(set(want[6:20].tolist())) >= 10  # ranks up to 11 exercised
    # A tie counts for the label: both copies of the top pair have rank 0, argmax takes the first.
    assert want[[0, 1, 5]].tolist() == [0, 0, 0] and res.correct_N[[0, 1, 5]].tolist() == [True, False, False]
    assert bool((res.label_rank_N[res.correct_N] == 0).all())
    for k in (1, 4, 8):
        assert int((res.label_rank_N < k).sum()) == sum(
            int((x[i] > x[i, labels[i]]).sum()) < k for i in range(N) if labels[i] >= 0)
    # The top-k the tree estimate reads: the same log-probabilities as the full log-softmax's top-k.
    logp = torch.log_softmax(x.float(), -1)
    torch.testing.assert_close(res.topk_logprobs_NK, logp.gather(1, res.topk_ids_NK), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(res.topk_logprobs_NK, logp.topk(8, -1).values, atol=1e-5, rtol=1e-5)
    res.loss.backward()  # metrics do not disturb the gradient path
    assert h.grad is not None and fused_head_loss(hidden, head, labels, weights).topk_ids_NK is None
