"""The held-out estimate during training, including the greedy-chain estimate of acceptance length.

Not a real decode (that is `dflash eval`, which runs the target): an estimate from the store's held-out
samples, cheap enough to run every epoch. Random-anchor averages overestimate real decoding. Here every
anchorable position of a held-out sample is drafted once (visibility depends on absolute positions
only, so all anchors can share one forward pass), giving run(p): how many slots from slot 1 the drafter
gets right from anchor p. Walking p <- p + run(p) + 1 from the first supervised position reproduces
greedy speculative decoding on that sequence; tokens committed per step (bonus included) averaged over
the walk is `tau_chain_text`: every slot judged against the store's text.

Real decoding judges a draft against the target's own greedy choice, not the text. Where the text is the
target's own (replies it generated greedily) the two agree; on other text (human or another model's replies,
of which the target's top-1 is often only ~60%) the text-judged walk reads low: a draft the target would
accept counts as wrong wherever the text says something else. `tau_chain` judges each slot against the
target's top-1 as the store holds it for every token. That is exact where the context is what decoding would
have written: from anchor p, slot k's verdict is exact while the text's tokens p+1..p+k-1 are the target's
own top-1 (the drafted slots before it, being accepted, are the same tokens). At the first accepted slot
where the text leaves the target's choice the run is censored: decoding would go on from a text the store
does not hold. Its remainder is estimated as survival analysis does (Kaplan-Meier): the rate of acceptance at
each slot given the slots before it, over the anchors observed exactly there (pooled over the held-out set and
the ranks), extends the censored run by its expected further accepted slots (rounded; the walk moves in whole
tokens). On the target's own text nothing is censored and `tau_chain` equals `tau_chain_text`.
`target_agreement` is the share of the held-out supervised tokens that are the target's top-1 (1.0 on its
own greedy replies), and `accept_per_pos` the acceptance rate at each slot given the slots before it (the
same quantity `dflash eval` reports per slot). A store without top-k judges against the text only.

The tree estimate (`tau_tree_N` for each budget N of `tree_budgets`) is the same walk with tree
verification (DDTree, as `dflash eval --tree-budget N` decodes): the same forward also returns the
drafter's top-K log-probabilities of every labelled slot (K = the largest budget, which makes every
budget's tree the tree of the full distribution), `decoding.tree.reference_depths` builds each anchor's
budget-N tree from them exactly as eval builds it, and the accepted depth at an anchor is how much of
the reference continuation the tree holds. Only labelled slots have logits, so in the last B - 1
positions of a supervised span the tree is grown from the slots that remain (the span's end stops the
walk there anyway); a tree over fewer slots holds every shallow node of the full one, so there the
estimate can be slightly optimistic. Trees are judged as the chain is: `tau_tree_N` against the target (a slot
accepted while the tree holds the target's top-1 path to it; exact while the text is that path, censored and
extended by the tree's own per-depth rates where it is not; trees are rebuilt only for the anchors whose
continuation is not the target's own), `text_tau_tree` against the text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dflash_pipeline.decoding.tree import reference_depths, topk_for_budget, tree_estimate, walk_sequence
from dflash_pipeline.train.blocks import anchor_candidates
from dflash_pipeline.train.batch import Batch
from dflash_pipeline.train.model import DrafterConfig
from dflash_pipeline.train.metrics import slot_accuracies
from dflash_pipeline.train.step import TOPK_ACCURACY, Frozen, run_blocks


@dataclass
class HeldoutSet:
    """The held-out samples of this rank and how to run the drafter on them (as training steps do)."""

    reader: Any                 # the StoreReader of the training store
    rows: np.ndarray            # this rank's held-out sample rows
    frozen: Frozen
    drafter: DrafterConfig
    gamma: float
    max_anchors: int            # anchors per forward pass
    loss_chunk: int
    device: torch.device
    autocast: bool
    world: int = 1              # ranks whose sums are added together (all-reduce) before the ratios
    tree_budgets: tuple[int, ...] = ()  # tree estimate budgets (tau_tree_N); () skips it
    new_tokens: int = 0         # walk at most this many tokens of each reply, as `dflash eval --max-new-tokens`
                                # decodes (0: whole replies; later tokens of a long reply are often easier)


def _sample_batch(held: HeldoutSet, row: int) -> tuple[Batch, torch.Tensor]:
    """One held-out sample as a one-row batch on the device, and its anchor candidates [T] (host)."""
    s = held.reader.read_sample(int(row), layers=held.drafter.target_layer_ids)
    T = len(s.tokens_T)
    mask = torch.from_numpy(s.loss_mask_T)[None]
    doc = torch.zeros((1, T), dtype=torch.long)
    batch = Batch(torch.from_numpy(s.tokens_T.astype(np.int64))[None], mask, torch.arange(T)[None], doc,
                  s.hidden_TLH.reshape(1, T, -1),
                  torch.from_numpy(s.topk_ids_TK.astype(np.int64))[None],
                  torch.from_numpy(s.topk_logprobs_TK.astype(np.float32))[None], T).to(held.device)
    return batch, anchor_candidates(mask[0], doc[0])


@torch.no_grad()
def heldout_estimate(model, held: HeldoutSet) -> dict[str, Any]:
    """Loss, accuracy, the random-anchor streak, `tau_chain` and `tau_tree_N` over the held-out samples,
    summed over `held.world` ranks (every rank must call it). The model runs as it is (call `.eval()`
    first)."""
    dcfg, device, max_anchors = held.drafter, held.device, held.max_anchors
    B, budgets = dcfg.block_size, [int(b) for b in held.tree_budgets]
    K = topk_for_budget(max(budgets), held.frozen.head_VH.shape[0]) if budgets else 0
    # sums: ce*labels, labels, streak, blocks, chain steps, chain committed, samples; per slot: correct,
    # count, top-k correct; per tree budget: rounds, tokens committed
    J = len(TOPK_ACCURACY)
    tree_at = 7 + (2 + J) * B
    m = B - 1
    judge = held.reader.meta.topk > 0     # the store holds the target's top-1 of every token
    judged = [0, *budgets] if judge else []   # walks judged against the target: the chain (0), then each tree
    judged_at = tree_at + 2 * len(budgets)    # per judged walk: rounds, committed; then agreeing, supervised tokens
    v = torch.zeros(judged_at + 2 * len(judged) + 2, dtype=torch.float64, device=device)
    hz = torch.zeros(len(judged), 2, m, dtype=torch.float64, device=device)   # per slot: at risk, rejected
    walks: list[tuple[np.ndarray, np.ndarray, list[_Runs]]] = []
    for row in held.rows:
        batch, cands = _sample_batch(held, row)
        T = cands.shape[0]
        idx = cands.nonzero()[:, 0]
        runs = np.full(T, -1, dtype=np.int64)
        tops = []
        for a in range(0, len(idx), max_anchors):
            anchors = idx[a:a + max_anchors][None]
            out = run_blocks(model, held.frozen, batch, anchors, block_size=B, mask_token_id=dcfg.mask_token_id,
                             gamma=held.gamma, kl_weight=0.0, cap_weight=0.0, feature_noise=0.0,
                             loss_chunk=held.loss_chunk, g=None, autocast=held.autocast,
                             topk=max(K, 1) if judge else K)
            tops.append(out.draft_topk)
            n_lab = out.count_B.sum().double()
            v[0] += out.ce.double() * n_lab
            v[1] += n_lab
            v[2] += out.streak_sum.double()
            v[3] += out.blocks.double()
            v[7:7 + B] += out.correct_B.double()
            v[7 + B:7 + 2 * B] += out.count_B.double()
            v[7 + 2 * B:tree_at] += out.topk_correct_JB.flatten().double()
            runs[anchors[0].numpy()] = out.run_RA[0].cpu().numpy()
        steps, committed = walk_sequence(runs, cands.numpy(), held.new_tokens)
        v[4] += steps
        v[5] += committed
        v[6] += 1
        if not len(idx) or not (budgets or judge):
            continue
        lp, ids, ref = (torch.cat([getattr(t, f)[0] for t in tops]) for f in
                        ("logprobs_RAmK", "ids_RAmK", "reference_RAm"))
        text_depth: dict[int, torch.Tensor] = {}   # trees judged against the text
        est = tree_estimate(lp, ids, ref, idx, cands, budgets, held.new_tokens, depths=text_depth)
        for i, b in enumerate(budgets):
            v[tree_at + 2 * i:tree_at + 2 * i + 2] += torch.tensor(est[b], dtype=torch.float64, device=device)
        if judge:
            sample_runs = _judge_sample(batch, idx.to(device), lp, ids, ref, text_depth, judged)
            for j, r in enumerate(sample_runs):
                hz[j] += r.hazards(m)
            walks.append((idx.numpy(), cands.numpy(), [r.to_host() for r in sample_runs]))
            mask, tok, next1 = batch.loss_mask[0, 1:], batch.tokens[0, 1:], batch.topk_ids[0, :-1, 0]
            v[-2] += ((tok == next1) & mask).sum().double()
            v[-1] += mask.sum().double()
    accept = _walk_judged(walks, hz, v, judged_at, held) if judge else np.zeros((0, m))
    if held.world > 1:
        import torch.distributed as dist

        dist.all_reduce(v)
    v = v.cpu()

    def tau(at: int) -> float:
        return float(v[at + 1] / v[at].clamp_min(1))

    text_tree = {b: tau(tree_at + 2 * i) for i, b in enumerate(budgets)}
    correct, count, topk = v[7:7 + B], v[7 + B:7 + 2 * B], v[7 + 2 * B:tree_at].view(J, B)
    return {
        "loss": float(v[0] / v[1].clamp_min(1)),      # unweighted CE per labelled slot
        **slot_accuracies(correct, topk, count),
        "streak": float(v[2] / v[3].clamp_min(1)),   # every anchor: the random-anchor style estimate
        # judged against the target's top-1 (what decoding does; the text where the store has no top-k)
        "tau_chain": tau(judged_at) if judge else tau(4),
        "tau_chain_text": tau(4),                    # every slot judged against the store's text
        **{f"tau_tree_{b}": tau(judged_at + 2 * (i + 1)) if judge else text_tree[b] for i, b in enumerate(budgets)},
        **({"target_agreement": float(v[-2] / v[-1].clamp_min(1)),
            "accept_per_pos": [round(float(a), 4) for a in accept[0]],
            **({"text_tau_tree": {str(b): t for b, t in text_tree.items()}} if budgets else {})} if judge else {}),
        "samples": int(v[6]),
        "blocks": int(v[3]),
        "new_tokens": held.new_tokens,               # the taus' walk length per reply (0: whole replies)
    }


def _judge_sample(batch: Batch, anchors_A: torch.Tensor, lp, ids, ref: torch.Tensor,
                  text_depth: dict[int, torch.Tensor], judged: list[int]) -> list["_Runs"]:
    """One sample's anchors judged against the target, for each judged walk: the chain (budget 0: the drafter's
    argmax) and each tree budget (the tree holds the target's path; rebuilt only for the anchors whose
    continuation is not the target's own, the others keep their text-judged depth)."""
    m = ref.shape[1]
    top1 = _target_reference(batch, anchors_A, ref)
    differ = (top1 != ref).any(1)
    out = []
    for b in judged:
        if b == 0:
            accepted_Am = (ref >= 0) & (ids[..., 0] == top1)
        else:
            depth = text_depth[b].clone()
            if differ.any():
                depth[differ] = reference_depths(lp[differ], ids[differ], top1[differ], b)
            accepted_Am = torch.arange(m, device=ref.device) < depth[:, None]
        out.append(_judge_runs(accepted_Am, ref, top1))
    return out


def _walk_judged(walks, hz: torch.Tensor, v: torch.Tensor, judged_at: int, held: HeldoutSet) -> np.ndarray:
    """The judged walks of every sample into `v` (rounds, committed per walk from `judged_at`), their censored runs
    extended by the acceptance rates pooled over the ranks; returns the rates [walks, m]."""
    if held.world > 1:
        import torch.distributed as dist

        dist.all_reduce(hz)   # every rank's walks extend their censored runs by the same rates
    accept = (1 - hz[:, 1] / hz[:, 0].clamp_min(1)).where(hz[:, 0] > 0, torch.zeros_like(hz[:, 0])).cpu().numpy()
    further = [_expected_further(a) for a in accept]
    for idx, cands, sample_runs in walks:
        for j, r in enumerate(sample_runs):
            runs = np.full(len(cands), -1, dtype=np.int64)
            runs[idx] = r.runs(further[j])
            steps, committed = walk_sequence(runs, cands, held.new_tokens)
            v[judged_at + 2 * j] += steps
            v[judged_at + 2 * j + 1] += committed
    return accept


# What ends an anchor's exactly observed run at its first slot that is not "accepted on the target's own text"
_END, _REJECTED, _CENSORED, _FULL = 0, 1, 2, 3


@dataclass
class _Runs:
    """One sample's anchors, judged against the target: per anchor, the slots accepted on the target's own text
    before the run ended (`first`), how it ended (`how`) and its labelled slots (`labelled`)."""

    first: torch.Tensor
    how: torch.Tensor
    labelled: torch.Tensor

    def hazards(self, m: int) -> torch.Tensor:
        """[2, m]: per slot, the anchors observed exactly there (at risk) and those rejected there."""
        reach = torch.where((self.how == _REJECTED) | (self.how == _CENSORED), self.first + 1, self.first)
        at_risk = torch.bincount(reach, minlength=m + 1).flip(0).cumsum(0).flip(0)[1:m + 1]
        rejected = torch.bincount(self.first[self.how == _REJECTED], minlength=m)[:m]
        return torch.stack([at_risk, rejected]).double()

    def to_host(self) -> "_Runs":
        return _Runs(self.first.cpu(), self.how.cpu(), self.labelled.cpu())

    def runs(self, further: np.ndarray) -> np.ndarray:
        """Accepted slots per anchor: the observed run, a censored one extended by `further`[s, n] (the
        expected further accepted slots after s accepted, of n labelled), rounded."""
        first, how, n = self.first.numpy(), self.how.numpy(), self.labelled.numpy()
        runs = first.astype(np.float64)
        cen = how == _CENSORED
        runs[cen] = first[cen] + 1 + further[first[cen] + 1, n[cen]]
        return np.rint(runs).astype(np.int64)


def _target_reference(batch: Batch, anchors_A: torch.Tensor, ref_Am: torch.Tensor) -> torch.Tensor:
    """[A, m] the target's top-1 at each anchor's labelled slots (stored with the token before the slot), -1 where
    the slot has no label."""
    T, m = batch.tokens.shape[1], ref_Am.shape[1]
    teacher_Am = (anchors_A[:, None] + torch.arange(m, device=anchors_A.device)).clamp_max(T - 1)
    return torch.where(ref_Am >= 0, batch.topk_ids[0, :, 0][teacher_Am], -1)


def _judge_runs(accepted_Am: torch.Tensor, ref_Am: torch.Tensor, top1_Am: torch.Tensor) -> _Runs:
    """Each anchor's run of accepted slots (the drafted token, or the tree's path, is the target's top-1 there)
    while the text is the target's own; how it ended, and its labelled slots."""
    m = ref_Am.shape[1]
    labelled = ref_Am >= 0
    accepted = accepted_Am & labelled
    own = accepted & (ref_Am == top1_Am)               # accepted, and the text goes on as the target would
    first = _leading(own)                               # slots accepted on the target's own text
    at = first.clamp_max(m - 1)[:, None]
    how = torch.where(first == m, _FULL,
                      torch.where(~labelled.gather(1, at)[:, 0], _END,
                                  torch.where(~accepted.gather(1, at)[:, 0], _REJECTED, _CENSORED)))
    return _Runs(first, how, _leading(labelled))


def _leading(flags_Am: torch.Tensor) -> torch.Tensor:
    """Per row, how many flags are set before the first unset one."""
    return torch.cat([flags_Am, torch.zeros_like(flags_Am[:, :1])], 1).int().argmin(1)


def _expected_further(accept: np.ndarray) -> np.ndarray:
    """[s, n] for 0 <= s <= n <= m: the expected accepted slots after the first s of n labelled ones were
    accepted, given the acceptance rate of each slot given the ones before it (`accept`, m slots)."""
    m = len(accept)
    out = np.zeros((m + 1, m + 1))
    for s in range(m + 1):
        survive = np.cumprod(accept[s:])                # P(slots s..j accepted | the first s were)
        out[s, s + 1:] = np.cumsum(survive)
    return out


__all__ = ["HeldoutSet", "heldout_estimate"]
