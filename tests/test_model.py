"""The drafter against the reference `dflash` package, and the training forward against leaks.

The strongest check here: every block of a packed training row (several samples, anchors closer than B,
sliding-window layers) equals a separate inference step that only ever saw that sample's tokens before
the anchor. Any leak of future context, of another block or of another sample breaks it.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from dflash_pipeline.method import block_input_ids, choose_mask_token_id, default_gamma, default_layer_ids
from dflash_pipeline.train.blocks import IGNORE_LABEL, anchor_candidates, build_blocks, pad_anchors, sample_anchors
from dflash_pipeline.train.export import export_drafter
from dflash_pipeline.train.model import DFlashDrafter, DrafterConfig, init_drafter_weights

H, F_N, V, B = 32, 3, 64, 8

CONFIGS = {
    "full": dict(layer_types=["full_attention", "full_attention"], sliding_window=None),
    "sliding": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5),
}


def tiny_config(kind: str = "full", **overrides) -> DrafterConfig:
    kw = dict(hidden_size=H, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
              vocab_size=V, block_size=B, mask_token_id=V - 1, target_layer_ids=[1, 3, 5][:F_N],
              num_target_layers=8, rope_theta=10000.0, **CONFIGS[kind])
    kw.update(overrides)
    return DrafterConfig(**kw)


def random_drafter(cfg: DrafterConfig, seed: int = 0) -> DFlashDrafter:
    """Large enough weights (and non-unit norms) that every path visibly changes the output."""
    g = torch.Generator().manual_seed(seed)
    model = DFlashDrafter(cfg)
    init_drafter_weights(model, std=0.15, generator=g)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


def packed_batch(seed: int = 0):
    """Two rows. Row 0: sample 0 (20 tokens), sample 1 (15 tokens), 5 padding; anchors 3, 10, 12 in
    sample 0 (10 and 12 closer than B) and 22, 27 in sample 1, plus a padded block. Row 1: one sample."""
    g = torch.Generator().manual_seed(seed)
    S = 40
    doc = torch.full((2, S), -1, dtype=torch.long)
    pos = torch.zeros(2, S, dtype=torch.long)
    doc[0, :20], pos[0, :20] = 0, torch.arange(20)
    doc[0, 20:35], pos[0, 20:35] = 1, torch.arange(15)
    doc[1, :33], pos[1, :33] = 0, torch.arange(33)
    features = torch.randn(2, S, F_N * H, generator=g)
    anchors = torch.tensor([[3, 10, 12, 22, 27, -1], [5, 6, 20, -1, -1, -1]])
    A = anchors.shape[1]
    valid = anchors >= 0
    a = anchors.clamp_min(0)
    block_pos = (pos.gather(1, a)[:, :, None] + torch.arange(B)).reshape(2, A * B)
    block_doc = torch.where(valid, doc.gather(1, a), -1)[:, :, None].expand(2, A, B).reshape(2, A * B)
    block_id = torch.where(valid, torch.arange(A), -1)[:, :, None].expand(2, A, B).reshape(2, A * B)
    embeds = torch.randn(2, A * B, H, generator=g)
    return dict(features_RSF=features, ctx_pos_RS=pos, ctx_doc_RS=doc, block_embeds_RQH=embeds,
                block_pos_RQ=block_pos, block_doc_RQ=block_doc, block_id_RQ=block_id), anchors


def block_out(out, j):
    return out[:, j * B:(j + 1) * B]


@pytest.fixture(autouse=True)
def _quiet_flex():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        yield


# --- reference equivalence ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_matches_reference_dflash_model(kind, tmp_path):
    # the DFlash authors' package: a test reference (the Makefile installs it), absent where only the GPU image's packages are
    pytest.importorskip("dflash", reason="the reference `dflash` package is not installed")
    from dflash.model import DFlashDraftModel, _crop_to, _make_cache

    cfg = tiny_config(kind)
    model = random_drafter(cfg)
    export_drafter(model, cfg, tmp_path, dtype=torch.float32)
    ref = DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    ctx, extra = 11, 9
    feats = torch.randn(1, ctx + extra, F_N * H, generator=g)
    emb1, emb2 = torch.randn(2, 1, B, H, generator=g)

    with torch.no_grad():
        ref_cache = _make_cache(ref.config)
        ref1 = ref(target_hidden=feats[:, :ctx], noise_embedding=emb1, position_ids=torch.arange(ctx + B)[None],
                   past_key_values=ref_cache, use_cache=True)
        _crop_to(ref_cache, ctx)
        # Second step after 3 accepted tokens: only the new context is passed, as dflash_generate does.
        ref2 = ref(target_hidden=feats[:, ctx:ctx + 3], noise_embedding=emb2,
                   position_ids=torch.arange(ctx, ctx + 3 + B)[None], past_key_values=ref_cache, use_cache=True)

        # Training forward: the row holds features beyond the anchor too; they must stay invisible.
        S = ctx + extra
        zeros = torch.zeros(1, B, dtype=torch.long)
        train1 = model(feats, torch.arange(S)[None], torch.zeros(1, S, dtype=torch.long), emb1,
                       ctx + torch.arange(B)[None], zeros, zeros)
        cache = model.new_cache()
        step1 = model.draft_step(feats[:, :ctx], torch.arange(ctx), emb1, ctx + torch.arange(B), cache)
        step2 = model.draft_step(feats[:, ctx:ctx + 3], torch.arange(ctx, ctx + 3), emb2,
                                 ctx + 3 + torch.arange(B), cache)
    assert len(cache) == ctx + 3
    assert ref1.abs().mean() > 0.1
    torch.testing.assert_close(train1, ref1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step1, ref1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step2, ref2, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["full", "sliding"])
@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_packed_training_equals_per_block_decoding(kind, backend):
    """Each training block == a decoding step that saw only its own sample's tokens before the anchor."""
    model = random_drafter(tiny_config(kind))
    model.attn_backend = backend
    batch, anchors = packed_batch()
    with torch.no_grad():
        out = model(**batch)
        assert torch.isfinite(out).all()  # padded blocks included
        for r in range(2):
            for j, a in enumerate(anchors[r].tolist()):
                if a < 0:
                    continue
                doc = batch["ctx_doc_RS"][r, a]
                before = (batch["ctx_doc_RS"][r] == doc) & (batch["ctx_pos_RS"][r] < batch["ctx_pos_RS"][r, a])
                block_pos = batch["block_pos_RQ"][r, j * B:(j + 1) * B]
                expect = model.draft_step(
                    batch["features_RSF"][r:r + 1, before], batch["ctx_pos_RS"][r, before],
                    block_out(batch["block_embeds_RQH"][r:r + 1], j), block_pos, model.new_cache(),
                )
                torch.testing.assert_close(block_out(out[r:r + 1], j), expect, atol=1e-5, rtol=1e-5)


# --- leak tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_no_leak_from_future_other_blocks_or_other_samples(kind):
    """Dense path; the flex mask equals the dense one exactly (test_masks) and matches per-block decoding."""
    model = random_drafter(tiny_config(kind))
    model.attn_backend = "dense"
    batch, anchors = packed_batch()
    doc, pos = batch["ctx_doc_RS"][0], batch["ctx_pos_RS"][0]

    def run(**changes):
        b = dict(batch)
        b.update(changes)
        with torch.no_grad():
            return model(**b)

    base = run()
    for j, a in enumerate(anchors[0].tolist()):
        if a < 0:
            continue
        same = doc == doc[a]
        # Context at or after the anchor in the same sample (the anchor's own state included).
        feats = batch["features_RSF"].clone()
        feats[0, same & (pos >= pos[a])] += 3.0
        assert torch.equal(block_out(run(features_RSF=feats)[:1], j), block_out(base[:1], j))
        # Every other block's tokens (for anchors 10 and 12 the neighbour overlaps in positions).
        embeds = batch["block_embeds_RQH"].clone()
        others = torch.ones(embeds.shape[1], dtype=torch.bool)
        others[j * B:(j + 1) * B] = False
        embeds[0, others] += 3.0
        assert torch.equal(block_out(run(block_embeds_RQH=embeds)[:1], j), block_out(base[:1], j))
        # The other sample of the row, the row's padding, and the other row.
        feats = batch["features_RSF"].clone()
        feats[0, ~same] += 3.0
        feats[1] += 3.0
        assert torch.equal(block_out(run(features_RSF=feats)[:1], j), block_out(base[:1], j))
        # Context just before the anchor is visible.
        if pos[a] > 0:
            feats = batch["features_RSF"].clone()
            feats[0, a - 1] += 3.0
            assert not torch.allclose(block_out(run(features_RSF=feats)[:1], j), block_out(base[:1], j))


def test_block_index_rule_would_leak():
    """Guard the test itself: with anchors 10 and 12 (B=8), block 2 (anchor 12) sees context 10 and 11,
    which a rule by block index (block 1 sees context < 8 + 8 = 16?) would get wrong either way."""
    model = random_drafter(tiny_config("full"))
    batch, _ = packed_batch()
    feats = batch["features_RSF"].clone()
    feats[0, 11] += 3.0  # visible to the block at 12, invisible to the block at 10
    with torch.no_grad():
        base, out = model(**batch), model(**{**batch, "features_RSF": feats})
    assert torch.equal(block_out(out[:1], 1), block_out(base[:1], 1))
    assert not torch.allclose(block_out(out[:1], 2), block_out(base[:1], 2))


def test_training_backward_is_finite_with_padding():
    model = random_drafter(tiny_config("sliding")).train()
    batch, _ = packed_batch()
    batch["block_embeds_RQH"].requires_grad_(True)
    out = model(**batch)
    valid = batch["block_id_RQ"] >= 0
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    (out * probe)[valid].sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert torch.isfinite(batch["block_embeds_RQH"].grad).all()
    assert batch["block_embeds_RQH"].grad[~valid].abs().max() == 0


def test_gradient_checkpointing_gives_same_gradients():
    """None, some (--checkpoint-layers 1) or all layers recomputed in backward: same gradients."""
    batch, _ = packed_batch()
    grads = []
    for n in (0, 1, 2):
        model = random_drafter(tiny_config("sliding")).train()
        model.checkpoint_layers = n
        assert model.gradient_checkpointing == (n == 2)
        out = model(**batch)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(0))).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(a, b)


def test_compiled_kernels_give_the_eager_outputs_and_gradients():
    """The fused (torch.compile) norm / residual / RoPE chains used on CUDA: same forward and gradients
    as the eager ops, with a checkpointed layer (which runs eager) mixed in. Compiled on the CPU here."""
    batch, _ = packed_batch()
    results = []
    for compiled in (False, True):
        model = random_drafter(tiny_config("sliding")).train()
        model.compile_kernels = compiled
        model.checkpoint_layers = 1
        feats = batch["features_RSF"].clone().requires_grad_(True)
        out = model(**{**batch, "features_RSF": feats})
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(0))).sum().backward()
        results.append((out.detach(), feats.grad, [p.grad for p in model.parameters()]))
    (out_e, gf_e, gp_e), (out_c, gf_c, gp_c) = results
    torch.testing.assert_close(out_c, out_e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gf_c, gf_e, rtol=1e-4, atol=1e-5)
    for a, b in zip(gp_c, gp_e):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_compiled_kernels_outlive_dynamos_default_recompile_limit():
    """One process can guard more versions of a compiled chain than dynamo's default 8 (the memory search's
    probes, steps, recomputes with and without grad, held-out passes, autocast on and off); past the limit
    a fullgraph function fails hard. Here 12 versions (dtypes x grad x output dtype) of
    the compiled RMSNorm from the default limit: each the eager result, none failing."""
    import torch._dynamo

    from dflash_pipeline.train import kernels as K

    K._compiled_set.cache_clear()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=8):   # the default, restored on the way out
        norm = K.kernels(True).rms_norm
        w = torch.randn(32)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for grad in (False, True):
                for out_dtype in (None, torch.float32):
                    x = torch.randn(4, 32).to(dtype).requires_grad_(grad)
                    tol = 1e-5 if dtype == torch.float32 else 2e-2   # fused: one rounding fewer in bf16/fp16
                    torch.testing.assert_close(norm(x, w, 1e-6, out_dtype), K.rms_norm(x, w, 1e-6, out_dtype),
                                               rtol=tol, atol=tol)
        assert torch._dynamo.config.recompile_limit >= K.RECOMPILE_LIMIT
    K._compiled_set.cache_clear()   # later tests compile afresh (and raise the limit again)
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_kernels_under_autocast_on_cuda_are_as_accurate_as_eager():
    """The training configuration (CUDA, bf16 autocast, flex attention, compiled chains) against an fp32
    reference: its error is no larger than the eager bf16 path's, for outputs and gradients."""
    batch, _ = packed_batch()
    batch = {k: v.cuda() for k, v in batch.items()}
    valid = batch["block_id_RQ"] >= 0
    probe = torch.randn(batch["block_embeds_RQH"].shape, generator=torch.Generator().manual_seed(0)).cuda()
    runs = {}
    for name, compiled, autocast in (("fp32", False, False), ("eager", False, True), ("compiled", True, True)):
        model = random_drafter(tiny_config("sliding", head_dim=16)).cuda().train()
        model.compile_kernels = compiled
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = model(**batch)
        (out.float() * probe)[valid].sum().backward()
        runs[name] = (out.float().detach()[valid], torch.cat([p.grad.flatten() for p in model.parameters()]))
    for i in range(2):
        ref = runs["fp32"][i]
        err_eager = (runs["eager"][i] - ref).norm() / ref.norm()
        err_compiled = (runs["compiled"][i] - ref).norm() / ref.norm()
        assert err_compiled <= 1.5 * err_eager + 1e-3, (i, err_compiled, err_eager)


def _step_batch(seed: int = 0, K: int = 4):
    """A packed two-row Batch on the host (the rows of `packed_batch`), with tokens, a loss mask with
    holes and random teacher top-k."""
    from dflash_pipeline.train.batch import Batch

    b, _ = packed_batch(seed)
    g = torch.Generator().manual_seed(seed + 1)
    pos, doc = b["ctx_pos_RS"], b["ctx_doc_RS"]
    R, S = doc.shape
    ids = torch.randint(0, V - 1, (R, S), generator=g)
    loss_mask = (doc >= 0) & (torch.rand(R, S, generator=g) > 0.2)
    top = torch.log_softmax(torch.randn(R, S, V, generator=g), -1).topk(K)
    return Batch(ids, loss_mask, pos, doc, b["features_RSF"], top.indices, top.values, int((doc >= 0).sum()))


@pytest.mark.parametrize("kind,causal", [("full", False), ("sliding", True), ("sliding", False)])
def test_step_blocks_come_from_the_host_copy_only(kind, causal):
    """Anchors, blocks, labels, the labelled selection and the teacher rows are built from the batch's
    host copy: the device copy is never read (here it lives on the meta device). Reading it would make
    the host wait for the GPU at every step. The result equals build_blocks on the same rows, and the
    attention-pair count (MFU) equals the visible pairs of the dense masks."""
    from dataclasses import replace

    from dflash_pipeline.train.masks import MaskLayout, dense_mask
    from dflash_pipeline.train.step import draw_anchors, stage_blocks

    cfg = tiny_config(kind, sliding_causal=causal)
    host = _step_batch()
    R, S = host.tokens.shape
    fields = ("tokens", "loss_mask", "pos", "doc", "features", "topk_ids", "topk_logprobs")
    on_meta = {f: torch.empty(getattr(host, f).shape, dtype=getattr(host, f).dtype, device="meta") for f in fields}
    batch = replace(host, **on_meta, host={f: getattr(host, f) for f in host.HOST_FIELDS})
    anchors = draw_anchors(batch, 3, torch.Generator().manual_seed(0), B)
    assert anchors.device.type == "cpu" and (anchors[0] >= 0).sum() > 3
    kinds = cfg.layer_mask_kinds()
    st = stage_blocks(batch, anchors, block_size=B, mask_token_id=cfg.mask_token_id, gamma=4.0, layer_kinds=kinds,
                      device=torch.device("cpu"))
    ref = build_blocks(host.tokens, host.pos, host.doc, host.loss_mask, anchors, block_size=B,
                       mask_token_id=cfg.mask_token_id, gamma=4.0)
    w = ref.weights_RQ.reshape(-1)
    Q = ref.weights_RQ.shape[1]
    assert torch.equal(st.sel_N, (w > 0).nonzero()[:, 0])
    assert torch.equal(st.labels_N, ref.labels_RQ.reshape(-1)[w > 0])
    assert torch.equal(st.weights_N, w[w > 0])
    assert torch.equal(st.token_ids_RQ, ref.token_ids_RQ) and torch.equal(st.pos_RQ, ref.pos_RQ)
    # The teacher of the token at row index t is the target's distribution stored at t - 1, same row.
    assert torch.equal(st.teacher_N, (st.sel_N // Q) * S + ref.label_index_RQ.reshape(-1)[w > 0] - 1)
    layout = MaskLayout.for_training(host.pos, host.doc, ref.pos_RQ, ref.doc_RQ, ref.block_id_RQ, B)
    valid = (ref.block_id_RQ >= 0)[:, :, None]
    pairs = sum(int((dense_mask(layout, c, win)[:, 0] & valid).sum()) for c, win in kinds)
    assert st.attn_pairs == pairs


def test_step_counts_top1_and_topk_hits_per_slot_from_the_loss_logits():
    """The step's per-slot top-1 (argmax) and top-k (k in TOPK_ACCURACY: fewer than k larger logits) counts
    equal those of the full logits of the same hidden states (no second head pass in the step)."""
    from dflash_pipeline.train.step import TOPK_ACCURACY, Frozen, draw_anchors, run_blocks, stage_blocks

    cfg = tiny_config("full")
    model = random_drafter(cfg)
    batch = _step_batch()
    g = torch.Generator().manual_seed(3)
    # A coarse head (values on a grid of 0.5) makes ties between logits common, as in bf16.
    frozen = Frozen(torch.randn(V, H, generator=g), (torch.randn(V, H, generator=g) * 0.25).round() / 2)
    anchors = draw_anchors(batch, 5, torch.Generator().manual_seed(0), B)
    captured = {}
    hook = model.register_forward_hook(lambda m, a, o: captured.__setitem__("h", o))
    with torch.no_grad():
        out = run_blocks(model, frozen, batch, anchors, block_size=B, mask_token_id=cfg.mask_token_id, gamma=4.0,
                         kl_weight=0.0, cap_weight=0.0, feature_noise=0.0, loss_chunk=128, g=None, autocast=False)
    hook.remove()
    st = stage_blocks(batch, anchors, block_size=B, mask_token_id=cfg.mask_token_id, gamma=4.0,
                      layer_kinds=cfg.layer_mask_kinds(), device=torch.device("cpu"))
    hidden = captured["h"].reshape(-1, H)[st.sel_N]
    logits = hidden @ frozen.head_VH.T
    rank = (logits > logits.gather(1, st.labels_N[:, None])).sum(-1)  # ties count for the label
    argmax_hit = logits.argmax(-1) == st.labels_N
    slot = st.sel_N % B
    assert torch.equal(out.count_B, torch.bincount(slot, minlength=B))
    assert torch.equal(out.correct_B, torch.bincount(slot[argmax_hit], minlength=B))
    assert out.topk_correct_JB.shape == (len(TOPK_ACCURACY), B)
    for j, k in enumerate(TOPK_ACCURACY):
        assert torch.equal(out.topk_correct_JB[j], torch.bincount(slot[rank < k], minlength=B))
    assert 0 < int(out.correct_B.sum()) < int(out.topk_correct_JB[0].sum()) < int(out.topk_correct_JB[1].sum())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_a_batch_in_chunks_of_rows_gives_the_whole_batch_loss_and_gradients(device):
    """What the trainer does where a whole batch does not fit: each row's blocks staged apart, the loss
    normalised over the whole batch's weights; the chunks' losses add up to the batch's, and their
    accumulated gradients equal the batch's (CE + KL + CAP)."""
    from dflash_pipeline.train.step import Frozen, draw_anchors, run_blocks, stage_blocks

    dev = torch.device(device)
    cfg = tiny_config("sliding", head_dim=16)
    model = random_drafter(cfg).to(dev).train()
    batch = _step_batch().to(dev)
    g = torch.Generator().manual_seed(3)
    frozen = Frozen(torch.randn(V, H, generator=g).to(dev), torch.randn(V, H, generator=g).to(dev))
    anchors = draw_anchors(batch, 5, torch.Generator().manual_seed(0), B)
    kw = dict(block_size=B, mask_token_id=cfg.mask_token_id, gamma=4.0, kl_weight=0.3, cap_weight=0.1,
              feature_noise=0.0, loss_chunk=128, g=None, autocast=False)
    whole = run_blocks(model, frozen, batch, anchors, **kw)
    whole.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    kinds = cfg.layer_mask_kinds()
    parts = [(batch.rows(r, r + 1), anchors[r:r + 1]) for r in range(batch.tokens.shape[0])]
    staged = [stage_blocks(b, a, block_size=B, mask_token_id=cfg.mask_token_id, gamma=4.0, layer_kinds=kinds,
                           device=dev) for b, a in parts]
    norm = torch.stack([st.weights_N.sum() for st in staged]).sum()
    outs = []
    for (b, a), st in zip(parts, staged):
        outs.append(run_blocks(model, frozen, b, a, staged=st, normalizer=norm, **kw))
        outs[-1].loss.backward()
    assert sum(o.input_tokens for o in outs) == whole.input_tokens
    for f in ("loss", "ce", "kl", "cap"):
        torch.testing.assert_close(sum(getattr(o, f).detach() for o in outs), getattr(whole, f).detach())
    assert torch.equal(sum(o.count_B for o in outs), whole.count_B)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_training_step_never_waits_for_the_gpu():
    """A whole training step (anchors, blocks, forward, fused loss with KL and CAP, feature noise,
    backward, clipping, AdamW) queues its GPU work without one device-to-host synchronisation: CUDA's
    sync debug mode turns any into an error. A sync per step lets the GPU run dry while the host
    catches up."""
    from dflash_pipeline.train.step import NOISE_STREAM, Frozen, draw_anchors, run_blocks, step_generator

    torch.manual_seed(0)
    cfg = tiny_config("sliding", head_dim=16)
    model = random_drafter(cfg).cuda().train()
    batch = _step_batch().to(torch.device("cuda"))
    frozen = Frozen(torch.randn(V, H).cuda(), torch.randn(V, H).cuda())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        anchors = draw_anchors(batch, 3, step_generator(0, 0, 0), B)
        out = run_blocks(model, frozen, batch, anchors, block_size=B, mask_token_id=cfg.mask_token_id, gamma=4.0,
                         kl_weight=0.1, cap_weight=0.1, feature_noise=0.01, loss_chunk=128,
                         g=step_generator(0, 0, 0, "cuda", NOISE_STREAM), autocast=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out

    step()  # compiles; the same shapes again below
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(out.loss)


# --- config and helpers --------------------------------------------------------------------------


def test_config_validation_and_roundtrip():
    cfg = tiny_config("sliding")
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg
    assert tiny_config("full", layer_types=[]).layer_types == ["full_attention"] * 2
    bad = [dict(num_kv_heads=3), dict(mask_token_id=V), dict(target_layer_ids=[8]), dict(target_layer_ids=[]),
           dict(layer_types=["full_attention"]), dict(layer_types=["x", "full_attention"]),
           dict(layer_types=["sliding_attention", "full_attention"], sliding_window=None), dict(block_size=1),
           dict(head_dim=7)]
    for kw in bad:
        with pytest.raises(ValueError):
            tiny_config("full", **kw)
    with pytest.raises(ValueError):
        DrafterConfig.from_dict({**cfg.to_dict(), "bogus": 1})


def test_qwen3_8b_shape_has_about_a_billion_parameters():
    from dflash_pipeline.train.model import count_parameters_for

    cfg = DrafterConfig(hidden_size=4096, intermediate_size=12288, num_layers=5, num_heads=32, num_kv_heads=8,
                        head_dim=128, vocab_size=151936, block_size=16, mask_token_id=151669,
                        target_layer_ids=default_layer_ids(36, 5), num_target_layers=36)
    assert 1.0e9 < count_parameters_for(cfg) < 1.1e9


def test_default_layer_ids():
    pytest.importorskip("dflash", reason="the reference `dflash` package is not installed")
    from dflash.model import build_target_layer_ids

    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(36, 1) == [18]
    for L in range(8, 64):
        for n in range(1, 6):
            assert default_layer_ids(L, n) == build_target_layer_ids(L, n)
    with pytest.raises(ValueError):
        default_layer_ids(5, 3)


class _Tok:
    def __init__(self, n, mask=None):
        self.n, self.mask_token_id = n, mask

    def __len__(self):
        return self.n


def test_choose_mask_token_id():
    assert choose_mask_token_id(7, _Tok(151669), 151936) == 7
    assert choose_mask_token_id(None, _Tok(100, mask=42), 128) == 42
    assert choose_mask_token_id(None, _Tok(151669), 151936) == 151669  # Qwen3
    with pytest.raises(ValueError, match="mask_token_id"):
        choose_mask_token_id(None, _Tok(49152), 49152)
    with pytest.raises(ValueError):
        choose_mask_token_id(200, _Tok(100), 128)


def test_block_input_ids():
    ids = block_input_ids(torch.tensor([5, 6]), 4, 99)
    assert ids.tolist() == [[5, 99, 99, 99], [6, 99, 99, 99]]


# --- anchors and labels -------------------------------------------------------------------------


def _row():
    """One row: sample 0 = idx 0..9 (prompt 0..3 unsupervised), sample 1 = idx 10..17, padding 18..19."""
    S = 20
    ids = torch.arange(100, 100 + S)[None]
    doc = torch.tensor([[0] * 10 + [1] * 8 + [-1] * 2])
    pos = torch.tensor([list(range(10)) + list(range(8)) + [0, 0]])
    mask = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    return ids, pos, doc, mask


def test_labels_are_same_position_and_never_cross_samples():
    ids, pos, doc, mask = _row()
    gamma = 4.0
    blocks = build_blocks(ids, pos, doc, mask, torch.tensor([[4, 8, 12, -1]]), block_size=4, mask_token_id=7,
                          gamma=gamma)
    assert blocks.token_ids_RQ.view(4, 4).tolist() == [[104, 7, 7, 7], [108, 7, 7, 7], [112, 7, 7, 7], [7, 7, 7, 7]]
    assert blocks.pos_RQ.view(4, 4)[:3].tolist() == [[4, 5, 6, 7], [8, 9, 10, 11], [2, 3, 4, 5]]
    assert blocks.doc_RQ.view(4, 4)[:, 0].tolist() == [0, 0, 1, -1]
    assert blocks.block_id_RQ.view(4, 4)[:, 0].tolist() == [0, 1, 2, -1]
    labels, w = blocks.labels_RQ.view(4, 4), blocks.weights_RQ.view(4, 4)
    decay = [0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, 4)]
    # Anchor 4: slots 1..3 label tokens 5..7 (same position, no shift).
    assert labels[0].tolist() == [IGNORE_LABEL, 105, 106, 107]
    torch.testing.assert_close(w[0], torch.tensor(decay))
    # Anchor 8: slot 1 = idx 9 (sample 0); slots 2, 3 would be sample 1: weight 0.
    assert labels[1].tolist() == [IGNORE_LABEL, 109, IGNORE_LABEL, IGNORE_LABEL]
    assert w[1].tolist() == [0.0, 1.0, 0.0, 0.0]
    # Anchor 12: slots reach idx 15; all supervised.
    assert labels[2].tolist() == [IGNORE_LABEL, 113, 114, 115]
    assert w[3].abs().sum() == 0 and (w[:, 0] == 0).all()
    assert blocks.label_index_RQ.view(4, 4)[0].tolist() == [-1, 5, 6, 7]


def test_labels_stop_at_row_end_and_unsupervised_positions():
    ids, pos, doc, mask = _row()
    mask[0, 14] = False
    blocks = build_blocks(ids, pos, doc, mask, torch.tensor([[13, 16]]), block_size=4, mask_token_id=7, gamma=4.0)
    w = blocks.weights_RQ.view(2, 4)
    assert (w[0] > 0).tolist() == [False, False, True, True]  # idx 14 unsupervised
    assert (w[1] > 0).tolist() == [False, True, False, False]  # idx 18, 19 padding


def test_sample_anchors():
    ids, pos, doc, mask = _row()
    cand = anchor_candidates(mask[0], doc[0])
    assert torch.nonzero(cand).flatten().tolist() == [4, 5, 6, 7, 8, 12, 13, 14, 15, 16]
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(50):
        a = sample_anchors(mask[0], doc[0], 3, g)
        assert a.tolist() == sorted(set(a.tolist()))
        assert all(cand[a]) and mask[0, a].all() and mask[0, a + 1].all() and (doc[0, a] == doc[0, a + 1]).all()
        assert (doc[0, a] == 0).sum() == 3 and (doc[0, a] == 1).sum() == 3
        seen.update(a.tolist())
    assert seen == set(torch.nonzero(cand).flatten().tolist())
    assert sample_anchors(mask[0], doc[0], 100, g).tolist() == [4, 5, 6, 7, 8, 12, 13, 14, 15, 16]
    same = [sample_anchors(mask[0], doc[0], 2, torch.Generator().manual_seed(5)).tolist() for _ in range(2)]
    assert same[0] == same[1]
    padded = pad_anchors([torch.tensor([1, 2]), torch.tensor([3])])
    assert padded.tolist() == [[1, 2], [3, -1]]


def test_default_gamma():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    with pytest.raises(ValueError):
        default_gamma(12)


def test_blocks_feed_the_model_end_to_end():
    """build_blocks output plugs into the training forward and matches the hand-built batch."""
    cfg = tiny_config("sliding")
    model = random_drafter(cfg)
    batch, anchors = packed_batch()
    S = batch["ctx_pos_RS"].shape[1]
    ids = torch.randint(0, V - 1, (2, S), generator=torch.Generator().manual_seed(3))
    loss_mask = batch["ctx_doc_RS"] >= 0
    blocks = build_blocks(ids, batch["ctx_pos_RS"], batch["ctx_doc_RS"], loss_mask, anchors, block_size=B,
                          mask_token_id=cfg.mask_token_id, gamma=4.0)
    assert torch.equal(blocks.pos_RQ[blocks.block_id_RQ >= 0], batch["block_pos_RQ"][batch["block_id_RQ"] >= 0])
    assert torch.equal(blocks.doc_RQ, batch["block_doc_RQ"])
    assert torch.equal(blocks.block_id_RQ, batch["block_id_RQ"])
    emb_table = torch.randn(V, H)
    with torch.no_grad():
        out = model(batch["features_RSF"], batch["ctx_pos_RS"], batch["ctx_doc_RS"], emb_table[blocks.token_ids_RQ],
                    blocks.pos_RQ, blocks.doc_RQ, blocks.block_id_RQ)
    assert torch.isfinite(out).all() and out.shape == (2, anchors.shape[1] * B, H)


def test_drafter_options_are_constructor_arguments_and_never_saved():
    """Switches of how the drafter computes: given at construction, validated, absent from the state
    dict (the export and checkpoints do not change with them), and they change no number."""
    from dflash_pipeline.train.model import DrafterOptions

    cfg = tiny_config("sliding")
    plain = random_drafter(cfg)
    switched = DFlashDrafter(cfg, DrafterOptions(checkpoint_layers=1, compile_kernels=False, attn_backend="flex"))
    switched.load_state_dict(plain.state_dict())
    assert switched.state_dict().keys() == plain.state_dict().keys()
    assert (switched.checkpoint_layers, switched.compile_kernels, switched.attn_backend) == (1, False, "flex")
    batch, _ = packed_batch()
    with torch.no_grad():
        torch.testing.assert_close(switched.eval()(**batch), plain(**batch), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="attention backend"):
        DrafterOptions(attn_backend="fast")
    with pytest.raises(ValueError, match="checkpoint_layers"):
        plain.checkpoint_layers = -1
