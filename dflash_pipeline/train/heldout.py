"""The held-out estimate during training, including the greedy-chain estimate of acceptance length.

Not a real decode (that is `dflash eval`, which runs the target): an estimate from the store's held-out
samples, cheap enough to run every epoch. Random-anchor averages overestimate real decoding. Here every
anchorable position of a held-out sample is drafted once (visibility depends on absolute positions
only, so all anchors can share one forward pass), giving run(p): how many slots from slot 1 the drafter
gets right from anchor p. Walking p <- p + run(p) + 1 from the first supervised position reproduces
greedy speculative decoding on that sequence; tokens committed per step (bonus included) averaged over
the walk is `tau_chain`.

The tree estimate (`tau_tree_N` for each budget N of `tree_budgets`) is the same walk with tree
verification (DDTree, as `dflash eval --tree-budget N` decodes): the same forward also returns the
drafter's top-K log-probabilities of every labelled slot (K = the largest budget, which makes every
budget's tree the tree of the full distribution), `decoding.tree.tree_estimate` builds each anchor's
budget-N tree from them exactly as eval builds it, and the accepted depth at an anchor is how much of
the reference continuation the tree holds. Only labelled slots have logits, so in the last B - 1
positions of a supervised span the tree is grown from the slots that remain (the span's end stops the
walk there anyway); a tree over fewer slots holds every shallow node of the full one, so there the
estimate can be slightly optimistic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dflash_pipeline.decoding.tree import topk_for_budget, tree_estimate, walk_sequence
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
    v = torch.zeros(tree_at + 2 * len(budgets), dtype=torch.float64, device=device)
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
                             loss_chunk=held.loss_chunk, g=None, autocast=held.autocast, topk=K)
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
        if budgets and len(idx):
            lp, ids, ref = (torch.cat([getattr(t, f)[0] for t in tops]) for f in
                            ("logprobs_RAmK", "ids_RAmK", "reference_RAm"))
            est = tree_estimate(lp, ids, ref, idx, cands, budgets, held.new_tokens)
            for i, b in enumerate(budgets):
                v[tree_at + 2 * i:tree_at + 2 * i + 2] += torch.tensor(est[b], dtype=torch.float64, device=device)
    if held.world > 1:
        import torch.distributed as dist

        dist.all_reduce(v)
    v = v.cpu()
    correct, count, topk = v[7:7 + B], v[7 + B:7 + 2 * B], v[7 + 2 * B:tree_at].view(J, B)
    return {
        "loss": float(v[0] / v[1].clamp_min(1)),      # unweighted CE per labelled slot
        **slot_accuracies(correct, topk, count),
        "streak": float(v[2] / v[3].clamp_min(1)),   # every anchor: the random-anchor style estimate
        "tau_chain": float(v[5] / v[4].clamp_min(1)),
        **{f"tau_tree_{b}": float(v[tree_at + 2 * i + 1] / v[tree_at + 2 * i].clamp_min(1))
           for i, b in enumerate(budgets)},
        "samples": int(v[6]),
        "blocks": int(v[3]),
        "new_tokens": held.new_tokens,               # the taus' walk length per reply (0: whole replies)
    }


__all__ = ["HeldoutSet", "heldout_estimate"]
