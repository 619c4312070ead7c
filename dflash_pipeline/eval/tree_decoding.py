"""Tree speculative decoding (DDTree) of one prompt on the graphed target: `tree_generate`.

The chain (eval/speculative.py) verifies the drafter's top-1 token of every block slot. Here the same
single drafter pass gives each slot's top-K log-probabilities, `decoding.tree.build_trees` grows the
budget-N tree from them (best-first by summed log-probability), and the target verifies the anchor and
all N nodes in ONE forward (q = N + 1, a graph of its own per budget) whose RoPE positions are
start + depth and whose in-block mask lets each node see only its ancestors: every node sees exactly
the context it would have in plain decoding of its path. The target's choice at every slot (argmax at
T = 0, one draw from softmax(logits / T) at T > 0) is followed down the tree (`accept_paths`; why that is
exact at T > 0 is in decoding/tree.py), the accepted path and the target's next token are committed,
and the path's keys and values are moved to contiguous cache slots. Greedy, the output is plain greedy
decoding by induction, which `dflash eval` checks by the same lossless rule as the chain.

One round, all on the device until its single transfer: drafter step (a graph), top-K and tree
(`decoding.tree.TreeBuilder`, a graph per budget), verify step (a graph), the walk, the compaction of the path, the features of
the anchor and the path (the drafter's next context); then ONE transfer brings the accepted count, the
token after them, the tree's depth and the path's tokens to the host, as the chain's round does.
Rounds that may commit fewer tokens (the end of `max_new_tokens`) restrict the tree's depth by giving
the deeper slots log-probability -inf, so every round keeps the budget's static shape; a round that may
commit one token only is a plain decode step, as the chain's last round is.

Only the static-cache runner verifies trees: targets with linear-attention layers cannot follow a tree
(`decoding.tree.check_tree_target` refuses them in one line before anything loads) and the eager
transformers path is the fallback for those.

Legend: D drafted slots (B - 1), K tokens per slot, N budget (nodes), S = N + 1 verified slots, V
vocabulary, F concatenated target features.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dflash_pipeline.decoding.sampling import choose, next_token
from dflash_pipeline.decoding.tree import accept_paths
from dflash_pipeline.errors import DFlashError
from dflash_pipeline.eval.speculative import Drafter, Generation, Step, _clock, _until_stop, _untimed, prefill


def check_tree_participant(target) -> None:
    if not hasattr(target, "verify_tree"):
        raise DFlashError("tree verification (--tree-budget > 0) runs on the static-cache decoding path only; "
                          "this target decodes on the eager transformers path: use --tree-budget 0 (the chain)")


@torch.inference_mode()
def tree_generate(target, drafter: Drafter, prompt: Sequence[int], *, budget: int, max_new_tokens: int,
                  temperature: float, stop_ids: frozenset[int], generator: torch.Generator | None = None,
                  timer=None) -> Generation:
    """Tree speculative decoding of one prompt with a budget of N >= 1 nodes per round on a `GraphedTarget`;
    the output follows the target's own decoding rule. Step times: drafter, tree_build, target_verify (and
target_decode for a last round that can commit one token only)."""
    if budget < 1:
        raise ValueError(f"tree_generate needs a budget >= 1 (0 is the chain), got {budget}")
    check_tree_participant(target)
    timer = timer or _untimed
    D = drafter.block_size - 1
    cache, context, tokens, start = prefill(target, drafter, prompt, temperature, generator)
    steps: list[Step] = []
    t0 = _clock(target.device)
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
        depth = min(D, max_new_tokens - len(tokens) - 1)  # never commit past max_new_tokens
        anchor = torch.full((1,), tokens[-1], dtype=torch.long, device=target.device)
        if depth == 0:  # the final token: nothing to draft, one decode step (as the chain ends)
            with timer("target_decode"):
                logits, _ = target.forward(anchor, start, cache)
            tokens.append(next_token(logits[0], temperature, generator))
            steps.append(Step(0, 0, 1))
            break
        with timer("drafter"):
            draft_logits = drafter.draft(context, tokens[-1], start)
        with timer("tree_build"):
            trees, ids_S, offsets_S, mask_SS = target.tree_builder(budget, D, draft_logits.shape[-1])(
                draft_logits, anchor, depth)
        with timer("target_verify"):
            io = target.verify_tree(ids_S, offsets_S, mask_SS, start)
        choice_S = io.argmax_Rq[0] if temperature == 0 else choose(io.logits_RqV[0], temperature, generator)
        n, token, path = accept_paths(trees, choice_S[None], depth)
        target.compact_path(start, path[0])
        # Features of the anchor and the path's nodes (slot 0, then slot node + 1): the next context.
        feats = None
        if io.features_RqF is not None:
            feats = io.features_RqF[0].index_select(0, torch.cat([anchor.new_zeros(1), path[0].clamp_min(0) + 1]))
        on_path = trees.tokens_AN[0].gather(0, path[0].clamp_min(0))
        # The round's one synchronisation: accepted count, the token after them, the tree's depth, the path.
        n, token, drafted, *path_tokens = torch.cat([n, token, trees.depths_AN.amax(1), on_path]).tolist()
        committed = _until_stop([*path_tokens[:n], token], stop_ids)
        tokens += committed
        steps.append(Step(drafted, n, len(committed)))
        start += n + 1
        target.crop(cache, start)
        context = None if feats is None else feats[None, : n + 1]
    seconds = _clock(target.device) - t0
    return Generation(tokens, seconds, steps)


__all__ = ["tree_generate", "check_tree_participant"]
