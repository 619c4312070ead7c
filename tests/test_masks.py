"""One visibility predicate, two renderings: the dense SDPA mask and the FlexAttention block mask agree."""

from __future__ import annotations

import warnings

import pytest
import torch

from dflash_pipeline.train.masks import MaskLayout, choose_backend, dense_mask, flex_block_mask, tile_visibility

from test_model import B, packed_batch, random_drafter, tiny_config

KINDS = [(False, None), (True, 5), (False, 5), (True, None)]


@pytest.fixture(autouse=True)
def _quiet_flex():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        yield


def _layout():
    batch, _ = packed_batch()
    return MaskLayout.for_training(batch["ctx_pos_RS"], batch["ctx_doc_RS"], batch["block_pos_RQ"],
                                   batch["block_doc_RQ"], batch["block_id_RQ"], B)


@pytest.mark.parametrize("causal,window", KINDS)
def test_mask_mod_equals_dense_mask(causal, window):
    from torch.nn.attention.flex_attention import create_mask

    layout = _layout()
    flex = create_mask(layout.mask_mod(causal, window), layout.num_rows, None, layout.num_queries,
                       layout.num_keys, device="cpu")
    assert torch.equal(flex.bool(), dense_mask(layout, causal, window))


@pytest.mark.parametrize("causal,window", KINDS)
@pytest.mark.parametrize("tile", [4, 8, 16, 128])
def test_tile_bounds_match_the_dense_mask(causal, window, tile):
    """Block sparsity from per-tile bounds against the dense mask reduced per tile: a tile with a
    visible pair is never skipped, a tile marked full has every pair visible, and the BlockMask stands
    for exactly the dense mask."""
    layout = _layout()
    R, Q, K = layout.num_rows, layout.num_queries, layout.num_keys
    nQ, nK = -(-Q // tile), -(-K // tile)
    dense = torch.nn.functional.pad(dense_mask(layout, causal, window)[:, 0], (0, nK * tile - K, 0, nQ * tile - Q))
    valid = torch.nn.functional.pad(torch.ones(R, Q, K, dtype=torch.bool), (0, nK * tile - K, 0, nQ * tile - Q))
    dense = dense.view(R, nQ, tile, nK, tile)
    valid = valid.view(R, nQ, tile, nK, tile)
    true_any = dense.any(4).any(2)
    true_full = (dense | ~valid).all(4).all(2) & valid.all(4).all(2)
    got_any, got_full = tile_visibility(layout, causal, window, tile)
    assert not (true_any & ~got_any).any(), "a tile with visible pairs would be skipped"
    assert not (got_full & ~true_full).any(), "a tile marked full has invisible pairs"
    # (Bounds are loose only in tiles that straddle two samples; those stay partial and exact.)
    # The BlockMask stands for exactly the dense mask.
    bm = flex_block_mask(layout, causal, window, tile=tile)
    assert torch.equal(_render(bm, layout), dense_mask(layout, causal, window)[:, 0])


def _render(bm, layout):
    """Dense [R, Q, K] mask a BlockMask stands for: full tiles True, partial tiles by mask_mod."""
    R, Q, K = layout.num_rows, layout.num_queries, layout.num_keys
    tq, tk = bm.BLOCK_SIZE
    blocks = bm.to_dense()[:, 0].bool()  # [R, nQ, nK]: tile kept (partial or full)
    full = torch.zeros_like(blocks)
    if bm.full_kv_num_blocks is not None:
        for r in range(R):
            for i in range(blocks.shape[1]):
                n = int(bm.full_kv_num_blocks[r, 0, i])
                full[r, i, bm.full_kv_indices[r, 0, i, :n].long()] = True
    q = torch.arange(Q)[:, None]
    k = torch.arange(K)[None, :]
    keep = blocks[:, q // tq, k // tk]
    fullm = full[:, q // tq, k // tk]
    exact = torch.stack([bm.mask_mod(torch.tensor(r), None, q, k) for r in range(R)])
    return fullm | (keep & exact)


def test_dense_mask_by_hand():
    """Row 0, anchors 10 and 12 of sample 0 (B=8): context < anchor only, own block only."""
    layout = _layout()
    m = dense_mask(layout, False, None)[0, 0]
    S = layout.num_ctx
    q10, q12 = 1 * B, 2 * B  # slot 0 of the blocks at anchors 10 and 12
    assert m[q10, :S].nonzero().flatten().tolist() == list(range(10))
    assert m[q12, :S].nonzero().flatten().tolist() == list(range(12))
    assert m[q10 + 3, S:].nonzero().flatten().tolist() == list(range(B, 2 * B))
    # Sample 1 (row idx 20..34): the block at row idx 27 (position 7) sees row idx 20..26 only.
    q27 = 4 * B
    assert m[q27, :S].nonzero().flatten().tolist() == list(range(20, 27))
    # Causal + window 5: slot 3 of the anchor-10 block (position 13) sees context 9, block slots 0..3.
    mw = dense_mask(layout, True, 5)[0, 0]
    assert mw[q10 + 3, :S].nonzero().flatten().tolist() == [9]
    assert mw[q10 + 3, S:].nonzero().flatten().tolist() == list(range(B, B + 4))
    # Padded block: each query sees only itself.
    pad_q = 5 * B + 2
    assert m[pad_q].nonzero().flatten().tolist() == [S + pad_q]


@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_dense_and_flex_forward_agree(kind):
    """On CPU flex attention runs eagerly, forward only (its backward needs CUDA: see the test below)."""
    batch, _ = packed_batch()
    valid = batch["block_id_RQ"] >= 0
    model = random_drafter(tiny_config(kind))
    outs = {}
    for backend in ("dense", "flex"):
        model.attn_backend = backend
        with torch.no_grad():
            outs[backend] = model(**batch)
    torch.testing.assert_close(outs["flex"][valid], outs["dense"][valid], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex attention needs CUDA")
@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_dense_and_flex_agree_on_cuda_with_gradients(kind):
    batch, _ = packed_batch()
    batch = {k: v.cuda() for k, v in batch.items()}
    valid = batch["block_id_RQ"] >= 0
    probe = torch.randn(batch["block_embeds_RQH"].shape, generator=torch.Generator().manual_seed(0)).cuda()
    results = {}
    for backend in ("dense", "flex"):
        model = random_drafter(tiny_config(kind, head_dim=16)).cuda().train()  # compiled flex needs D >= 16
        model.attn_backend = backend
        out = model(**batch)
        # A random projection: the final RMSNorm makes sum(out^2) nearly scale-free, so its gradient
        # upstream of the norm is rounding noise and cannot compare backends.
        (out * probe)[valid].sum().backward()
        results[backend] = (out.detach(), [p.grad for p in model.parameters()])
    torch.testing.assert_close(results["flex"][0][valid], results["dense"][0][valid], atol=1e-4, rtol=1e-4)
    for a, b in zip(results["dense"][1], results["flex"][1]):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-3)


def test_backends_agree_under_autocast(monkeypatch):
    """The trainer runs the drafter under bf16 autocast: q, k leave fp32 RMSNorm weights in fp32, v is
    bf16. Compiled flex attention (CUDA) rejects mixed dtypes, eager CPU flex does not: check by hand."""
    import dflash_pipeline.train.masks as masks
    from torch.nn.attention.flex_attention import flex_attention

    def strict_flex(device):
        def run(q, k, v, **kw):
            assert q.dtype == k.dtype == v.dtype == torch.bfloat16
            return flex_attention(q, k, v, **kw)
        return run

    monkeypatch.setattr(masks, "_flex_attention", strict_flex)
    batch, _ = packed_batch()
    valid = batch["block_id_RQ"] >= 0
    model = random_drafter(tiny_config("sliding"))
    outs = {}
    for backend in ("dense", "flex"):
        model.attn_backend = backend
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            outs[backend] = model(**batch).float()
    assert torch.isfinite(outs["dense"]).all()
    torch.testing.assert_close(outs["flex"][valid], outs["dense"][valid], atol=0.1, rtol=0.05)


def test_choose_backend():
    assert choose_backend(torch.device("cpu")) == "dense"
    assert choose_backend(torch.device("cuda", 0)) == "flex"
    assert choose_backend(torch.device("cpu"), "flex") == "flex"
    with pytest.raises(ValueError):
        choose_backend(torch.device("cpu"), "flash")


def test_block_size_must_divide_block_tokens():
    batch, _ = packed_batch()
    with pytest.raises(ValueError):
        MaskLayout.for_training(batch["ctx_pos_RS"], batch["ctx_doc_RS"], batch["block_pos_RQ"][:, :-1],
                                batch["block_doc_RQ"][:, :-1], batch["block_id_RQ"][:, :-1], B)
