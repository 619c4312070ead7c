"""DDTree: verify a tree of drafts instead of one chain, from the same single drafter pass.

A DFlash drafter gives, in one forward, a distribution for every block slot 1..D (D = B - 1). The chain
verifies only the top-1 token of each slot. DDTree (tree verification over the same drafter) verifies a
tree of N drafted tokens in ONE target forward and follows the target's own choice down the tree: when
the drafter's top-1 at some slot is wrong but its second guess is right, the round goes on.

The tree. The drafter's slots are treated as independent: a path of tokens (t_1..t_d) down to depth d
scores sum_k log q_k(t_k) (q_k the drafter's distribution at slot k). The budget-N tree is the N
highest-scoring paths (nodes), which is what growing best-first does: start with the top-1 token of
slot 1; pop the best node, add it, and offer its next sibling (same parent, the next token of its slot)
and its first child (the top-1 token of the next slot). Ties are broken by depth (shallower first), then
by the path of ranks compared lexicographically (higher-ranked tokens earlier first); with that order
each offered node ranks after the node that offers it, so the pops come out in exactly the sorted
order of all paths, and every node's parent and earlier siblings are in the tree before it. Paths of
probability zero (log-prob -inf) are never added, so a tree can hold fewer than N nodes.

`build_trees` computes the same N nodes without a heap, level by level and batched over anchors (the
held-out estimate needs thousands of trees per sequence; eval needs one): a depth-d node among the N best
of its depth has its parent among the N best of depth d - 1, and the child of rank r of the parent that
ranks j-th in its level is preceded within its level by at least (j + 1)(r + 1) - 1 nodes (every
(j' <= j, r' <= r) pair scores at least as high and comes first on a tie), so only pairs with
(j + 1)(r + 1) <= N are candidates: about N ln N per level. A stable sort by the tie-break key, then a
stable sort by score, realise the order exactly. Scores are summed in float64, parent first, as the
brute-force test sums them. A budget-N tree never uses a token of rank >= N in its slot, so the
drafter's per-slot top-K with K = min(N, V) gives the tree of the full distribution, and one top-K with
K = the largest budget serves every budget. Budget 0 is the chain: the top-1 token of every slot.

Verification. The target reads [anchor, node tokens in tree order] (S = N + 1 positions; slot 0 is the
anchor, slot i + 1 is node i) after its cache of `start` committed tokens. Slot s sees the cache and its
own ancestors (the anchor included) and itself only (`Tree.ancestor_mask`), at position start + depth
(`Tree.positions`): every node sees exactly the context it would have in plain decoding of its path.

Acceptance (`walk`). The target's choice is taken once at every slot (`decoding.sampling.choose`): its
argmax at T = 0, one token drawn from softmax(logits / T) at T > 0. From the anchor, descend to the
child whose token equals the choice at the current slot while there is one; commit the path's tokens and
the choice at the last slot reached (the correction where the path leaves the tree, the bonus at a
leaf). Greedy, this is plain greedy decoding by induction. At T > 0 it keeps the target's distribution
exactly: the first committed token is the choice at the anchor, a draw from p(. | context); each later
one is the draw at the node of the prefix committed so far, i.e. from p(. | context, prefix); the draws
are independent and each is used at most once, so the committed sequence is distributed as the target's
own sampling, token by token, whatever the tree. For a tree fixed before verification (top-K, not
sampled) no exact rule can do better: any exact rule commits a token distributed as p at the node, and
it can only go on when that token is a child, so P(descend at u) <= p_u(children of u), which this rule
reaches.

Reference walk (the held-out estimate): with the reference continuation as the choice at every depth,
the accepted depth at anchor p is how much of the reference the tree holds; walking p <- p + depth + 1
along a held-out sequence reproduces greedy tree decoding of that sequence (`walk_sequence`).

Legend: A anchors (independent trees), D depth (drafted slots, B - 1), K tokens per slot, N budget
(nodes), S = N + 1 verified positions (anchor + nodes), M candidate (parent, rank) pairs, V vocabulary,
T sequence length, P positions already in the target's cache (`start`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from dflash_pipeline.decoding.graphs import GraphedStep
from dflash_pipeline.errors import DFlashError

# ---------------------------------------------------------------- the tree


@dataclass
class Tree:
    """One draft tree; node i (0-based, best-first order) is verified at slot i + 1, the anchor at slot 0."""

    tokens_N: torch.Tensor   # int64 token of each node
    parents_N: torch.Tensor  # int64 parent node (-1: the anchor); always < the node's own index
    depths_N: torch.Tensor   # int64 1..D: the block slot the token was drafted for
    ranks_N: torch.Tensor    # int64 rank of the token among its slot's top-K (0: the drafter's argmax)
    scores_N: torch.Tensor   # float64 summed log-probability of the path down to the node

    @property
    def size(self) -> int:
        return int(self.tokens_N.shape[0])

    def input_ids(self, anchor: int) -> torch.Tensor:
        """[S] the tokens the target verifies: the anchor, then the nodes in tree order."""
        return torch.cat([self.tokens_N.new_tensor([anchor]), self.tokens_N])

    def positions(self, start: int) -> torch.Tensor:
        """[S] position of each verified slot: start + depth (the anchor sits at `start`)."""
        return start + torch.cat([self.depths_N.new_zeros(1), self.depths_N])

    def ancestor_mask(self) -> torch.Tensor:
        """Bool [S, S]: slot s may attend to slot t iff t is s itself or one of its ancestors."""
        return _ancestor_mask(self.parents_N[None], int(self.depths_N.max()) if self.size else 0)[0]


@dataclass
class Trees:
    """A batch of trees, one per anchor, padded to the budget: node i of tree a is valid iff i < num_nodes_A[a]."""

    tokens_AN: torch.Tensor   # -1 where invalid
    parents_AN: torch.Tensor  # -1 for the anchor's children and where invalid
    depths_AN: torch.Tensor   # 0 where invalid
    ranks_AN: torch.Tensor
    scores_AN: torch.Tensor   # float64, -inf where invalid
    num_nodes_A: torch.Tensor

    def tree(self, a: int) -> Tree:
        n = int(self.num_nodes_A[a])
        return Tree(self.tokens_AN[a, :n], self.parents_AN[a, :n], self.depths_AN[a, :n], self.ranks_AN[a, :n],
                    self.scores_AN[a, :n])

    def accepted(self, match_AN: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        """Bool [A, N]: the node and all its ancestors match (match_AN: the node's token is the choice at its
        parent). Each round of 'and my parent' reaches one level further up: max depth - 1 rounds settle all.
        `depth`: a bound on the trees' depth known on the host (no device read)."""
        ok = match_AN & (self.depths_AN > 0)
        has_parent = self.parents_AN >= 0
        parent = self.parents_AN.clamp_min(0)
        if depth is None:
            depth = int(self.depths_AN.max()) if ok.numel() else 0
        for _ in range(max(depth - 1, 0) if ok.numel() else 0):
            ok = ok & (~has_parent | ok.gather(1, parent))
        return ok

    def verify_inputs(self, anchor_A: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token ids [A, S], position offsets [A, S], ancestor mask [A, S, S]) of the verify step: slot 0
        the anchor at offset 0, slot i + 1 node i at offset = its depth, seeing itself and its ancestors.
        Padding nodes (i >= num_nodes) read token 0 at offset 0 and see the anchor and themselves: their
        logits are never read (their token, -1, matches no choice). `depth` bounds the trees' depth (no
        device read: a decoding round stays free of host synchronisation)."""
        ids_AS = torch.cat([anchor_A[:, None], self.tokens_AN.clamp_min(0)], dim=1)
        offsets_AS = torch.cat([self.depths_AN.new_zeros(len(anchor_A), 1), self.depths_AN], dim=1)
        return ids_AS, offsets_AS, _ancestor_mask(self.parents_AN, depth)

    def reference_depth(self, reference_AD: torch.Tensor) -> torch.Tensor:
        """[A] how deep each tree holds the reference continuation (reference_AD[a, k]: the token for
        slot k + 1, negative where there is none): the accepted drafts of a round whose target choices
        are the reference."""
        valid = self.depths_AN > 0
        ref_AN = reference_AD.gather(1, (self.depths_AN - 1).clamp_min(0))
        match = valid & (ref_AN >= 0) & (self.tokens_AN == ref_AN)
        if match.shape[1] == 0:
            return torch.zeros(match.shape[0], dtype=torch.long, device=match.device)
        # Siblings hold distinct tokens, so the accepted nodes form one path: its length is the deepest.
        return torch.where(self.accepted(match), self.depths_AN, 0).amax(-1)


def _ancestor_mask(parents_AN: torch.Tensor, depth: int) -> torch.Tensor:
    """Bool [A, S, S] (S = N + 1): slot s sees slot t iff t is s or one of its ancestors, the anchor (slot 0)
    included; a node without a parent (-1: depth 1, or padding) hangs off the anchor. depth + 1 rounds of
    'mark, then step to the parent' reach the anchor from depth `depth`."""
    A, N = parents_AN.shape
    S = N + 1
    parent_AS = torch.cat([parents_AN.new_zeros(A, 1), parents_AN.clamp_min(-1) + 1], dim=1)  # the anchor: itself
    mask = torch.zeros(A, S, S, dtype=torch.bool, device=parents_AN.device)
    cur = torch.arange(S, device=parents_AN.device).expand(A, S).contiguous()
    for _ in range(depth + 1):
        mask.scatter_(2, cur[..., None], True)
        cur = parent_AS.gather(1, cur)
    return mask


def slot_topk(logits_xV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities, token ids) [..., min(k, V)] of each slot's top-k, best first, log-softmax in fp32."""
    top = torch.log_softmax(logits_xV.float(), dim=-1).topk(min(k, logits_xV.shape[-1]), dim=-1, sorted=True)
    return top.values, top.indices


def topk_for_budget(budget: int, vocab: int) -> int:
    """Tokens per slot that make the budget's tree equal to the tree of the full distribution."""
    return min(max(budget, 1), vocab)


@functools.lru_cache(maxsize=64)
def _candidate_pairs(N: int, K: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent level rank j, child rank r) with (j + 1)(r + 1) <= N and r < K, in (j, r) order. Cached per
    device, so that building a tree copies nothing from the host (it can be captured in a CUDA graph)."""
    counts = torch.tensor([min(K, N // (j + 1)) for j in range(N)])
    j = torch.arange(N).repeat_interleave(counts)
    r = torch.arange(len(j)) - (counts.cumsum(0) - counts).repeat_interleave(counts)
    return j.to(device), r.to(device)


def _best_first(score_AM: torch.Tensor, tiebreak_AM: torch.Tensor) -> torch.Tensor:
    """Indices [A, M] ordering each row by score, high first, ties by the tie-break key, low first."""
    by_key = torch.sort(tiebreak_AM, dim=1, stable=True).indices
    by_score = torch.sort(score_AM.gather(1, by_key), dim=1, descending=True, stable=True).indices
    return by_key.gather(1, by_score)


def _path_rank(key_AN: torch.Tensor, valid_AN: torch.Tensor) -> torch.Tensor:
    """Rank of each kept node's path among the valid kept nodes of its level (path-lexicographic order)."""
    key = torch.where(valid_AN, key_AN, torch.iinfo(torch.long).max)
    return torch.argsort(torch.argsort(key, dim=1, stable=True), dim=1)


def build_trees(logprobs_ADK: torch.Tensor, ids_ADK: torch.Tensor, budget: int) -> Trees:
    """The budget-N tree of every anchor from its slots' top-K (log-probs sorted best first per slot);
    budget 0 builds the chain. Nodes in best-first order (see the module docstring for the order).
    No host synchronisation: with fixed shapes and budget it can be captured in a CUDA graph."""
    if budget < 0:
        raise ValueError(f"tree budget must be >= 0, got {budget}")
    A, D, K = logprobs_ADK.shape
    if budget == 0:  # the chain: top-1 of every slot, all D of them
        logprobs_ADK, ids_ADK, budget, K = logprobs_ADK[..., :1], ids_ADK[..., :1], D, min(K, 1)
    N, dev = budget, logprobs_ADK.device
    Kc = min(K, N)
    if D == 0 or Kc == 0 or A == 0:
        empty = torch.zeros(A, 0, dtype=torch.long, device=dev)
        return Trees(empty, empty, empty, empty, empty.double(), torch.zeros(A, dtype=torch.long, device=dev))
    lp = logprobs_ADK[..., :Kc].double()
    ids = ids_ADK[..., :Kc].long()
    cols = torch.arange(N, device=dev)

    # Depth 1: the anchor's children, in rank order; each level keeps its N best, best first.
    score = torch.full((A, N), -math.inf, dtype=torch.float64, device=dev)
    score[:, :Kc] = lp[:, 0]
    rank = cols.clamp_max(Kc - 1).expand(A, N)
    valid = score > -math.inf
    levels = [(score, rank, torch.full((A, N), -1, dtype=torch.long, device=dev), _path_rank(rank, valid))]
    pj, pr = _candidate_pairs(N, Kc, dev)
    for d in range(1, D):
        score_p, _, _, path_p = levels[-1]
        cand = score_p[:, pj] + lp[:, d, pr]                    # [A, M]; -inf under an invalid parent
        key = path_p[:, pj] * Kc + pr                           # path-lexicographic order of the candidates
        keep = _best_first(cand, key)[:, :N]
        score = cand.gather(1, keep)
        valid = score > -math.inf
        levels.append((score, pr[keep], pj[keep], _path_rank(key.gather(1, keep), valid)))

    # All levels together: score first, then depth, then path order within the depth.
    score_L = torch.cat([lv[0] for lv in levels], dim=1)        # [A, D*N], level d at d*N
    depth_L = torch.arange(1, D + 1, device=dev).repeat_interleave(N)
    key_L = torch.cat([lv[3] for lv in levels], dim=1) + (depth_L - 1)[None] * N
    order = _best_first(score_L, key_L)[:, :N]                 # flat level index of final node i
    scores = score_L.gather(1, order)
    valid = scores > -math.inf
    final_of = torch.full((A, D * N), -1, dtype=torch.long, device=dev)
    final_of.scatter_(1, order, cols.expand(A, N).contiguous())
    level_parent = torch.cat([lv[2] for lv in levels], dim=1).gather(1, order)
    depth = depth_L[order]
    parent_flat = ((depth - 2) * N + level_parent).clamp_min(0)
    parents = torch.where(depth > 1, final_of.gather(1, parent_flat), -1)
    ranks = torch.cat([lv[1] for lv in levels], dim=1).gather(1, order)
    tokens = _tokens_at(ids, depth, ranks)
    return Trees(torch.where(valid, tokens, -1), torch.where(valid, parents, -1), torch.where(valid, depth, 0),
                 torch.where(valid, ranks, 0), scores, valid.sum(1))


def draft_tree(logits_DV: torch.Tensor, depth: int | torch.Tensor, budget: int) -> Trees:
    """The budget-N tree (one anchor) of a drafter pass's slot logits, no deeper than `depth` slots (an int,
    or a 0-dim tensor read on the device): deeper slots hold no node, as a round near `max_new_tokens` needs."""
    lp_DK, ids_DK = slot_topk(logits_DV, topk_for_budget(budget, logits_DV.shape[-1]))
    slot_D1 = torch.arange(lp_DK.shape[0], device=lp_DK.device)[:, None]
    lp_DK = lp_DK.masked_fill(slot_D1 >= depth, -math.inf)
    return build_trees(lp_DK[None], ids_DK[None], budget)


class TreeBuilder:
    """One decoding round's tree and its verify inputs from the drafter's slot logits: `draft_tree`, then
    `Trees.verify_inputs`, as ONE graph launch on CUDA. Eagerly that is some 400 small launches (the
    level-by-level sorts and gathers of `build_trees`, the ancestor mask): 7.3-7.5 ms a round on an H200
    whatever the budget, twice the target's verify step. The logits are copied into a static buffer, the
    anchor and the depth bound are device scalars, so one graph per budget serves every round (a round near
    the end of `max_new_tokens` masks the deeper slots instead of changing shape). The outputs are the
    captured run's tensors (the graph's private pool): valid until the next call."""

    def __init__(self, depth: int, vocab: int, budget: int, device: torch.device, graphs: bool | None = None):
        self.budget, self.D = budget, depth
        self.logits_DV = torch.zeros(depth, vocab, dtype=torch.float32, device=device)
        self.anchor_1 = torch.zeros(1, dtype=torch.long, device=device)
        self.depth = torch.zeros((), dtype=torch.long, device=device)
        self.out: tuple[Trees, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._step = GraphedStep(self._build, device, None, device.type == "cuda" if graphs is None else graphs)

    def _build(self) -> None:
        trees = draft_tree(self.logits_DV, self.depth, self.budget)
        ids_AS, offsets_AS, mask_ASS = trees.verify_inputs(self.anchor_1, self.D)
        self.out = (trees, ids_AS[0], offsets_AS[0], mask_ASS[0])

    def __call__(self, logits_DV: torch.Tensor, anchor_1: torch.Tensor, depth: int):
        """(trees, verify ids [S], position offsets [S], ancestor mask [S, S]) of this round."""
        if not 0 <= depth <= self.D or logits_DV.shape != self.logits_DV.shape:
            raise ValueError(f"tree builder for {tuple(self.logits_DV.shape)} logits and depth <= {self.D}, "
                             f"got {tuple(logits_DV.shape)} and depth {depth}")
        self.logits_DV.copy_(logits_DV)
        self.anchor_1.copy_(anchor_1)
        self.depth.fill_(depth)
        self._step()
        assert self.out is not None
        return self.out


def _tokens_at(ids_ADK: torch.Tensor, depth_AN: torch.Tensor, rank_AN: torch.Tensor) -> torch.Tensor:
    A, D, K = ids_ADK.shape
    return ids_ADK.reshape(A, D * K).gather(1, (depth_AN - 1) * K + rank_AN)


def build_tree(logprobs_DK: torch.Tensor, ids_DK: torch.Tensor, budget: int) -> Tree:
    """One anchor's tree (see `build_trees`)."""
    return build_trees(logprobs_DK[None], ids_DK[None], budget).tree(0)


# ---------------------------------------------------------------- acceptance


def accept_paths(trees: Trees, choice_AS: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(accepted drafts n [A], token to commit after them [A], path [A, depth]: the accepted node at depth
    1..n, -1 beyond) of following the target's choice (choice_AS: one per verified slot) down each tree.
    The commit is the choice at the last slot reached: the correction where the path leaves the tree, the
    bonus at a leaf. `depth` bounds the trees' depth; nothing is read back to the host."""
    A, N = trees.tokens_AN.shape
    dev = choice_AS.device
    path = torch.full((A, depth + 1), -1, dtype=torch.long, device=dev)  # the last column takes the rest
    if N == 0:
        return torch.zeros(A, dtype=torch.long, device=dev), choice_AS[:, 0], path[:, :depth]
    match = trees.tokens_AN == choice_AS.gather(1, trees.parents_AN.clamp_min(-1) + 1)
    ok = trees.accepted(match, depth)
    n = torch.where(ok, trees.depths_AN, 0).amax(1)
    # Siblings hold distinct tokens, so the accepted nodes form one path: one node per depth.
    col = torch.where(ok, trees.depths_AN - 1, depth).clamp_max(depth)
    path.scatter_(1, col, torch.arange(N, device=dev).expand(A, N).contiguous())
    path = path[:, :depth]
    last_slot = torch.where(n > 0, path.gather(1, (n - 1).clamp_min(0)[:, None])[:, 0] + 1, 0)
    return n, choice_AS.gather(1, last_slot[:, None])[:, 0], path


def walk(tree: Tree, choice_S: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(accepted nodes [n] from the anchor down, token to commit after them) of one tree (`accept_paths`)."""
    trees = Trees(tree.tokens_N[None], tree.parents_N[None], tree.depths_N[None], tree.ranks_N[None],
                  tree.scores_N[None], torch.tensor([tree.size]))
    n, token, path = accept_paths(trees, choice_S[None], int(tree.depths_N.max()) if tree.size else 0)
    return path[0, :int(n[0])], int(token[0])


# ---------------------------------------------------------------- along a held-out sequence


def walk_sequence(accepted_T: np.ndarray, candidates_T: np.ndarray, new_tokens: int = 0) -> tuple[int, int]:
    """(rounds, tokens committed) of decoding along one reference sequence: accepted_T[p] drafts are
    accepted from anchor p, so a round commits accepted + 1 tokens and the next anchor is p + accepted + 1.

    A position that cannot be an anchor (the end of an assistant turn) ends a generation; the walk resumes
    at the next candidate, as a new generation would (the same walk as training's greedy-chain estimate).
    A generation runs over a run of candidates s..e-1: s is its first reply token, which the target's
    prefill writes, e its last (the end of turn, or where the reply was cut), after which it commits
    nothing, however many drafts were right (the reply has ended). `new_tokens` N > 0 ends each
    generation after N tokens, as decoding with `max_new_tokens` N does: anchors only up to its (N-1)-th
    token and the last round commits only what is left, so a generation of N tokens commits N - 1
    (eval's tau is (tokens - 1) / rounds too).
    """
    T = len(accepted_T)
    cands = np.array(candidates_T, dtype=bool)  # a copy: the limit clears candidates in it
    end = np.zeros(T, dtype=np.int64)  # per candidate: where its generation's last token is
    p = 0
    while p < T:
        if not cands[p]:
            p += 1
            continue
        e = p
        while e < T and cands[e]:
            e += 1  # the run p..e-1; its last token is at e
        last = e if new_tokens <= 0 else min(e, p + new_tokens - 1)
        end[p:e] = last
        cands[p:e] &= np.arange(p, e) < last
        p = e
    next_cand = np.full(T + 1, T, dtype=np.int64)
    for p in range(T - 1, -1, -1):
        next_cand[p] = p if cands[p] else next_cand[p + 1]
    rounds = committed = 0
    p = next_cand[0]
    while p < T:
        n = min(max(int(accepted_T[p]), 0) + 1, int(end[p]) - p)
        rounds += 1
        committed += n
        p = next_cand[min(p + n, T)]
    return rounds, committed


# Elements of one level's candidate scores per chunk of anchors (float64: 32 MB).
_CHUNK_ELEMENTS = 1 << 22


def reference_depths(logprobs_ADK: torch.Tensor, ids_ADK: torch.Tensor, reference_AD: torch.Tensor,
                     budget: int) -> torch.Tensor:
    """[A] accepted drafts at each anchor for one budget, trees built in chunks of anchors."""
    A, D, K = logprobs_ADK.shape
    N, Kc = (budget, min(K, budget)) if budget else (D, 1)
    M = len(_candidate_pairs(N, Kc, torch.device("cpu"))[0]) if N and Kc else 1
    step = max(1, _CHUNK_ELEMENTS // max(M, 1))
    out = [build_trees(logprobs_ADK[a:a + step], ids_ADK[a:a + step], budget).reference_depth(reference_AD[a:a + step])
           for a in range(0, A, step)]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=logprobs_ADK.device)


def tree_estimate(logprobs_ADK: torch.Tensor, ids_ADK: torch.Tensor, reference_AD: torch.Tensor,
                  anchors_A: torch.Tensor, candidates_T: torch.Tensor, budgets: Sequence[int],
                  new_tokens: int = 0, depths: dict[int, torch.Tensor] | None = None) -> dict[int, tuple[int, int]]:
    """{budget: (rounds, tokens committed)} of tree decoding along one held-out sequence.

    logprobs_ADK / ids_ADK: the drafter's top-K of slots 1..D at each anchor (best first; K >= the largest
    budget for the exact tree; -inf log-probs for slots that have no logits); reference_AD: the sequence's
    tokens at anchor + 1 .. anchor + D, negative where not supervised; anchors_A: their positions;
    candidates_T: bool, positions that can be anchors. Budget 0 is the chain (training's `tau_chain`).
    Sum rounds and tokens over sequences (and ranks); tau = tokens / rounds. new_tokens: as `walk_sequence`.
    `depths`: if given, filled with each budget's accepted drafts per anchor ([A], on the device).
    """
    T = int(candidates_T.shape[0])
    cands = candidates_T.cpu().numpy().astype(bool)
    at = anchors_A.cpu().numpy()
    out = {}
    for budget in budgets:
        depth = reference_depths(logprobs_ADK, ids_ADK, reference_AD, int(budget))
        if depths is not None:
            depths[int(budget)] = depth
        accepted = np.full(T, -1, dtype=np.int64)
        accepted[at] = depth.cpu().numpy()
        out[int(budget)] = walk_sequence(accepted, cands, new_tokens)
    return out


# ---------------------------------------------------------------- verification through a Hugging Face cache
# The production path is the static-cache runner; this one runs any transformers model with a
# DynamicCache (eager or SDPA attention), for tests and as the reference the runner must match.


def tree_attention_mask(tree: Tree, past: int, dtype: torch.dtype = torch.float32,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """Additive 4D mask [1, 1, S, P + S]: every verified slot sees the P cached tokens and its own
    ancestors (transformers uses a 4D mask as given, for eager and SDPA attention alike)."""
    anc = tree.ancestor_mask()
    device = device or anc.device
    S = anc.shape[0]
    visible = torch.cat([torch.ones(S, past, dtype=torch.bool, device=anc.device), anc], dim=1).to(device)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def kept_slots(start: int, path: torch.Tensor) -> torch.Tensor:
    """Cache slots to keep after a round verified at `start`: the committed past, the anchor and the
    accepted nodes, in path order (the committed token after them is the next round's anchor)."""
    return torch.cat([torch.arange(start + 1, device=path.device), start + 1 + path])


_LINEAR_STATES = ("conv_states", "recurrent_states", "ssm_states")


def _refuse_linear(where: str) -> None:
    raise DFlashError(f"tree verification needs a target whose every layer keeps keys and values per token; "
                      f"{where} is linear attention, whose single recurrent state cannot follow a tree: use "
                      f"tree budget 0 (the chain)")


def check_tree_target(config) -> None:
    """Refuse, in one line, a target config with layers that keep no per-token keys and values (hybrid
    linear-attention models), before any decoding starts."""
    from dflash_pipeline.extract.target import text_config

    cfg = text_config(config)
    for i, kind in enumerate(getattr(cfg, "layer_types", None) or []):
        if kind not in ("full_attention", "sliding_attention"):
            _refuse_linear(f"{getattr(cfg, 'model_type', 'the target')} layer {i} ('{kind}')")


def check_tree_cache(cache) -> None:
    """Refuse, in one line, caches that cannot be compacted to a tree path here: linear-attention state
    (per layer, or per cache in older transformers' hybrid caches), sliding-window layers, or a cache
    without per-layer keys and values."""
    if any(hasattr(cache, name) for name in _LINEAR_STATES):
        _refuse_linear(f"the target's cache ({type(cache).__name__})")
    if not hasattr(cache, "layers"):
        raise DFlashError(f"tree verification through a transformers cache needs a DynamicCache with per-layer "
                          f"keys and values, not {type(cache).__name__}")
    for i, layer in enumerate(cache.layers):
        if any(hasattr(layer, name) for name in _LINEAR_STATES):
            _refuse_linear(f"layer {i} ({type(layer).__name__})")
        if getattr(layer, "is_sliding", False):
            raise DFlashError(f"tree verification through a transformers cache supports full-attention layers "
                              f"only; layer {i} is a sliding-window layer ({type(layer).__name__}): use tree "
                              f"budget 0 (the chain)")


def compact_cache(cache, keep: torch.Tensor) -> None:
    """Keep only the cache slots `keep` (ascending; see `kept_slots`), in every layer of a DynamicCache."""
    check_tree_cache(cache)
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        idx = keep.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, idx)
        layer.values = layer.values.index_select(-2, idx)


__all__ = [
    "Tree", "Trees", "slot_topk", "topk_for_budget", "build_trees", "build_tree", "draft_tree", "TreeBuilder",
    "accept_paths", "walk",
    "walk_sequence", "reference_depths", "tree_estimate", "tree_attention_mask", "kept_slots", "check_tree_target",
    "check_tree_cache", "compact_cache",
]
