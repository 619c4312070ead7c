"""`--checkpoint-layers auto`'s pieces: the search over recomputed layers and micro-batch rows, the bound on a
step's anchors (against the anchors real batches draw), the synthetic batch (against the shape it stands
for), and the measurement's clean-up after an out-of-memory error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_pipeline.train.memory import (MemoryPlan, Probe, StepShape, measure_step, row_anchor_bound,
                                          run_plans, search_recompute, synthetic_batch,
                                          worst_shape)
from dflash_pipeline.train.model import DFlashDrafter, DrafterConfig, DrafterOptions, init_drafter_weights
from dflash_pipeline.train.plan import RowPiece
from dflash_pipeline.train.step import Frozen, draw_anchors, run_blocks


def _fake(fits):
    """measure(layers, rows) from a rule fits(layers, rows)."""
    return lambda k, r: Probe(k, r, fits(k, r), 1 << 30 if fits(k, r) else None)


@pytest.mark.parametrize("need", range(6))
def test_search_finds_the_fewest_layers_that_fit(need):
    layers, probes, rows = search_recompute(5, 8, _fake(lambda k, r: k >= need))
    assert layers == need and rows == 8
    assert [p.checkpoint_layers for p in probes][:2] == ([0] if need == 0 else [0, 5])
    assert len(probes) <= 2 + 3          # none, all, and a bisection of 1..5


def test_search_finds_the_rows_a_pass_takes_when_no_layer_count_fits_the_batch():
    """All layers at halved rows until they fit, then the fewest layers at that size (all known to fit)."""
    layers, probes, rows = search_recompute(5, 8, _fake(lambda k, r: r <= 2 and k >= 3))
    assert (layers, rows) == (3, 2)
    assert [(p.checkpoint_layers, p.rows) for p in probes] == [(0, 8), (5, 8), (5, 4), (5, 2), (0, 2), (3, 2), (2, 2)]
    # rows that do not halve evenly round up: chunks of 2, 2 and 1 of 5 rows take at most 2 at a time
    layers, probes, rows = search_recompute(5, 5, _fake(lambda k, r: r <= 2))
    assert (layers, rows) == (0, 2) and [p.rows for p in probes] == [5, 5, 3, 2, 2]
    assert search_recompute(5, 3, _fake(lambda k, r: False))[::2] == (None, 0)
    assert search_recompute(5, 8, _fake(lambda k, r: False))[::2] == (None, 0)


def test_row_anchor_bound_caps_per_sample_and_by_supervised_tokens():
    supervised = np.array([100, 3, 50, 0])
    pieces = [RowPiece(0, 80), RowPiece(1, 10), RowPiece(2, 50), RowPiece(3, 5)]
    # sample 0: 80 tokens held, cap 16 -> 16; sample 1: 3 supervised -> 2; sample 2: 49 -> 16; sample 3: 0
    assert row_anchor_bound(pieces, supervised, 16) == 16 + 2 + 16 + 0
    assert row_anchor_bound(pieces, supervised, 1000) == 79 + 2 + 49 + 0


def _tiny_drafter(vocab=64, layers=2, hidden=32, head_dim=8):
    cfg = DrafterConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers, num_heads=4,
                        num_kv_heads=2, head_dim=head_dim, vocab_size=vocab, block_size=4, mask_token_id=vocab - 1,
                        target_layer_ids=[0, 1], num_target_layers=2)
    model = DFlashDrafter(cfg, DrafterOptions(compile_kernels=False))
    init_drafter_weights(model, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    frozen = Frozen(torch.randn(vocab, hidden, generator=g), torch.randn(vocab, hidden, generator=g))
    return cfg, model, frozen


def _loss(model, frozen, batch, anchors, cfg):
    return run_blocks(model, frozen, batch, anchors, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
                      gamma=3.0, kl_weight=0.1, cap_weight=0.1, feature_noise=0.0, loss_chunk=4096, g=None,
                      autocast=False)


def test_synthetic_batch_has_the_shape_it_stands_for():
    cfg, model, frozen = _tiny_drafter()
    shape = StepShape(rows=3, row_len=96, anchors=40, block_size=4)
    batch, anchors = synthetic_batch(shape, width=64, topk=5, vocab=cfg.vocab_size, device=torch.device("cpu"))
    assert anchors.shape == (3, 40) and bool((anchors >= 0).all())
    assert all(len(torch.unique(a)) == 40 for a in anchors)
    out = _loss(model, frozen, batch, anchors, cfg)
    assert out.block_tokens == shape.block_tokens == 3 * 40 * 4
    # every block has labels (the loss sees the step's whole block count)
    assert int(out.blocks) == 3 * 40
    assert batch.features.shape == (3, 96, 64) and batch.features.dtype == torch.bfloat16
    assert batch.topk_ids.shape == (3, 96, 5)


def test_worst_shape_bounds_every_real_batch(tmp_path, smollm_dir):
    """The bound holds for the anchors real batches draw, epoch after epoch, on a real store."""
    from helpers import extract_tiny_store
    from dflash_pipeline.store.reader import StoreReader
    from dflash_pipeline.train.loader import StreamingLoader

    store = extract_tiny_store(tmp_path, smollm_dir, n=40)[1]
    r = StoreReader(store)
    rows, row_len, max_anchors, B = 2, 128, 6, 4
    loader = StreamingLoader(r, layers=r.meta.layer_ids, rank=0, world=1, seed=3, row_len=row_len,
                             rows_per_batch=rows, num_workers=0)
    shape, read = worst_shape(run_plans(loader.epoch_plan, 2), loader.man.supervised, rows=rows,
                              row_len=row_len, max_anchors=max_anchors, block_size=B)
    assert read == 2
    g = torch.Generator().manual_seed(0)
    seen = 0
    for epoch in range(2):
        for b in loader.iter_epoch(epoch):
            anchors = draw_anchors(b, max_anchors, g, B)
            assert anchors.shape[1] <= shape.anchors
            seen = max(seen, int((anchors >= 0).sum(1).max()))
    loader.close()
    bucket = 128 // B
    assert seen <= shape.anchors and shape.anchors % bucket == 0
    assert shape.anchors - seen < bucket * 2, "the bound should be close to what real rows draw"


def test_measure_step_recovers_from_out_of_memory():
    cfg, model, frozen = _tiny_drafter()
    shape = StepShape(rows=2, row_len=64, anchors=32, block_size=4)
    batch, anchors = synthetic_batch(shape, width=64, topk=5, vocab=cfg.vocab_size, device=torch.device("cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def step(m):
        if m.checkpoint_layers < 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return _loss(m, frozen, batch, anchors, cfg).loss

    assert measure_step(model, step, layers=0, device=torch.device("cpu"), held_bytes=0, budget_bytes=1) == (False, None)
    fits, peak = measure_step(model, step, layers=2, device=torch.device("cpu"), held_bytes=1024, budget_bytes=1)
    assert fits and peak == 0 and model.checkpoint_layers == 2
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_plan_line_and_record():
    shape = StepShape(rows=4, row_len=3072, anchors=592, block_size=16)
    plan = MemoryPlan(checkpoint_layers=3, num_layers=5, shape=shape, budget_bytes=70 << 30, total_bytes=80 << 30,
                      held_bytes=1 << 30, probes=[Probe(0, 4, False, None), Probe(5, 4, True, 40 << 30),
                                                  Probe(2, 4, False, 75 << 30), Probe(3, 4, True, 60 << 30)],
                      chunk_rows=4)
    line = plan.line()
    assert "37,888 block tokens" in line and "60.0 GiB of a 70.0 GiB budget" in line and "3 of 5" in line
    assert "chunks" not in line and plan.chunks == 1
    assert plan.to_dict()["shape"]["block_tokens"] == 37_888 and plan.to_dict()["chunk_rows"] == 4
    # ranks agree on the most layers any needs: this rank's own measurement is named as such
    plan.checkpoint_layers, plan.probes = 2, [Probe(0, 4, True, 30 << 30)]
    assert "30.0 GiB" in plan.line() and "as measured here (other ranks need more)" in plan.line()
    assert "2 of 5 drafter layers" in plan.line()
    # a batch that runs in chunks of rows says so, with the chunk's peak
    plan.checkpoint_layers, plan.chunk_rows = 5, 3
    plan.probes = [Probe(0, 4, False, None), Probe(5, 4, False, None), Probe(5, 2, True, 50 << 30),
                   Probe(0, 2, False, None), Probe(3, 2, False, None), Probe(4, 2, False, None)]
    plan.chunk_rows = 2
    line = plan.line()
    assert plan.chunks == 2 and "50.0 GiB in chunks of 2 rows" in line and "in 2 chunks of 2 rows" in line
    assert "other ranks" not in line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_measure_step_on_the_gpu_reads_the_peak_and_survives_a_real_out_of_memory():
    """On the device: the peak includes what is held beside the step, a budget below it does not fit, and a
    real out-of-memory error leaves nothing allocated behind."""
    dev = torch.device("cuda")
    # FlexAttention on CUDA needs a head dimension of at least 16; the features are 2 layers x hidden 64
    cfg, model, frozen = _tiny_drafter(hidden=64, head_dim=16)
    model.to(dev)
    frozen = Frozen(frozen.embed_VH.to(dev), frozen.head_VH.to(dev))
    shape = StepShape(rows=2, row_len=256, anchors=64, block_size=4)

    def step(m):
        batch, anchors = synthetic_batch(shape, width=128, topk=5, vocab=cfg.vocab_size, device=dev)
        return _loss(m, frozen, batch, anchors, cfg).loss

    start = torch.cuda.memory_allocated(dev)
    fits, peak = measure_step(model, step, layers=0, device=dev, held_bytes=256 << 20, budget_bytes=1 << 40)
    assert fits and peak > start + (256 << 20)
    # the first matrix product allocates cuBLAS's workspace (64 MiB on an H100), which stays for the process:
    # what a measurement may not leave behind is counted from here
    base = torch.cuda.memory_allocated(dev)
    fits, peak = measure_step(model, step, layers=0, device=dev, held_bytes=0, budget_bytes=base)
    assert fits is False and peak > base
    need = peak - base  # what the step itself allocates at its peak
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(dev)
    # out of memory where the held bytes are allocated, then in the middle of the step
    for held in (free + (1 << 30), free - need // 2):
        assert measure_step(model, step, layers=0, device=dev, held_bytes=held, budget_bytes=1 << 40) == (False, None)
        assert torch.cuda.memory_allocated(dev) == base
    assert measure_step(model, step, layers=0, device=dev, held_bytes=0, budget_bytes=1 << 40)[0] is True


class _Lengths:
    """A store's manifest columns for the planner: reply-like lengths, 256 samples a segment."""

    def __init__(self, n: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        prompt = rng.normal(60, 40, n).clip(8, 512).astype(np.int64)
        reply = np.where(rng.random(n) < 0.55, 384, rng.integers(5, 384, n))
        self.segment, self.sample_id = np.arange(n) // 256, np.arange(n)
        self.length, self.supervised = prompt + reply + 10, reply + 1


def test_the_run_s_later_epochs_can_pack_a_fuller_row_than_the_first_two():
    """Why the largest step is read from every epoch the run trains: each packs its rows anew, and on
    reply-length samples a later epoch's fullest row draws more anchors than the first two epochs' (the H100
    run that probed two of ten epochs peaked 1.4% above its probe). Planning stops after its time budget,
    never before two epochs."""
    from dflash_pipeline.train.plan import plan_epoch

    man = _Lengths(12_000)
    train = np.ones(len(man.length), dtype=bool)

    def plan_of(e):
        return plan_epoch(man, train, epoch=e, rank=0, world=1, seed=0, row_len=3072, rows_per_batch=16)

    kw = dict(rows=16, row_len=3072, max_anchors=64, block_size=16)
    first_two, read2 = worst_shape(run_plans(plan_of, 2), man.supervised, **kw)
    run, read = worst_shape(run_plans(plan_of, 12), man.supervised, **kw)
    assert (read2, read) == (2, 12) and run.anchors > first_two.anchors
    assert worst_shape(run_plans(plan_of, 12, seconds=0.0), man.supervised, **kw)[1] == 2
    assert worst_shape(run_plans(plan_of, 1), man.supervised, **kw)[1] == 2
