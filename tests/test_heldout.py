"""The held-out estimate judged against the target's own top-1 (`tau_chain`), against a naive reference that
drafts every anchor with the drafter's decoding step and judges slot by slot in plain Python."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dflash_pipeline.decoding.tree import build_tree, slot_topk, walk, walk_sequence
from dflash_pipeline.method import block_input_ids
from dflash_pipeline.store.reader import StoreReader
from dflash_pipeline.train.blocks import anchor_candidates
from dflash_pipeline.train.from_store import frozen_tensors
from dflash_pipeline.train.heldout import HeldoutSet, heldout_estimate
from dflash_pipeline.train.model import DFlashDrafter, DrafterConfig
from helpers import random_heldout, write_random_store

V, B = 4, 5   # a vocabulary of 4: a random drafter matches often enough for runs of several slots


def _setup(tmp_path, top1_is_text: float):
    return random_heldout(str(tmp_path / "store"), vocab=V, block_size=B, samples_per_segment=4,
                          top1_is_text=top1_is_text, min_len=40, max_len=90)


def _naive(reader, cfg, model, frozen, new_tokens: int = 0, budget: int = 0):
    """tau judged against the stored top-1: exact runs, censored where the text leaves the target's choice,
    extended by the pooled per-slot acceptance rates; and the share of supervised tokens that are the top-1.
    Budget 0: the chain (the drafter's argmax at each slot); N: the tree `dflash eval --tree-budget N` builds
    from the drafter's slot distributions, a slot accepted while the tree holds the target's path to it."""
    m = B - 1
    seqs, at_risk, rejected, agree, supervised = [], np.zeros(m), np.zeros(m), 0, 0
    for row in range(reader.num_samples):
        s = reader.read_sample(row, layers=cfg.target_layer_ids)
        tokens, mask = torch.from_numpy(s.tokens_T.astype(np.int64)), s.loss_mask_T.astype(bool)
        top1 = s.topk_ids_TK[:, 0].astype(np.int64)
        T, feats = len(tokens), s.hidden_TLH.reshape(1, len(tokens), -1)
        agree += sum(1 for q in range(1, T) if mask[q] and tokens[q] == top1[q - 1])
        supervised += int(mask[1:].sum())
        cands = anchor_candidates(torch.from_numpy(mask), torch.zeros(T, dtype=torch.long)).numpy()
        ends = {}
        for p in np.nonzero(cands)[0]:
            emb = frozen.embed_VH[block_input_ids(tokens[p:p + 1], B, cfg.mask_token_id)]
            with torch.no_grad():
                hidden = model.draft_step(feats[:, :p], torch.arange(p), emb, p + torch.arange(B), model.new_cache())
            logits = hidden[0, 1:] @ frozen.head_VH.T
            labelled = 0
            while labelled < m and p + 1 + labelled < T and mask[p + 1 + labelled]:
                labelled += 1
            target = [int(top1[p + k]) if k < labelled else -1 for k in range(m)]
            if budget == 0:
                holds = [logits[k].argmax().item() == target[k] for k in range(m)]
            else:   # the tree's accepted depth along the target's path (slots without a label: no node)
                lp, ids = slot_topk(logits, V)
                lp[torch.tensor(target) < 0] = -math.inf
                tree = build_tree(lp, ids, budget)
                choice = torch.tensor(target + [-1])[torch.cat([torch.zeros(1, dtype=torch.long), tree.depths_N])]
                depth = len(walk(tree, choice)[0])
                holds = [k < depth for k in range(m)]
            accepted, how = 0, "full"
            for k in range(m):
                q = p + 1 + k
                if k >= labelled:
                    how = "end"
                    break
                at_risk[k] += 1
                if not holds[k]:
                    rejected[k] += 1
                    how = "rejected"
                    break
                accepted += 1
                if tokens[q] != top1[q - 1]:
                    how = "censored"
                    break
            ends[p] = (accepted, how, labelled)
        seqs.append((T, cands, ends))
    rate = np.where(at_risk > 0, 1 - rejected / np.maximum(at_risk, 1), 0.0)
    rounds = committed = 0
    censored = 0
    for T, cands, ends in seqs:
        runs = np.full(T, -1)
        for p, (accepted, how, labelled) in ends.items():
            run = float(accepted)
            if how == "censored":
                censored += 1
                survive = 1.0
                for j in range(accepted, labelled):
                    survive *= rate[j]
                    run += survive
            runs[p] = int(np.rint(run))
        r, c = walk_sequence(runs, cands, new_tokens)
        rounds, committed = rounds + r, committed + c
    return committed / rounds, rate, agree / supervised, censored


def test_tau_chain_judged_against_the_target_equals_the_naive_walk(tmp_path):
    reader, cfg, model, frozen, held = _setup(tmp_path, top1_is_text=0.5)
    res = heldout_estimate(model, held)
    tau, rate, agreement, censored = _naive(reader, cfg, model, frozen)
    assert censored > 10  # the text left the target's choice after accepted drafts: the extension was exercised
    assert res["tau_chain"] == pytest.approx(tau, abs=1e-12)
    assert res["accept_per_pos"] == [round(float(r), 4) for r in rate]
    assert res["target_agreement"] == pytest.approx(agreement, abs=1e-12) and 0.4 < agreement < 0.75
    assert res["tau_chain"] != res["tau_chain_text"]
    cut = heldout_estimate(model, HeldoutSet(**{**held.__dict__, "new_tokens": 6}))
    assert cut["tau_chain"] == pytest.approx(_naive(reader, cfg, model, frozen, new_tokens=6)[0], abs=1e-12)


def test_tree_estimates_judged_against_the_target_equal_the_naive_trees(tmp_path):
    reader, cfg, model, frozen, held = _setup(tmp_path, top1_is_text=0.5)
    res = heldout_estimate(model, HeldoutSet(**{**held.__dict__, "tree_budgets": (0, 2, 6)}))
    assert res["tau_tree_0"] == res["tau_chain"]
    for b in (2, 6):
        tau, _, _, censored = _naive(reader, cfg, model, frozen, budget=b)
        assert censored > 10 and res[f"tau_tree_{b}"] == pytest.approx(tau, abs=1e-12), b
        assert res[f"tau_tree_{b}"] != res["text_tau_tree"][str(b)]
    assert res["tau_chain"] <= res["tau_tree_2"] <= res["tau_tree_6"] and res["tau_chain"] < res["tau_tree_6"]


def test_on_the_target_s_own_text_both_judges_agree(tmp_path):
    """Where every stored top-1 is the text's next token (replies the target generated greedily), nothing is
    censored and judging against the target is judging against the text."""
    reader, cfg, model, frozen, held = _setup(tmp_path, top1_is_text=1.0)
    res = heldout_estimate(model, held)
    assert res["target_agreement"] == 1.0
    assert res["tau_chain"] == res["tau_chain_text"]
    assert res["tau_chain"] == pytest.approx(_naive(reader, cfg, model, frozen)[0], abs=1e-12)
    assert res["accept_per_pos"][0] == pytest.approx(res["acc_per_pos"][0], abs=1e-4)


def test_a_store_without_top_k_is_judged_against_its_text(tmp_path):
    write_random_store(str(tmp_path / "store"), segments=1, samples_per_segment=3, vocab=V, topk=0, seed=5)
    reader = StoreReader(str(tmp_path / "store"))
    cfg = DrafterConfig(hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                        vocab_size=V, block_size=B, mask_token_id=V - 1, target_layer_ids=[1, 3, 5],
                        num_target_layers=8)
    model = DFlashDrafter(cfg).eval()
    held = HeldoutSet(reader=reader, rows=np.arange(reader.num_samples),
                      frozen=frozen_tensors(reader, torch.device("cpu"), torch.float32), drafter=cfg, gamma=4.0,
                      max_anchors=16, loss_chunk=64, device=torch.device("cpu"), autocast=False)
    res = heldout_estimate(model, held)
    assert res["tau_chain"] == res["tau_chain_text"] and "target_agreement" not in res
