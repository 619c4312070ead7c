"""DDTree: the budget-N tree, its verification mask, the exact acceptance walks and the held-out estimate.

- The builder's N nodes are the N best paths under the stated order (score, then depth, then rank path),
  checked by brute force over every path and by the best-first heap the method describes, ties and
  zero-probability tokens included; the chain is budget 0 (and K = 1).
- The walk is exact: greedy tree decoding of a tiny Llama verified with a 4D ancestor mask (eager,
  DynamicCache) equals plain greedy decoding token for token, and the compacted cache equals a cache that
  saw only the committed tokens (measured: a mask that lets a node see its siblings, consecutive instead of
  depth positions, or keeping the wrong cache slots each fail it); at T > 0 the walk's outcome
  distribution is enumerated exactly, and the whole loop's joint distribution of 4 tokens passes a
  chi-square test against the target's (a sibling-seeing mask fails that one too).
- The held-out estimate equals building each anchor's tree and walking it with the reference, and at
  budget 0 equals training's greedy-chain walk.
"""

from __future__ import annotations

import heapq
import inspect
import itertools
import math

import numpy as np
import pytest
import torch

from dflash_pipeline.decoding.tree import (
    Tree, TreeBuilder, accept_paths, build_tree, build_trees, check_tree_cache, check_tree_target, compact_cache, draft_tree,
    kept_slots, reference_depths, slot_topk, topk_for_budget, tree_attention_mask, tree_estimate, walk, walk_sequence,
)
from dflash_pipeline.decoding.sampling import choose
from dflash_pipeline.errors import DFlashError
from dflash_pipeline.eval.models import Target
from dflash_pipeline.eval.speculative import greedy_accept, target_generate
from test_eval import _chi_square, _joint_exact, tiny_llama


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models decode faster on one thread


# ---------------------------------------------------------------- references for the builder


def all_paths(lp_DK: torch.Tensor):
    """Every path of rank choices down to every depth, as (sort key, ranks), scores summed parent first."""
    D, K = lp_DK.shape
    lp = lp_DK.double()
    out = []
    for d in range(1, D + 1):
        for ranks in itertools.product(range(K), repeat=d):
            s = torch.tensor(0.0, dtype=torch.float64)
            for k, r in enumerate(ranks):
                s = s + lp[k, r]
            if float(s) > -math.inf:
                out.append(((-float(s), d, ranks), ranks))
    return sorted(out)


def brute_force_tree(lp_DK: torch.Tensor, N: int) -> list[tuple[int, ...]]:
    return [ranks for _, ranks in all_paths(lp_DK)[:N]]


def heap_tree(lp_DK: torch.Tensor, N: int) -> list[tuple[int, ...]]:
    """The best-first growth the method describes: pop the best, offer its next sibling and first child."""
    D, K = lp_DK.shape
    lp = lp_DK.double()
    zero = torch.tensor(0.0, dtype=torch.float64)

    def entry(parent_score, d, ranks):
        s = parent_score + lp[d - 1, ranks[-1]]
        return (-float(s), d, ranks, parent_score)

    heap = [entry(zero, 1, (0,))]
    out = []
    while heap and len(out) < N:
        neg, d, ranks, parent_score = heapq.heappop(heap)
        if neg == math.inf:
            break
        out.append(ranks)
        if ranks[-1] + 1 < K:  # its next sibling
            heapq.heappush(heap, entry(parent_score, d, ranks[:-1] + (ranks[-1] + 1,)))
        if d < D:  # its first child
            heapq.heappush(heap, entry(parent_score + lp[d - 1, ranks[-1]], d + 1, ranks + (0,)))
    return out


def tree_paths(tree: Tree) -> list[tuple[int, ...]]:
    """Each node's path of ranks, read back through its parents."""
    paths = []
    for i in range(tree.size):
        ranks, j = [], i
        while j >= 0:
            ranks.append(int(tree.ranks_N[j]))
            j = int(tree.parents_N[j])
        paths.append(tuple(reversed(ranks)))
    return paths


def random_slots(D, V, K, seed, scale=2.0, round_to=None):
    logits = torch.randn(D, V, generator=torch.Generator().manual_seed(seed)) * scale
    if round_to:  # coarse logits: many exact ties between scores
        logits = (logits / round_to).round() * round_to
    return slot_topk(logits, K)


# ---------------------------------------------------------------- the builder


@pytest.mark.parametrize("seed,round_to", [(0, None), (1, None), (2, 0.5), (3, 1.0)])
def test_tree_holds_the_n_best_paths_in_best_first_order(seed, round_to):
    D, V, K = 4, 7, 3
    lp, ids = random_slots(D, V, K, seed, round_to=round_to)
    total = sum(K ** d for d in range(1, D + 1))
    for N in list(range(1, 20)) + [37, 64, total, total + 5]:
        tree = build_tree(lp, ids, N)
        paths = tree_paths(tree)
        assert paths == brute_force_tree(lp, N) == heap_tree(lp, N), N
        # What a verifier relies on: parents precede children, depth = path length, tokens from their slots.
        assert all(int(p) < i for i, p in enumerate(tree.parents_N))
        assert [len(p) for p in paths] == tree.depths_N.tolist()
        assert [int(ids[len(p) - 1, p[-1]]) for p in paths] == tree.tokens_N.tolist()
        sums = [float(sum(lp[k, r].double() for k, r in enumerate(p))) for p in paths]
        assert np.allclose(sums, tree.scores_N.numpy(), rtol=0, atol=1e-12)
    if round_to:
        scores = tree.scores_N.tolist()
        assert len(set(scores)) < len(scores)  # ties were exercised


def test_zero_probability_tokens_are_never_nodes():
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(4))
    logits[1, 2:] = -math.inf  # slot 2 has two possible tokens only
    lp, ids = slot_topk(logits, 4)
    tree = build_tree(lp, ids, 200)
    assert tree.size == 4 + 4 * 2 + 4 * 2 * 4
    assert tree_paths(tree) == brute_force_tree(lp, 200) == heap_tree(lp, 200)
    assert bool(torch.isfinite(tree.scores_N).all())


def test_batched_trees_equal_one_at_a_time_and_topk_of_budget_is_the_full_distribution():
    A, D, V = 5, 5, 9
    logits = torch.randn(A, D, V, generator=torch.Generator().manual_seed(5)) * 1.5
    for N in (1, 3, 8, 30):
        full_lp, full_ids = slot_topk(logits, V)
        k_lp, k_ids = slot_topk(logits, topk_for_budget(N, V))
        trees = build_trees(k_lp, k_ids, N)
        for a in range(A):
            one = build_tree(full_lp[a], full_ids[a], N)
            t = trees.tree(a)
            for x, y in zip((t.tokens_N, t.parents_N, t.depths_N, t.ranks_N), (one.tokens_N, one.parents_N,
                                                                              one.depths_N, one.ranks_N)):
                assert torch.equal(x, y)


def test_the_chain_is_budget_zero_and_k_one():
    lp, ids = random_slots(6, 11, 4, 6)
    chain = build_tree(lp, ids, 0)
    assert chain.tokens_N.tolist() == ids[:, 0].tolist()
    assert chain.parents_N.tolist() == [-1, 0, 1, 2, 3, 4] and chain.depths_N.tolist() == [1, 2, 3, 4, 5, 6]
    k1 = build_tree(lp[:, :1], ids[:, :1], 6)
    assert torch.equal(k1.tokens_N, chain.tokens_N) and torch.equal(k1.parents_N, chain.parents_N)
    # Its mask is causal and its positions consecutive: chain verification is a special case.
    assert torch.equal(chain.ancestor_mask(), torch.ones(7, 7, dtype=torch.bool).tril())
    assert chain.positions(40).tolist() == list(range(40, 47))


def test_mask_and_positions():
    lp, ids = random_slots(4, 8, 3, 7)
    tree = build_tree(lp, ids, 12)
    anc = tree.ancestor_mask()
    for s in range(tree.size + 1):
        want = {0, s}
        j = s - 1
        while j >= 0:
            want.add(j + 1)
            j = int(tree.parents_N[j])
        assert set(anc[s].nonzero()[:, 0].tolist()) == want
    assert tree.positions(100).tolist() == [100] + (100 + tree.depths_N).tolist()
    assert tree.input_ids(77).tolist() == [77] + tree.tokens_N.tolist()
    m = tree_attention_mask(tree, past=5)
    assert m.shape == (1, 1, 13, 18) and bool((m[0, 0, :, :5] == 0).all())
    assert torch.equal(m[0, 0, :, 5:] == 0, anc)


# ---------------------------------------------------------------- the walks


def hand_tree() -> Tree:
    # anchor -> 5 (node 0) -> 7 (node 2) -> 9 (node 4)
    #        -> 6 (node 1) -> 8 (node 3)
    return Tree(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, -1, 0, 1, 2]), torch.tensor([1, 1, 2, 2, 3]),
                torch.tensor([0, 1, 0, 0, 0]), torch.zeros(5, dtype=torch.float64))


def test_greedy_walk_follows_the_targets_choice():
    tree = hand_tree()
    # choice per slot: anchor, node 0..4
    path, tok = walk(tree, torch.tensor([6, 0, 8, 0, 3, 0]))
    assert path.tolist() == [1, 3] and tok == 3           # second branch, then the bonus after its leaf
    path, tok = walk(tree, torch.tensor([5, 7, 0, 9, 0, 2]))
    assert path.tolist() == [0, 2, 4] and tok == 2        # the whole first branch
    path, tok = walk(tree, torch.tensor([5, 1, 0, 0, 0, 0]))
    assert path.tolist() == [0] and tok == 1              # correction after node 0
    path, tok = walk(tree, torch.tensor([4, 7, 8, 9, 0, 0]))
    assert path.tolist() == [] and tok == 4               # matches deeper down do not count
    # The chain: the same answer as the chain's acceptance rule.
    g = torch.Generator().manual_seed(0)
    lp, ids = random_slots(5, 4, 4, 8)
    chain = build_tree(lp, ids, 0)
    for _ in range(50):
        target = torch.randint(0, 4, (6,), generator=g)
        n, tok = greedy_accept(chain.tokens_N, target)
        path, tok2 = walk(chain, target)
        assert (len(path), tok2) == (n, tok) and path.tolist() == list(range(n))


def committed_distribution_exact(tree: Tree, p_SV: torch.Tensor) -> dict[tuple[int, ...], float]:
    """The walk's outcome distribution, enumerating every joint draw of the per-slot choices."""
    S, V = p_SV.shape
    out: dict[tuple[int, ...], float] = {}
    for x in itertools.product(range(V), repeat=S):
        pr = math.prod(float(p_SV[s, x[s]]) for s in range(S))
        path, tok = walk(tree, torch.tensor(x))
        key = tuple(tree.tokens_N[path].tolist()) + (tok,)
        out[key] = out.get(key, 0.0) + pr
    return out


def test_sampling_walk_is_the_targets_sampling_exactly():
    """Committed tokens c1..cm must have probability prod_i p_{node(c1..c_{i-1})}(c_i): the target sampling
    token by token from the node of the prefix so far, stopping where the prefix leaves the tree."""
    V = 3
    tree = Tree(torch.tensor([0, 1, 2, 0]), torch.tensor([-1, -1, 0, 2]), torch.tensor([1, 1, 2, 3]),
                torch.tensor([0, 1, 0, 0]), torch.zeros(4, dtype=torch.float64))
    p = torch.softmax(torch.randn(5, V, generator=torch.Generator().manual_seed(9)).double(), -1)
    children = {-1: {}}
    for i in range(tree.size):
        children.setdefault(int(tree.parents_N[i]), {})[int(tree.tokens_N[i])] = i
    want: dict[tuple[int, ...], float] = {}

    def grow(node: int, prefix: tuple[int, ...], pr: float):
        for t in range(V):
            child = children.get(node, {}).get(t)
            if child is None:
                want[prefix + (t,)] = want.get(prefix + (t,), 0.0) + pr * float(p[node + 1, t])
            else:
                grow(child, prefix + (t,), pr * float(p[node + 1, t]))

    grow(-1, (), 1.0)
    got = committed_distribution_exact(tree, p)
    assert set(got) == set(want)
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=1e-12), k
    assert sum(got.values()) == pytest.approx(1.0)


# ---------------------------------------------------------------- verification on a real (tiny) model


class SecondGuessDrafter:
    """Knows the target's greedy continuation; drafts it as the top-1 everywhere except slot 1, where the
    right token is only its second guess: the chain never gets past slot 1, a tree can."""

    def __init__(self, sequence: list[int], vocab: int, depth: int, seed: int = 0):
        self.sequence, self.vocab, self.depth = list(sequence), vocab, depth
        self.g = torch.Generator().manual_seed(seed)

    def __call__(self, anchor: int, start: int) -> torch.Tensor:
        logits = torch.randn(self.depth, self.vocab, generator=self.g)
        for k in range(self.depth):
            if start + 1 + k < len(self.sequence):
                right = self.sequence[start + 1 + k]
                logits[k, right] = 4.0 if k == 0 else 8.0
                if k == 0:
                    logits[0, (right + 1) % self.vocab] = 5.0
        return logits


class TableDraft:
    """Per-slot logits that depend only on the anchor: unrelated to the target."""

    def __init__(self, table_VDV: torch.Tensor):
        self.table = table_VDV

    def __call__(self, anchor: int, start: int) -> torch.Tensor:
        return self.table[anchor]


def _forward(model, ids, positions, cache, mask=None):
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=torch.as_tensor(ids)[None], position_ids=torch.as_tensor(positions)[None],
                attention_mask=mask, use_cache=True, **{kw: cache})
    return out.logits[0].float()


def tree_generate(model, draft, prompt, *, depth: int, budget: int, max_new_tokens: int, temperature: float = 0.0,
                  generator=None, check_cache: bool = False):
    """Tree speculative decoding through a DynamicCache: draft, build, verify with the ancestor mask, walk,
    commit, compact. Returns (tokens, accepted drafts per round)."""
    from transformers import DynamicCache

    V = model.config.vocab_size
    cache = DynamicCache(config=model.config)
    logits = _forward(model, prompt, list(range(len(prompt))), cache)
    tokens = [int(choose(logits[-1:], temperature, generator)[0])]
    start, accepted = len(prompt), []
    while len(tokens) < max_new_tokens:
        d = min(depth, max_new_tokens - len(tokens) - 1)  # never commit past max_new_tokens
        anchor = tokens[-1]
        lp, ids = slot_topk(draft(anchor, start)[:d], topk_for_budget(budget, V))
        tree = build_tree(lp, ids, budget)
        mask = tree_attention_mask(tree, start, dtype=torch.float32)
        logits = _forward(model, tree.input_ids(anchor), tree.positions(start), cache, mask)
        path, token = walk(tree, choose(logits, temperature, generator))
        compact_cache(cache, kept_slots(start, path))
        tokens += tree.tokens_N[path].tolist() + [token]
        start += len(path) + 1
        accepted.append(len(path))
        if check_cache:  # the compacted cache is the cache of the committed tokens, slot for slot
            fresh = DynamicCache(config=model.config)
            committed = list(prompt) + tokens[:-1]
            _forward(model, committed, list(range(len(committed))), fresh)
            assert cache.get_seq_length() == len(committed) == start
            for a, b in zip(cache.layers, fresh.layers):
                torch.testing.assert_close(a.keys, b.keys, atol=2e-5, rtol=1e-4)
                torch.testing.assert_close(a.values, b.values, atol=2e-5, rtol=1e-4)
    return tokens, accepted


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_greedy_tree_decoding_is_plain_greedy_decoding(attn):
    V, D, L = 32, 4, 40
    model = tiny_llama(vocab=V, seed=3, head_std=1.0)
    model.set_attn_implementation(attn)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    base = target_generate(Target(model), prompt, max_new_tokens=L, temperature=0.0, stop_ids=frozenset()).tokens
    oracle = SecondGuessDrafter(prompt + base, V, D)
    results = {}
    for budget in (0, 3, 16):
        toks, acc = tree_generate(model, oracle, prompt, depth=D, budget=budget, max_new_tokens=L,
                                  check_cache=budget == 16)
        assert toks == base, budget
        results[budget] = acc
    assert set(results[0]) == {0}                                   # the chain is stuck at slot 1
    assert np.mean(results[16][:-1]) == D                           # the tree finds the second guess
    random_draft = TableDraft(torch.randn(V, D, V, generator=torch.Generator().manual_seed(1)))
    toks, _ = tree_generate(model, random_draft, prompt, depth=D, budget=8, max_new_tokens=L, check_cache=True)
    assert toks == base


def test_tree_sampling_keeps_target_distribution():
    """At T > 0, the whole loop (tree, mask, walk, compaction) samples the target's own joint distribution of
    the first 4 tokens (chi-square, alpha 1e-3), with trees that branch and accept often."""
    V, D, L, T, runs = 6, 3, 4, 0.8, 1000
    model = tiny_llama(vocab=V, seed=0)
    model.set_attn_implementation("eager")
    prompt = [1, 2, 3, 4, 5]
    exact = _joint_exact(model, prompt, V, L, T)
    marginals = [exact.sum(dim=(2, 3)), exact.sum(dim=(1, 3)), exact.sum(dim=(1, 2))]
    cond = torch.stack([m / m.sum(1, keepdim=True) for m in marginals], dim=1)  # [anchor, slot, V]
    noise = torch.randn(V, D, V, generator=torch.Generator().manual_seed(7))
    draft = TableDraft((cond.log() * T).float() + noise)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros([V] * L, dtype=torch.long)
    hist = torch.zeros(D + 1, dtype=torch.long)
    for _ in range(runs):
        toks, acc = tree_generate(model, draft, prompt, depth=D, budget=5, max_new_tokens=L, temperature=T,
                                  generator=g)
        counts[tuple(toks)] += 1
        hist[acc[0]] += 1
    assert min(hist[:3]) > runs / 20  # rejection at the root, at depth 1, and acceptance at depth 2+, all common
    stat, critical = _chi_square(counts, exact)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: not the target's distribution"


def test_hybrid_and_sliding_targets_are_refused_in_one_line():
    from transformers import DynamicCache, Qwen3NextConfig

    cfg = Qwen3NextConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=64, vocab_size=32, layer_types=["full_attention", "linear_attention"])
    with pytest.raises(DFlashError) as e:
        check_tree_target(cfg)
    assert "qwen3_next layer 1 ('linear_attention') is linear attention" in str(e.value)
    assert "\n" not in str(e.value) and "tree budget 0" in str(e.value)
    with pytest.raises(DFlashError, match="layer 1 .* is linear attention"):
        compact_cache(DynamicCache(config=cfg), torch.arange(3))

    class OlderHybridCache:  # transformers before per-layer caches kept linear state on the cache itself
        conv_states = recurrent_states = [None, None]

    with pytest.raises(DFlashError, match=r"cache \(OlderHybridCache\) is linear attention"):
        check_tree_cache(OlderHybridCache())
    from transformers.cache_utils import DynamicSlidingWindowLayer

    llama = tiny_llama(vocab=8)
    check_tree_target(llama.config)  # full attention: fine
    cache = DynamicCache(config=llama.config)
    check_tree_cache(cache)
    cache.layers[0] = DynamicSlidingWindowLayer(sliding_window=4)
    with pytest.raises(DFlashError, match="layer 0 is a sliding-window layer"):
        check_tree_cache(cache)


# ---------------------------------------------------------------- the held-out estimate


def random_sequence(T, V, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (T,), generator=g)
    mask = torch.rand(T, generator=g) > 0.15
    cands = mask & torch.cat([mask[1:], torch.zeros(1, dtype=torch.bool)])
    cands[-1] = False
    return tokens, mask, cands


def drafter_logits(tokens, anchors, D, V, seed, skill=3.0):
    """Per-anchor slot logits that often rank the reference token high (as a trained drafter would)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(anchors), D, V, generator=g)
    T = len(tokens)
    for i, p in enumerate(anchors.tolist()):
        for k in range(D):
            if p + 1 + k < T:
                logits[i, k, tokens[p + 1 + k]] += skill * float(torch.rand(1, generator=g))
    return logits


def reference_of(tokens, mask, anchors, D):
    T = len(tokens)
    ref = torch.full((len(anchors), D), -1, dtype=torch.long)
    for i, p in enumerate(anchors.tolist()):
        for k in range(D):
            q = p + 1 + k
            if q >= T or not mask[q]:
                break  # labels stop at the first unsupervised position, as the block labels do
            ref[i, k] = tokens[q]
    return ref


def test_tree_estimate_equals_building_and_walking_each_tree():
    T, V, D = 120, 12, 5
    tokens, mask, cands = random_sequence(T, V, 10)
    anchors = cands.nonzero()[:, 0]
    logits = drafter_logits(tokens, anchors, D, V, 11)
    ref = reference_of(tokens, mask, anchors, D)
    budgets = [0, 1, 4, 16, 40]
    lp, ids = slot_topk(logits, topk_for_budget(max(budgets), V))
    est = tree_estimate(lp, ids, ref, anchors, cands, budgets)
    taus = {}
    for budget in budgets:
        accepted = np.full(T, -1)
        for i, p in enumerate(anchors.tolist()):
            tree = build_tree(lp[i], ids[i], budget)
            # The reference as the target's choice at every slot: the token after the node's position.
            choice = torch.cat([ref[i], torch.tensor([-1])])[torch.cat([torch.zeros(1, dtype=torch.long),
                                                                         tree.depths_N])]
            path, _ = walk(tree, choice)
            accepted[p] = len(path)
        assert est[budget] == walk_sequence(accepted, cands.numpy()), budget
        taus[budget] = est[budget][1] / est[budget][0]
    assert taus[0] < taus[4] < taus[16] <= taus[40]  # more budget, more accepted (this drafter)


def decode_each_reply(accepted, mask, max_new_tokens):
    """Rounds and committed tokens of decoding each supervised span as its own generation of at most
    max_new_tokens tokens (0: to its end), the naive way: the prefill writes the first token, each round
    takes accepted + 1 tokens, the last round only what the limit leaves."""
    rounds = committed = 0
    spans, start = [], None
    for q, m in enumerate(list(mask) + [False]):
        if m and start is None:
            start = q
        elif not m and start is not None:
            spans.append((start, q - 1))
            start = None
    for s, e in spans:
        limit = e - s + 1 if max_new_tokens == 0 else min(max_new_tokens, e - s + 1)
        generated, pos = 1, s
        while generated < limit:
            take = min(max(int(accepted[pos]), 0) + 1, limit - generated)
            rounds, committed, generated, pos = rounds + 1, committed + take, generated + take, pos + take
    return rounds, committed


@pytest.mark.parametrize("new_tokens", [0, 1, 2, 3, 8, 40])
def test_walk_with_a_token_limit_is_decoding_each_reply_to_that_limit(new_tokens):
    # the estimate's walk, cut at `--eval-new-tokens` N, commits what `dflash eval --max-new-tokens N` would
    T = 300
    tokens, mask, cands = random_sequence(T, 9, 21)
    g = np.random.default_rng(3)
    accepted = np.full(T, -1)
    for p in np.nonzero(cands.numpy())[0]:
        span_left = int(np.argmin(np.append(mask.numpy()[p + 1:], False)))  # supervised tokens after p
        accepted[p] = min(int(g.geometric(0.35)) - 1, span_left)
    got = walk_sequence(accepted, cands.numpy(), new_tokens)
    assert got == decode_each_reply(accepted, mask.numpy(), new_tokens)
    if new_tokens:
        whole = walk_sequence(accepted, cands.numpy())
        assert got[1] <= whole[1]  # never more tokens than the whole replies hold
    assert walk_sequence(accepted, cands.numpy(), T) == walk_sequence(accepted, cands.numpy())


def test_budget_zero_is_the_greedy_chain_estimate():
    T, V, D = 200, 20, 7
    tokens, mask, cands = random_sequence(T, V, 12)
    anchors = cands.nonzero()[:, 0]
    logits = drafter_logits(tokens, anchors, D, V, 13, skill=5.0)
    ref = reference_of(tokens, mask, anchors, D)
    # Training's run(p): correct slots in a row from slot 1, the argmax against the labels.
    hit = (logits.argmax(-1) == ref) & (ref >= 0)
    runs = np.full(T, -1)
    runs[anchors.numpy()] = hit.int().cumprod(-1).sum(-1).numpy()
    lp, ids = slot_topk(logits, 1)
    est = tree_estimate(lp, ids, ref, anchors, cands, [0])
    assert est[0] == walk_sequence(runs, cands.numpy())
    assert est[0][1] > 1.3 * est[0][0]  # the chain does accept drafts here
    assert torch.equal(reference_depths(lp, ids, ref, 0), torch.from_numpy(runs[anchors.numpy()]))


def test_estimate_chunks_anchors_without_changing_the_answer(monkeypatch):
    import dflash_pipeline.decoding.tree as tree_mod

    T, V, D = 80, 10, 4
    tokens, mask, cands = random_sequence(T, V, 14)
    anchors = cands.nonzero()[:, 0]
    lp, ids = slot_topk(drafter_logits(tokens, anchors, D, V, 15), 16)
    ref = reference_of(tokens, mask, anchors, D)
    whole = reference_depths(lp, ids, ref, 16)
    monkeypatch.setattr(tree_mod, "_CHUNK_ELEMENTS", 100)  # a few anchors per chunk
    assert torch.equal(reference_depths(lp, ids, ref, 16), whole)


# ---------------------------------------------------------------- batched, without host reads (eval's round)


def test_batched_verify_inputs_and_walks_equal_one_tree_at_a_time():
    """What eval's round builds on the device for a batch of trees (some with padding nodes: slots of -inf,
    as a depth-limited round has) equals each tree's own mask, ids and positions, and `accept_paths`
    equals `walk` tree by tree, for choices that often follow the tree."""
    A, D, V, N = 6, 4, 9, 12
    g = torch.Generator().manual_seed(20)
    lp, ids = slot_topk(torch.randn(A, D, V, generator=g) * 1.5, N)
    lp[1, 1:] = -math.inf   # depth 1 only: 9 nodes, 3 padding
    lp[2, :] = -math.inf    # nothing to draft: every node is padding
    lp[3, 2:, 2:] = -math.inf
    trees = build_trees(lp, ids, N)
    anchors = torch.randint(0, V, (A,), generator=g)
    ids_AS, offsets_AS, mask_ASS = trees.verify_inputs(anchors, D)
    assert ids_AS.shape == offsets_AS.shape == (A, N + 1) and mask_ASS.shape == (A, N + 1, N + 1)
    assert int(trees.num_nodes_A[1]) == V and int(trees.num_nodes_A[2]) == 0
    for a in range(A):
        tree, n = trees.tree(a), int(trees.num_nodes_A[a])
        assert torch.equal(mask_ASS[a, :n + 1, :n + 1], tree.ancestor_mask())
        assert ids_AS[a, :n + 1].tolist() == tree.input_ids(int(anchors[a])).tolist()
        assert offsets_AS[a, :n + 1].tolist() == tree.positions(0).tolist()
        for s in range(n + 1, N + 1):  # padding: token 0 at the anchor's position, sees the anchor and itself
            assert set(mask_ASS[a, s].nonzero()[:, 0].tolist()) == {0, s}
            assert (int(ids_AS[a, s]), int(offsets_AS[a, s])) == (0, 0)
        assert not mask_ASS[a, :n + 1, n + 1:].any()  # no real slot sees padding
    for trial in range(30):
        # Each slot's choice: a child's token (of the anchor or the node) with probability 0.7, else random.
        choice = torch.randint(0, V, (A, N + 1), generator=g)
        for a in range(A):
            for i in range(int(trees.num_nodes_A[a])):
                if float(torch.rand(1, generator=g)) < 0.7:
                    choice[a, int(trees.parents_AN[a, i]) + 1] = trees.tokens_AN[a, i]
        n_A, token_A, path_AD = accept_paths(trees, choice, D)
        for a in range(A):
            tree, n = trees.tree(a), int(trees.num_nodes_A[a])
            path, token = walk(tree, choice[a, :n + 1])
            assert int(n_A[a]) == len(path) and int(token_A[a]) == token, (trial, a)
            assert path_AD[a, :len(path)].tolist() == path.tolist()
            assert (path_AD[a, len(path):] == -1).all()


# ---------------------------------------------------------------- through training's held-out estimate


def test_heldout_tree_estimate_equals_eval_builder_on_the_drafters_own_logits(tmp_path):
    """tau_tree_N of `heldout_estimate` (top-K from the loss pass, anchors in chunks, trees batched) equals
    decoding each held-out sequence anchor by anchor with eval's pieces: the drafter's decoding step on
    the context before the anchor, full-vocabulary slot log-probs (slots without a label: no node, as the
    estimate defines it), `build_tree`, `walk` with the reference as the target's choice; budget 0 is
    `tau_chain_text` (both judged against the text: `text_tau_tree`; judged against the target, budget 0 is
    `tau_chain`)."""
    from dflash_pipeline.method import block_input_ids
    from dflash_pipeline.train.blocks import anchor_candidates
    from dflash_pipeline.train.heldout import HeldoutSet, heldout_estimate
    from dflash_pipeline.train.metrics import render_eval_line
    from helpers import random_heldout

    V, B = 100, 5
    budgets = (0, 4, 16, 150)  # 150 > V: K = V
    reader, cfg, model, frozen, held = random_heldout(str(tmp_path / "store"), vocab=V, block_size=B,
                                                      samples_per_segment=3, tree_budgets=budgets)
    res = heldout_estimate(model, held)

    N = 6  # --eval-new-tokens: the same walks, each reply cut at N tokens
    cut = heldout_estimate(model, HeldoutSet(**{**held.__dict__, "new_tokens": N}))
    sums, cut_sums, deepest = {b: [0, 0] for b in budgets}, {b: [0, 0] for b in budgets}, 0
    for row in range(reader.num_samples):
        s = reader.read_sample(row, layers=cfg.target_layer_ids)
        tokens, mask = torch.from_numpy(s.tokens_T.astype(np.int64)), torch.from_numpy(s.loss_mask_T)
        T, feats = len(tokens), s.hidden_TLH.reshape(1, len(tokens), -1)
        cands = anchor_candidates(mask, torch.zeros(T, dtype=torch.long))
        accepted = {b: np.full(T, -1) for b in budgets}
        for p in cands.nonzero()[:, 0].tolist():
            emb = frozen.embed_VH[block_input_ids(tokens[p:p + 1], B, cfg.mask_token_id)]
            with torch.no_grad():
                hidden = model.draft_step(feats[:, :p], torch.arange(p), emb, p + torch.arange(B), model.new_cache())
            lp, ids = slot_topk(hidden[0, 1:] @ frozen.head_VH.T, V)
            ref = torch.tensor([int(tokens[q]) if q < T and mask[q] else -1 for q in range(p + 1, p + B)])
            lp[ref < 0] = -math.inf
            for b in budgets:
                tree = build_tree(lp, ids, b)
                choice = torch.cat([ref, torch.tensor([-1])])[torch.cat([torch.zeros(1, dtype=torch.long),
                                                                         tree.depths_N])]
                accepted[b][p] = len(walk(tree, choice)[0])
        deepest = max(deepest, int(accepted[150].max()))
        for b in budgets:
            rounds, committed = walk_sequence(accepted[b], cands.numpy())
            sums[b][0] += rounds
            sums[b][1] += committed
            rounds, committed = decode_each_reply(accepted[b], mask.numpy(), N)
            cut_sums[b][0] += rounds
            cut_sums[b][1] += committed
    text, cut_text = res["text_tau_tree"], cut["text_tau_tree"]   # judged against the text, as the reference here
    for b in budgets:
        assert text[str(b)] == sums[b][1] / sums[b][0], b
        assert cut_text[str(b)] == cut_sums[b][1] / cut_sums[b][0], b
    assert cut["tau_chain_text"] == cut_text["0"] and cut["loss"] == res["loss"]
    assert render_eval_line({**cut, "step": 1}).endswith(f"samples, first {N} tokens of each reply)")
    assert render_eval_line({**res, "step": 1}).endswith(" samples)") and res["new_tokens"] == 0
    assert text["0"] == res["tau_chain_text"] and res["tau_tree_0"] == res["tau_chain"]   # each judge's chain
    assert text["0"] < text["16"] <= text["150"]
    assert deepest >= 2  # trees accepted more than one draft somewhere
    assert f"{res['tau_tree_16']:.2f} @ 16" in render_eval_line({**res, "step": 1})
    none = heldout_estimate(model, HeldoutSet(**{**held.__dict__, "tree_budgets": ()}))
    assert not any(k.startswith("tau_tree") for k in none) and none["tau_chain"] == res["tau_chain"]
    assert none["acc_per_pos"] == res["acc_per_pos"] and none["loss"] == res["loss"]


def test_eval_tree_budget_option():
    from typer.testing import CliRunner

    from dflash_pipeline.cli import app
    from dflash_pipeline.schemas.config import TrainConfig
    from dflash_pipeline.train import trainer

    assert TrainConfig(store="s", out="o").output.eval_tree_budget == [16, 64]
    with pytest.raises(ValueError, match="distinct budgets >= 0"):
        TrainConfig(store="s", out="o", eval_tree_budget=[16, 16])
    seen = []
    mp = pytest.MonkeyPatch()
    mp.setattr(trainer, "run_train", lambda cfg: seen.append(cfg))
    try:
        for arg, want in (("4,256", [4, 256]), ("none", []), ("0", [0])):
            res = CliRunner().invoke(app, ["train", "--store", "s", "--out", "o", "--eval-tree-budget", arg])
            assert res.exit_code == 0, res.output
            assert seen[-1].output.eval_tree_budget == want
        res = CliRunner().invoke(app, ["train", "--store", "s", "--out", "o", "--eval-tree-budget", "-1"])
        assert res.exit_code == 2 and "distinct budgets >= 0" in res.stderr and "\n" not in res.stderr.strip()
        assert seen[-1].output.eval_new_tokens == 0  # whole replies by default
        res = CliRunner().invoke(app, ["train", "--store", "s", "--out", "o", "--eval-new-tokens", "384"])
        assert res.exit_code == 0 and seen[-1].output.eval_new_tokens == 384, res.output
        res = CliRunner().invoke(app, ["train", "--store", "s", "--out", "o", "--eval-new-tokens", "-1"])
        assert res.exit_code == 2 and "--eval-new-tokens must be >= 0" in res.stderr and "\n" not in res.stderr.strip()
    finally:
        mp.undo()


def assert_same_round(got, logits_DV, anchor: int, depth: int, budget: int) -> None:
    """A round's (trees, ids, offsets, mask) equals the eager reference: the top-K of each slot, the slots
    past `depth` given log-probability -inf, built into a tree; its verify inputs."""
    trees, ids_S, offsets_S, mask_SS = got
    lp_DK, ids_DK = slot_topk(logits_DV, topk_for_budget(budget, logits_DV.shape[-1]))
    lp_DK[depth:] = -math.inf
    ref = build_trees(lp_DK[None], ids_DK[None], budget)
    for name in ("tokens_AN", "parents_AN", "depths_AN", "ranks_AN", "scores_AN", "num_nodes_A"):
        assert torch.equal(getattr(trees, name).cpu(), getattr(ref, name).cpu()), name
    want = ref.verify_inputs(torch.tensor([anchor]), max(depth, 1))
    for g, w in zip((ids_S, offsets_S, mask_SS), want):
        assert torch.equal(g.cpu(), w[0]), "verify inputs"


@pytest.mark.parametrize("budget", [1, 6, 16])
def test_tree_builder_round_equals_the_eager_tree_at_every_depth(budget):
    """Eval's per-round builder (one graph on CUDA, the same code here) gives, call after call with new
    logits, anchors and depth bounds, the tree of the first `depth` slots and its verify inputs; its outputs
    are refreshed by each call."""
    D, V = 5, 23
    g = torch.Generator().manual_seed(budget)
    builder = TreeBuilder(D, V, budget, torch.device("cpu"))
    for depth in [D, 3, D, 1, D]:
        logits = torch.randn(D, V, generator=g) * 2
        anchor = int(torch.randint(0, V, (1,), generator=g))
        got = builder(logits, torch.tensor([anchor]), depth)
        assert_same_round(got, logits, anchor, depth, budget)
        assert int(got[0].depths_AN.max()) <= depth
    assert torch.equal(draft_tree(logits, D, budget).tokens_AN, got[0].tokens_AN)
    with pytest.raises(ValueError, match="depth"):
        builder(logits, torch.tensor([0]), D + 1)
