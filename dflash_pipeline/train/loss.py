"""The frozen LM head and the drafter's loss, fused and chunked: one pass over each chunk's logits.

Logits for every labelled block slot do not fit (32K slots x 248K words is 32 GB in fp32), and chunking
alone does not help when autograd keeps each chunk's logits for backward (field notes). The head is
frozen, so backward only needs d loss / d hidden. `FusedHeadLoss.forward` therefore computes, for each
chunk of positions, the logits once (in the hidden dtype, bf16 on GPU), an fp32 log-softmax, and from
those same logits: the loss terms, their gradient with respect to the logits, grad_h = dlogits @ W and
the metrics (the argmax hit, the label's rank for top-k accuracy, and on request each position's top-k
for the tree estimate). Only grad_h [N, H] is saved; backward scales it by the incoming gradient. No
[N, V] tensor lives beyond one chunk and the head never runs twice.

The label's rank is the number of vocabulary entries with a strictly larger logit, counted up to
`rank_limit` (a rank >= the limit reads the limit); top-k accuracy for any k <= rank_limit is rank < k,
from one int per position. A tie with the label counts for the label (with tied bf16 logits rank 0 can
hold where argmax, which takes the first index, picked another token), which is what makes it cheap:
compiled, the count is one more reduction in the kernel that reads the logits; eager, the top
rank_limit logits (one top-k pass, 4x cheaper on the CPU than a comparison pass and its sum) decide
it exactly, whichever of several tied entries the top-k happened to return.

Terms, per labelled position i with weight w_i (position decay exp(-(k-1)/gamma) times validity):
- CE_i = -log p(label_i);
- KL_i = sum_k q_k (log q_k - log p(id_k)), forward KL(teacher || student), where q is the teacher's
  stored top-k renormalised over its k entries: the tail mass beyond the top-k is dropped, so q sums
  to 1 over the k ids (top-k slots with log-prob -inf get q = 0);
- CAP_i = entropy of the student distribution, only where argmax == label (LLaDA 2.0: sharpen what is
  already right); the argmax mask is a constant for the gradient.
loss = [(1 - kl_weight) * sum w CE + kl_weight * sum w KL + cap_weight * sum w CAP] / normalizer, with
normalizer = sum(w) by default (the decay-weighted count, not the token count). Pass `normalizer` to
normalise over a larger set (gradient accumulation, data parallel: the global sum of weights).

Shape legend: N labelled positions, C positions of one chunk, H hidden, V vocabulary, K teacher top-k.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from dflash_pipeline.train.kernels import allow_recompiles


class HeadLossResult(NamedTuple):
    loss: torch.Tensor  # scalar fp32, differentiable w.r.t. hidden
    ce: torch.Tensor  # scalar fp32, detached: sum w*CE / normalizer
    kl: torch.Tensor  # same for KL (0 without teacher)
    cap: torch.Tensor  # same for CAP (0 when cap_weight == 0)
    correct_N: torch.Tensor  # bool, argmax == label (False for negative labels)
    label_rank_N: torch.Tensor | None = None  # int64, entries with a larger logit, up to rank_limit (negative
                                              # labels: rank_limit)
    topk_ids_NK: torch.Tensor | None = None  # int64 [N, topk], best first, when topk > 0 is asked for
    topk_logprobs_NK: torch.Tensor | None = None  # fp32 log-probabilities of those ids


def _check(hidden_NH, head_weight_VH, labels_N, weights_N, teacher_ids_NK, teacher_logprobs_NK, kl_weight):
    if head_weight_VH.requires_grad:
        raise ValueError("the LM head must be frozen (requires_grad=False): the fused loss returns no gradient for it")
    if hidden_NH.dtype != head_weight_VH.dtype:
        raise ValueError(f"hidden ({hidden_NH.dtype}) and LM head ({head_weight_VH.dtype}) dtypes differ")
    N = hidden_NH.shape[0]
    if labels_N.shape != (N,) or weights_N.shape != (N,):
        raise ValueError(f"labels {tuple(labels_N.shape)} and weights {tuple(weights_N.shape)} must be ({N},)")
    if (teacher_ids_NK is None) != (teacher_logprobs_NK is None):
        raise ValueError("teacher_ids and teacher_logprobs come together")
    if kl_weight > 0 and teacher_ids_NK is None:
        raise ValueError("kl_weight > 0 needs the teacher's top-k (teacher_ids, teacher_logprobs)")
    if not 0.0 <= kl_weight <= 1.0:
        raise ValueError(f"kl_weight must be in [0, 1], got {kl_weight}")


def _acc_dtype(hidden: torch.Tensor) -> torch.dtype:
    """Loss math in fp32 (fp64 for fp64 inputs, which gradient checks use)."""
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def _teacher_probs(teacher_logprobs_CK: torch.Tensor) -> torch.Tensor:
    """Top-k log-probs -> probabilities renormalised over the k entries (all -inf rows -> zeros)."""
    q = torch.softmax(teacher_logprobs_CK.float(), dim=-1)
    return torch.nan_to_num(q, nan=0.0)


def _kl_sum(x_CV, lse_C1, ids_CK, teacher_lp_CK, w_C):
    """(teacher ids as int64, renormalised teacher probabilities q, sum w KL) of one chunk."""
    ids_CK = ids_CK.long()
    q_CK = _teacher_probs(teacher_lp_CK).to(w_C.dtype)
    kl_C = (torch.xlogy(q_CK, q_CK) - q_CK * (x_CV.gather(1, ids_CK).to(w_C.dtype) - lse_C1)).sum(-1)
    return ids_CK, q_CK, (w_C * kl_C).sum()


def _softmax_terms(x_CV, labels_C, scale_C, ce_coef: float, cap_weight: float, need_grad: bool, rank_limit: int):
    """Everything the loss needs from a chunk's logits x, as one function for torch.compile.

    Returns (lse, x at the label, argmax, label rank, entropy or None, gradient or None). The gradient, in x's dtype,
    is d/dx of ce_coef*CE + cap_weight*CAP (CAP: the entropy where argmax == label) times scale_C:
    p (1 - cap m (log p + ent)) scale - ce_coef onehot(label) scale. Compiled (CUDA), the reductions and
    this expression read x a few times and write only the gradient, where the eager path below makes
    several fp32 passes over [C, V].
    """
    acc = _acc_dtype(x_CV)
    xf = x_CV.to(acc)
    m_C1 = xf.amax(-1, keepdim=True)
    arg_C = x_CV.argmax(-1)
    e_CV = (xf - m_C1).exp()
    s_C1 = e_CV.sum(-1, keepdim=True)
    lse_C1 = m_C1 + s_C1.log()
    x_lab_C = xf.gather(1, labels_C.clamp_min(0)[:, None])[:, 0]
    rank_C = torch.where(labels_C >= 0, (xf > x_lab_C[:, None]).sum(-1).clamp_max(rank_limit), rank_limit)
    ent_C1 = lse_C1 - (e_CV * xf).sum(-1, keepdim=True) / s_C1 if cap_weight > 0 else None
    if not need_grad:
        return lse_C1, x_lab_C, arg_C, rank_C, ent_C1, None
    g_CV = e_CV * (scale_C[:, None] / s_C1)
    if cap_weight > 0:
        hit_C1 = ((arg_C == labels_C) & (labels_C >= 0)).to(acc)[:, None]
        g_CV = g_CV * (1.0 - cap_weight * hit_C1 * (xf - lse_C1 + ent_C1))
    vocab_1V = torch.arange(x_CV.shape[1], device=x_CV.device)[None]
    g_CV = g_CV - torch.where(vocab_1V == labels_C[:, None], (ce_coef * scale_C)[:, None], 0.0)
    return lse_C1, x_lab_C, arg_C, rank_C, ent_C1, g_CV.to(x_CV.dtype)


def _topk(x_CV, k: int):
    """(ids, logits) of the chunk's top-k, best first, or None; log-probs once the chunk's lse is known."""
    if not k:
        return None
    top = x_CV.topk(min(k, x_CV.shape[1]), dim=-1, sorted=True)
    return top.indices, top.values


# Where the compiled `_softmax_terms` runs: "cuda" (default; on the CPU the eager chunk code below is
# faster than a compiled kernel and needs no compiler), "always" (tests: compiled on the CPU too), "never".
COMPILE = "cuda"


@functools.cache
def _compiled_terms():
    allow_recompiles()
    return torch.compile(_softmax_terms, dynamic=None, fullgraph=True)


def _terms_fn(device: torch.device, compiled: bool | None):
    """compiled: False = eager; None = as COMPILE says."""
    if compiled is False:
        return None
    if COMPILE == "always" or (COMPILE == "cuda" and device.type == "cuda"):
        return _compiled_terms()
    return None


def _chunk_compiled(fn, h_CH, head_weight_VH, labels_C, w_C, ids_CK, teacher_lp_CK, kl_weight, cap_weight,
                    inv_norm, need_grad, rank_limit, topk):
    acc = _acc_dtype(h_CH)
    w_C = w_C.to(acc)
    x_CV = h_CH @ head_weight_VH.T
    scale_C = w_C * inv_norm
    lse_C1, x_lab_C, arg_C, rank_C, ent_C1, g_CV = fn(x_CV, labels_C, scale_C, 1.0 - kl_weight, cap_weight,
                                                      need_grad, rank_limit)
    correct_C = (arg_C == labels_C) & (labels_C >= 0)
    top = _topk(x_CV, topk)
    metrics = (correct_C, rank_C, None if top is None else (top[0], top[1].to(acc) - lse_C1))
    sums = torch.zeros(3, dtype=acc, device=h_CH.device)
    sums[0] = (w_C * (lse_C1[:, 0] - x_lab_C)).sum()
    if ids_CK is not None:
        ids_CK, q_CK, sums[1] = _kl_sum(x_CV, lse_C1, ids_CK, teacher_lp_CK, w_C)
    if cap_weight > 0:
        sums[2] = (w_C * correct_C.to(acc) * ent_C1[:, 0]).sum()
    del x_CV
    if not need_grad:
        return sums, metrics, None
    if ids_CK is not None and kl_weight > 0:
        # The KL part of the gradient lives on the K teacher ids only: -a q scale, added in place.
        g_CV.scatter_add_(1, ids_CK, q_CK.mul_((-kl_weight * scale_C)[:, None]).to(g_CV.dtype))
    return sums, metrics, g_CV @ head_weight_VH


def _chunk(h_CH, head_weight_VH, labels_C, w_C, ids_CK, teacher_lp_CK, kl_weight, cap_weight, inv_norm, need_grad,
           compiled=None, rank_limit=8, topk=0):
    """Weighted CE/KL/CAP sums, metrics (argmax hits, label ranks, top-k or None) and d loss / d h of one
    chunk, from one head matmul.

    A function of its own so that the chunk's [C, V] buffers are freed on return, before the next
    chunk's matmul.
    """
    fn = _terms_fn(h_CH.device, compiled)
    if fn is not None:
        return _chunk_compiled(fn, h_CH, head_weight_VH, labels_C, w_C, ids_CK, teacher_lp_CK, kl_weight,
                               cap_weight, inv_norm, need_grad, rank_limit, topk)
    acc = _acc_dtype(h_CH)
    w_C = w_C.to(acc)
    safe_labels_C1 = labels_C.clamp_min(0)[:, None]
    # Passes over [C, V] are what this costs beside the two matmuls (the profile: ~90 ms per step at
    # 32K slots x 152K words), so the softmax is built in as few as possible: the row max and argmax
    # in one pass over the head's own output, exp(x - max) written once in fp32 and exponentiated in
    # place, its row sum; log-probabilities are only gathered where needed (label, teacher ids), and
    # the gradient is that same buffer scaled in place.
    x_CV = h_CH @ head_weight_VH.T
    max_C, arg_C = x_CV.max(dim=-1)
    correct_C = (arg_C == labels_C) & (labels_C >= 0)
    # The label's rank from the top rank_limit logits: every entry larger than the label is among them
    # unless there are at least rank_limit of those, and then all of them are larger (the count reads the
    # limit). One top-k serves the rank and the requested top-k.
    top = _topk(x_CV, max(rank_limit, topk))
    above_C = (top[1][:, :rank_limit] > x_CV.gather(1, safe_labels_C1)).sum(-1)
    rank_C = torch.where(labels_C >= 0, above_C, rank_limit)
    top = (top[0][:, :topk], top[1][:, :topk]) if topk else None
    m_C1 = max_C.to(acc)[:, None]
    e_CV = torch.sub(x_CV, m_C1) if x_CV.dtype == acc else torch.sub(x_CV.to(acc), m_C1)
    e_CV.exp_()
    s_C1 = e_CV.sum(dim=-1, keepdim=True)
    lse_C1 = m_C1 + s_C1.log()
    sums = torch.zeros(3, dtype=acc, device=h_CH.device)
    sums[0] = (w_C * (lse_C1 - x_CV.gather(1, safe_labels_C1).to(acc))[:, 0]).sum()
    if ids_CK is not None:
        ids_CK, q_CK, sums[1] = _kl_sum(x_CV, lse_C1, ids_CK, teacher_lp_CK, w_C)
    if cap_weight > 0:
        # entropy = lse - sum p x, with p = e / s
        ent_C1 = lse_C1 - torch.einsum("cv,cv->c", e_CV, x_CV.to(acc))[:, None] / s_C1
        cap_mask_C = correct_C.to(acc)
        sums[2] = (w_C * cap_mask_C * ent_C1[:, 0]).sum()
    metrics = (correct_C, rank_C, None if top is None else (top[0], top[1].to(acc) - lse_C1))
    if not need_grad:
        return sums, metrics, None
    # d/dlogits of (1-a) CE + a KL + c m H, per row, with m the (constant) argmax mask:
    #   (1-a)(p - onehot(y)) + a(p - q_scattered) - c m p (log p + H)
    # = p (1 - c m (log p + H)) - (1-a) onehot(y) - a q_scattered,   all times w / normalizer
    scale_C = w_C * inv_norm
    g_CV = e_CV.mul_((scale_C[:, None] / s_C1))                 # p * scale
    if cap_weight > 0:
        factor_CV = x_CV.to(acc).sub_(lse_C1 - ent_C1).mul_(-cap_weight * cap_mask_C[:, None]).add_(1.0)
        g_CV.mul_(factor_CV)
        del factor_CV
    g_CV.scatter_add_(1, safe_labels_C1, ((kl_weight - 1.0) * scale_C)[:, None])
    if ids_CK is not None and kl_weight > 0:
        g_CV.scatter_add_(1, ids_CK, q_CK.mul_((-kl_weight * scale_C)[:, None]))
    del x_CV
    return sums, metrics, g_CV.to(h_CH.dtype) @ head_weight_VH


class FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, head_weight_VH, labels_N, weights_N, teacher_ids_NK, teacher_logprobs_NK,
                kl_weight, cap_weight, chunk_size, normalizer, compiled, rank_limit, topk):
        N = hidden_NH.shape[0]
        dev = hidden_NH.device
        need_grad = ctx.needs_input_grad[0]
        grad_NH = torch.empty_like(hidden_NH) if need_grad else None
        sums = torch.zeros(3, dtype=_acc_dtype(hidden_NH), device=dev)  # weighted CE, KL, CAP
        correct_N = torch.zeros(N, dtype=torch.bool, device=dev)
        rank_N = torch.zeros(N, dtype=torch.long, device=dev)
        k = min(topk, head_weight_VH.shape[0])
        top_ids_NK = torch.zeros(N, k, dtype=torch.long, device=dev)
        top_lp_NK = torch.zeros(N, k, dtype=_acc_dtype(hidden_NH), device=dev)
        inv_norm = 1.0 / normalizer
        for s in range(0, N, chunk_size):
            e = min(N, s + chunk_size)
            chunk_sums, (correct_N[s:e], rank_N[s:e], top), grad_CH = _chunk(
                hidden_NH[s:e], head_weight_VH, labels_N[s:e], weights_N[s:e],
                None if teacher_ids_NK is None else teacher_ids_NK[s:e],
                None if teacher_logprobs_NK is None else teacher_logprobs_NK[s:e],
                kl_weight, cap_weight, inv_norm, need_grad, compiled, rank_limit, k,
            )
            sums += chunk_sums
            if top is not None:
                top_ids_NK[s:e], top_lp_NK[s:e] = top
            if need_grad:
                grad_NH[s:e] = grad_CH
        ce, kl, cap = (sums * inv_norm).unbind(0)
        loss = (1.0 - kl_weight) * ce + kl_weight * kl + cap_weight * cap
        if need_grad:
            ctx.save_for_backward(grad_NH)
        ctx.mark_non_differentiable(ce, kl, cap, correct_N, rank_N, top_ids_NK, top_lp_NK)
        return loss, ce, kl, cap, correct_N, rank_N, top_ids_NK, top_lp_NK

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        (grad_NH,) = ctx.saved_tensors
        return (grad_NH * grad_loss.to(grad_NH.dtype), None, None, None, None, None, None, None, None, None, None,
                None, None)


def _normalizer(weights_N: torch.Tensor, normalizer, dtype: torch.dtype) -> torch.Tensor:
    if normalizer is None:
        # All-zero weights give a zero loss and gradient instead of 0/0.
        return weights_N.to(dtype).sum().clamp_min(torch.finfo(torch.float32).tiny)
    return torch.as_tensor(normalizer, device=weights_N.device).to(dtype)


def fused_head_loss(
    hidden_NH: torch.Tensor,
    head_weight_VH: torch.Tensor,
    labels_N: torch.Tensor,
    weights_N: torch.Tensor,
    teacher_ids_NK: torch.Tensor | None = None,
    teacher_logprobs_NK: torch.Tensor | None = None,
    *,
    kl_weight: float = 0.0,
    cap_weight: float = 0.0,
    chunk_size: int = 2048,
    normalizer: float | torch.Tensor | None = None,
    compiled: bool | None = None,
    rank_limit: int = 8,
    topk: int = 0,
) -> HeadLossResult:
    """Loss, metrics and (saved) input gradient of the frozen head in one chunked pass; see module doc.
    compiled=False keeps each chunk's softmax math eager (None: compiled on CUDA, see COMPILE). Label ranks
    are counted up to rank_limit. topk > 0 also returns each position's top-k ids and log-probabilities
    (the draft tree's input), from the same logits."""
    _check(hidden_NH, head_weight_VH, labels_N, weights_N, teacher_ids_NK, teacher_logprobs_NK, kl_weight)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if topk < 0 or rank_limit < 1:
        raise ValueError(f"topk must be >= 0 and rank_limit >= 1, got {topk} and {rank_limit}")
    *out, top_ids, top_lps = FusedHeadLoss.apply(
        hidden_NH, head_weight_VH, labels_N, weights_N, teacher_ids_NK, teacher_logprobs_NK,
        float(kl_weight), float(cap_weight), int(chunk_size), _normalizer(weights_N, normalizer, _acc_dtype(hidden_NH)),
        compiled, int(rank_limit), int(topk),
    )
    return HeadLossResult(*out, *((top_ids, top_lps) if topk else (None, None)))


def naive_head_loss(
    hidden_NH: torch.Tensor,
    head_weight_VH: torch.Tensor,
    labels_N: torch.Tensor,
    weights_N: torch.Tensor,
    teacher_ids_NK: torch.Tensor | None = None,
    teacher_logprobs_NK: torch.Tensor | None = None,
    *,
    kl_weight: float = 0.0,
    cap_weight: float = 0.0,
    normalizer: float | torch.Tensor | None = None,
    rank_limit: int = 8,
    topk: int = 0,
) -> HeadLossResult:
    """The same loss with full logits and plain autograd: the reference for tests (memory O(N*V))."""
    _check(hidden_NH, head_weight_VH, labels_N, weights_N, teacher_ids_NK, teacher_logprobs_NK, kl_weight)
    acc = _acc_dtype(hidden_NH)
    norm = _normalizer(weights_N, normalizer, acc)
    w_N = weights_N.to(acc)
    x_NV = hidden_NH @ head_weight_VH.T
    logp_NV = torch.log_softmax(x_NV.to(acc), dim=-1)
    correct_N = (logp_NV.argmax(-1) == labels_N) & (labels_N >= 0)
    # The label's place in the head's own logits sorted in descending order (the first of its ties).
    sorted_NV = torch.sort(x_NV.to(acc), dim=-1, descending=True).values
    x_lab_N1 = x_NV.to(acc).gather(1, labels_N.clamp_min(0)[:, None])
    rank_N = torch.where(labels_N >= 0, torch.searchsorted(-sorted_NV, -x_lab_N1)[:, 0].clamp_max(rank_limit),
                         rank_limit)
    top = logp_NV.topk(topk, dim=-1) if topk else None
    ce = (w_N * -logp_NV.gather(1, labels_N.clamp_min(0)[:, None])[:, 0]).sum() / norm
    zero = logp_NV.new_zeros(())
    kl = zero
    if teacher_ids_NK is not None:
        q_NK = _teacher_probs(teacher_logprobs_NK).to(acc)
        kl_N = (torch.xlogy(q_NK, q_NK) - q_NK * logp_NV.gather(1, teacher_ids_NK.long())).sum(-1)
        kl = (w_N * kl_N).sum() / norm
    cap = zero
    if cap_weight > 0:
        ent_N = -(logp_NV.exp() * logp_NV).sum(-1)
        cap = (w_N * correct_N.to(acc) * ent_N).sum() / norm
    loss = (1.0 - kl_weight) * ce + kl_weight * kl + cap_weight * cap
    return HeadLossResult(loss, ce.detach(), kl.detach(), cap.detach(), correct_N, rank_N,
                          None if top is None else top.indices, None if top is None else top.values.detach())
