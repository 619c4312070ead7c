"""`dflash train` end to end on a store written by `dflash extract` from a tiny random target:
loader determinism and resume, equal steps per rank, held-out split, exact trainer resume, DDP on two
CPU processes, SIGTERM, refusals, corrupt segments."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_pipeline.errors import ConfigMismatchError, DFlashError
from dflash_pipeline.schemas.config import TrainConfig
from dflash_pipeline.store.reader import StoreReader
from dflash_pipeline.train.loader import StreamingLoader
from dflash_pipeline.train.plan import Manifest, eval_holdout, plan_epoch
from dflash_pipeline.train.trainer import run_train
from helpers import extract_tiny_store

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory, smollm_dir):
    return extract_tiny_store(tmp_path_factory.mktemp("tiny"), smollm_dir, n=60)[1]


def _cfg(store, out, **kw) -> TrainConfig:
    base = dict(store=store, out=str(out), steps=6, num_layers=1, block_size=4, gamma=3.0, max_anchors=8,
                tokens_per_batch=256, max_length=128, eval_fraction=0.1, log_every=1, save_every=1000,
                num_workers=0, device="cpu", quiet=True, lr=3e-3, warmup_ratio=0.0)
    base.update(kw)
    return TrainConfig(**base)


def _batches(loader, epoch=0, start=0, n=None):
    out = []
    for i, b in enumerate(loader.iter_epoch(epoch, start)):
        out.append(b)
        if n is not None and len(out) == n:
            break
    return out


def _loader(store, **kw):
    r = StoreReader(store)
    base = dict(layers=r.meta.layer_ids, rank=0, world=1, seed=3, row_len=128, rows_per_batch=2, eval_fraction=0.1,
                num_workers=0)
    base.update(kw)
    return StreamingLoader(r, **base)


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.doc, y.doc)
        assert torch.equal(x.features.view(torch.int16), y.features.view(torch.int16))
        assert torch.equal(x.topk_ids, y.topk_ids)


def test_loader_resume_gives_the_next_batches(tiny_store):
    full = _batches(_loader(tiny_store))
    assert len(full) >= 4
    loader = _loader(tiny_store)
    first = _batches(loader, n=2)
    state = loader.state(0, 2)
    again = _loader(tiny_store)
    state.check_compatible(again.state(0, 0))
    rest = _batches(again, 0, state.batch)
    _same(first + rest, full)


def test_stream_across_epochs_prefetches_over_the_boundary(tiny_store, monkeypatch):
    """`iter_from` runs one prefetch pipeline through epoch boundaries: the next epoch's first batch is
    built while the last one of the epoch trains (per-epoch iterators restarted the pipeline there: a
    wait on the GPU at every boundary). Its batches are those of the epochs one by one."""
    import time

    import dflash_pipeline.train.loader as data

    per_epoch = _batches(_loader(tiny_store), 0, 1) + _batches(_loader(tiny_store), 1)
    orig = data.build_window_rows

    def slow(*a, **k):
        time.sleep(0.3)
        return orig(*a, **k)

    monkeypatch.setattr(data, "build_window_rows", slow)
    loader = _loader(tiny_store)   # num_workers=0: the prefetch thread builds the windows itself
    n0 = loader.epoch_plan(0).steps
    stream = loader.iter_from(0, 1)
    got, tags = [], []
    for tag, b in stream:
        got.append(b)
        tags.append(tag[:2])
        if tag[:2] == (0, n0 - 1):
            time.sleep(1.0)                      # the step on epoch 0's last batch
            loader.data_wait = 0.0
        elif tag[0] == 1 and tag[1] == 0:
            assert loader.data_wait < 0.15, loader.data_wait
        if len(got) == len(per_epoch):
            break
    stream.close()
    assert tags[0] == (0, 1) and tags[n0 - 1] == (1, 0)
    _same(got, per_epoch)


def test_workers_do_not_change_the_order(tiny_store):
    _same(_batches(_loader(tiny_store, num_workers=2)), _batches(_loader(tiny_store, num_workers=0)))


def test_loader_state_refuses_other_world_size(tiny_store):
    saved = _loader(tiny_store, world=1).state(0, 3)
    with pytest.raises(ConfigMismatchError, match="world=1"):
        saved.check_compatible(_loader(tiny_store, world=2, rank=1).state(0, 0))


def test_ranks_are_disjoint_and_run_equal_steps(tiny_store):
    r = StoreReader(tiny_store)
    man = Manifest(r)
    train = ~eval_holdout(man.sample_id, 0.1, 3)
    plans = [plan_epoch(man, train, epoch=1, rank=k, world=3, seed=3, row_len=128, rows_per_batch=1) for k in range(3)]
    assert len({p.steps for p in plans}) == 1 and plans[0].steps == min(plans[0].rows_per_rank)
    segs = [set(s for w in p.windows for s in w.segments) for p in plans]
    assert not (segs[0] & segs[1]) and not (segs[1] & segs[2]) and not (segs[0] & segs[2])
    # no held-out sample in any training row; every usable training sample is in exactly one row
    rows = [piece.row for p in plans for w in p.windows for row in w.rows for piece in row]
    assert len(rows) == len(set(rows))
    assert not (set(rows) & set(np.nonzero(~train)[0].tolist()))


def test_holdout_is_stable_and_near_fraction():
    ids = np.arange(20000)
    h = eval_holdout(ids, 0.05, 0)
    assert 0.04 < h.mean() < 0.06
    assert np.array_equal(h[:100], eval_holdout(ids[:100], 0.05, 0))  # depends on the id, not the position


def _losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["type"] == "train":
            out[rec["step"]] = rec["loss"]
    return out


def test_resume_equals_uninterrupted(tiny_store, tmp_path):
    full = tmp_path / "full"
    run_train(_cfg(tiny_store, full, steps=7, ema=0.9, feature_noise=0.05, kl_weight=0.3, cap_weight=0.1))
    split = tmp_path / "split"
    first = run_train(_cfg(tiny_store, split, steps=7, ema=0.9, feature_noise=0.05, kl_weight=0.3, cap_weight=0.1,
                           stop_after=3))
    assert not first["finished"] and first["step"] == 3
    second = run_train(_cfg(tiny_store, split, steps=7, ema=0.9, feature_noise=0.05, kl_weight=0.3, cap_weight=0.1,
                            resume=True))
    assert second["finished"]
    a, b = _losses(full), _losses(split)
    assert [a[s] for s in range(1, 8)] == [b[s] for s in range(1, 8)]
    wa = (full / "final" / "model.safetensors").read_bytes()
    wb = (split / "final" / "model.safetensors").read_bytes()
    assert wa == wb


def test_resume_refuses_changed_config_or_store(tiny_store, tmp_path):
    run = tmp_path / "run"
    run_train(_cfg(tiny_store, run, steps=4, stop_after=2))
    with pytest.raises(ConfigMismatchError, match="lr: checkpoint has 0.003, this run has 0.001"):
        run_train(_cfg(tiny_store, run, steps=4, lr=1e-3, resume=True))
    with pytest.raises(DFlashError, match="no checkpoint"):
        run_train(_cfg(tiny_store, tmp_path / "empty", steps=4, resume=True))


def test_adam_beta2_reaches_the_optimizer_and_decides_a_resume(tiny_store, tmp_path):
    """--adam-beta2: left to its default the run is the one with 0.999 given, byte for byte, and its config
    names the value; 0.95 (the default before) trains other weights; a resume with another beta2 is refused,
    and a checkpoint whose config does not name beta2 (written before 0.999 became the default) resumes only
    as what it was trained with, 0.95; outside (0, 1) it is refused."""
    runs = {name: tmp_path / name for name in ("default", "b95", "b999")}
    for name, beta2 in (("default", None), ("b95", 0.95), ("b999", 0.999)):
        run_train(_cfg(tiny_store, runs[name], steps=3, adam_beta2=beta2))
    weights = {n: (d / "final" / "model.safetensors").read_bytes() for n, d in runs.items()}
    assert weights["default"] == weights["b999"] != weights["b95"]
    assert json.loads((runs["default"] / "config.json").read_text())["train"]["adam_beta2"] == 0.999

    run = tmp_path / "resumed"
    run_train(_cfg(tiny_store, run, steps=4, stop_after=2))
    with pytest.raises(ConfigMismatchError, match="adam_beta2: checkpoint has 0.999, this run has 0.95"):
        run_train(_cfg(tiny_store, run, steps=4, adam_beta2=0.95, resume=True))
    cfg = _cfg(tiny_store, run, steps=4)
    assert cfg.optim.betas == (0.9, 0.999)
    for older in ({k: v for k, v in cfg.to_dict().items() if k != "adam_beta2"}, {**cfg.to_dict(), "adam_beta2": None}):
        assert cfg.resume_diff(older) == ["adam_beta2: checkpoint has 0.95, this run has 0.999"]
        assert _cfg(tiny_store, run, steps=4, adam_beta2=0.95).resume_diff(older) == []
        assert TrainConfig.from_dict(older).optim.betas == (0.9, 0.95)
    with pytest.raises(ValueError, match="--adam-beta2 must be in"):
        _cfg(tiny_store, run, adam_beta2=1.0)


def test_init_from_an_export_starts_from_its_weights(tiny_store, tmp_path):
    """A run started from another run's export holds exactly its weights: at lr 0 (AdamW's decoupled decay is
    lr x wd, so nothing moves) its own export is the same bytes, while a run from the seed differs. A drafter
    of another architecture is refused in one line naming the field and the option that sets it, at the
    command line too (no traceback); so is a folder that holds no export. Stopped and resumed, such a run
    ends as the uninterrupted one does (the resume takes the checkpoint's weights, not the init's again)."""
    from dflash_pipeline.cli import app
    from typer.testing import CliRunner

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    run_train(_cfg(tiny_store, a, steps=3))
    weights = (a / "final" / "model.safetensors").read_bytes()
    run_train(_cfg(tiny_store, b, steps=1, lr=0.0, init_from=str(a / "final")))
    assert (b / "final" / "model.safetensors").read_bytes() == weights
    assert json.loads((b / "config.json").read_text())["train"]["init_from"] == str(a / "final")
    assert json.loads((b / "final" / "config.json").read_text())["dflash_pipeline"]["init_from"] == str(a / "final")
    run_train(_cfg(tiny_store, c, steps=1, lr=0.0))
    assert (c / "final" / "model.safetensors").read_bytes() != weights

    with pytest.raises(DFlashError, match=r"num_layers 1 there, 2 here \(pass --num-layers\)"):
        run_train(_cfg(tiny_store, tmp_path / "d", num_layers=2, init_from=str(a / "final")))
    with pytest.raises(DFlashError, match="not an exported drafter"):
        run_train(_cfg(tiny_store, tmp_path / "e", init_from=str(tmp_path)))
    res = CliRunner().invoke(app, ["train", "--store", tiny_store, "--out", str(tmp_path / "f"), "--device", "cpu",
                                   "--block-size", "8", "--num-layers", "1", "--init-from", str(a / "final")])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "block_size 4 there, 8 here (pass --block-size)" in res.stderr and "\n" not in res.stderr.strip()

    init = dict(steps=4, init_from=str(a / "final"))  # stopped and resumed: the checkpoint's weights, not the init's
    run_train(_cfg(tiny_store, tmp_path / "whole", **init))
    run_train(_cfg(tiny_store, tmp_path / "split", stop_after=2, **init))
    run_train(_cfg(tiny_store, tmp_path / "split", resume=True, **init))
    resumed = (tmp_path / "split" / "final" / "model.safetensors").read_bytes()
    assert resumed == (tmp_path / "whole" / "final" / "model.safetensors").read_bytes() != weights


def test_kl_without_topk_is_refused_but_the_default_recipe_trains_without_it(tmp_path, smollm_dir):
    _, store = extract_tiny_store(tmp_path, smollm_dir, n=6, topk=0, num_features=2)
    with pytest.raises(DFlashError, match="--kl-weight needs the teacher's top-k"):
        run_train(_cfg(store, tmp_path / "r", kl_weight=0.5))
    # the default KL weight applies where the store has a top-k; on this store the run trains without KL
    run_train(_cfg(store, tmp_path / "d", steps=2))
    record = json.loads((tmp_path / "d" / "config.json").read_text())
    assert record["kl_weight"] == 0.0 and record["train"]["kl_weight"] is None


def test_default_recipe_is_the_measured_one(tiny_store, tmp_path):
    """No loss option given: CE + 15% KL to the stored top-k + CAP 0.1 + feature noise 0.2, the recipe
    that beat CE alone on every eval set (BENCHMARKS.md); the run record says what it used."""
    run_train(_cfg(tiny_store, tmp_path / "run", steps=2))
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    assert record["kl_weight"] == 0.15
    assert record["train"]["cap_weight"] == 0.1 and record["train"]["feature_noise"] == 0.2
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if m.get("type") == "train"]
    assert train and all(m["kl"] > 0 and "cap" in m for m in train)
    # the absolute noise against this store's features: each layer's RMS from the decoded samples themselves
    reader = StoreReader(tiny_store)
    sq = sum(reader.read_sample(i, dtype=torch.float32).hidden_TLH.square().sum(0) for i in range(reader.num_samples))
    rms = (sq.sum(-1) / (reader.num_tokens * reader.meta.target.hidden_size)).sqrt()
    np.testing.assert_allclose(record["feature_noise_over_rms"], (0.2 / rms).tolist(), rtol=0.02)


def test_noise_far_above_its_measured_scale_is_called_out(tiny_store):
    from dflash_pipeline.train.from_store import noise_scale

    per_unit, _ = noise_scale(1.0, StoreReader(tiny_store))        # 1 / RMS per layer
    mild, text = noise_scale(0.05 / max(per_unit), StoreReader(tiny_store))
    assert max(mild) == pytest.approx(0.05) and "of the features' RMS by layer" in text and "warning" not in text
    strong, text = noise_scale(0.5 / max(per_unit), StoreReader(tiny_store))
    assert strong == pytest.approx([10 * r for r in mild])
    assert "warning: the default was measured at 0.3%-6.5%" in text
    suggested = float(text.split("(--feature-noise ")[1].split()[0])
    assert max(noise_scale(suggested, StoreReader(tiny_store))[0]) == pytest.approx(0.065, rel=0.01)


def test_anchor_coverage_counts_the_positions_the_sampler_draws(tiny_store):
    """The share `--max-anchors` covers is the sampler's own: min(A, candidates) over the candidates of every
    sample (p and p+1 supervised), read from the loss masks; a dense setting is called out with fewer anchors
    over proportionally more tokens per batch, a sparse one is not."""
    from dflash_pipeline.train.blocks import anchor_candidates
    from dflash_pipeline.train.from_store import DENSE_ANCHOR_COVERAGE, anchor_coverage

    reader = StoreReader(tiny_store)
    cand = []
    for i in range(reader.num_samples):
        mask = torch.from_numpy(np.asarray(reader.read_sample(i).loss_mask_T))
        cand.append(int(anchor_candidates(mask, torch.zeros(len(mask), dtype=torch.long)).sum()))
    cand = np.asarray(cand)
    for a in (4, 16, 10_000):
        cov, text = anchor_coverage(a, 256, reader)
        assert cov == pytest.approx(np.minimum(cand, a).sum() / cand.sum(), abs=0.05), a
        assert f"up to {a} a sample, {cov:.0%} of the supervised positions" in text
    dense, text = anchor_coverage(10_000, 256, reader)
    assert dense == pytest.approx(1.0, abs=0.05) and "try --max-anchors" in text
    fewer, tokens = (int(x) for x in text.split("try --max-anchors ")[1].split(" --tokens-per-batch "))
    sparse, sparse_text = anchor_coverage(fewer, tokens, reader)
    assert fewer < int(np.median(cand)) and sparse <= DENSE_ANCHOR_COVERAGE and tokens > 256 and tokens % 256 == 0
    assert "try" not in sparse_text and "try" not in anchor_coverage(4, 256, reader)[1]


class _Supervised:
    """A store reader's one column that resolve_batch reads: supervised tokens per sample."""

    def __init__(self, supervised):
        self.supervised = np.asarray(supervised, dtype=np.int64)

    def column(self, name):
        assert name == "supervised"
        return self.supervised


def _naive_plan(supervised, base_anchors=512, dense=0.75, max_factor=4):
    """The auto rule written out sample by sample: anchors drawn = min(A, positions) per sample."""
    cand = [max(s - 1, 0) for s in supervised]
    cover = lambda a: sum(min(c, a) for c in cand) / sum(cand)  # noqa: E731
    med = int(np.median(cand))
    if cover(base_anchors) <= dense or med < 32:
        return base_anchors, 1
    fewer = 16
    while fewer * 2 <= med // 4:   # the largest power of two at most a quarter of the median (at least 16)
        fewer *= 2
    if fewer >= base_anchors:
        return base_anchors, 1
    factor = max(1, min(max_factor, round(cover(base_anchors) / cover(fewer))))
    return (fewer, factor) if factor > 1 else (base_anchors, 1)


@pytest.mark.parametrize("supervised", [
    [266] * 50 + [150, 400, 900],                        # the 40,000-question store's ~265 positions: 64 over 4x
    list(range(200, 340)),
    list(np.random.default_rng(0).integers(2, 3000, 300)),   # mixed lengths
    [3072] * 20,                                        # long samples: the paper's 512 over 4 rows
    [20] * 30,                                          # too short to thin
    [700] * 10 + [40] * 3,
    [560] * 40,                                         # just above 512 positions: still dense, 128 over 4x
])
def test_auto_anchors_and_batch_follow_the_rule(supervised):
    """--max-anchors and --tokens-per-batch left to the store resolve as the rule written out says; a given
    option is kept; the batch stays whole rows of --max-length."""
    from dflash_pipeline.train.from_store import resolve_batch

    reader = _Supervised(supervised)
    anchors, factor = _naive_plan(supervised)
    cfg, note = resolve_batch(TrainConfig(store="s", out="o"), reader)
    assert (cfg.loss.max_anchors, cfg.data.tokens_per_batch) == (anchors, 12288 * factor)
    assert f"{anchors} anchors a sample over {12288 * factor:,} tokens" in note
    assert ("short" in note) == (anchors < 512)
    rows = TrainConfig(store="s", out="o", max_length=1000)
    assert resolve_batch(rows, reader)[0].data.tokens_per_batch == 12 * 1000 * factor
    given_batch = resolve_batch(TrainConfig(store="s", out="o", tokens_per_batch=6144), reader)[0]
    assert (given_batch.loss.max_anchors, given_batch.data.tokens_per_batch) == (anchors, 6144)
    given_anchors = resolve_batch(TrainConfig(store="s", out="o", max_anchors=64), reader)[0]
    assert (given_anchors.loss.max_anchors, given_anchors.data.tokens_per_batch) == (64, 12288)
    both = TrainConfig(store="s", out="o", max_anchors=64, tokens_per_batch=3072)
    assert resolve_batch(both, reader) == (both, None)


def test_the_measured_store_resolves_to_the_winning_recipe():
    """The store the recipe was chosen on (40,000 greedy replies, median ~265 anchor positions a sample)
    gets what won there: 64 anchors over 49,152 tokens (BENCHMARKS.md, 2026-12-05; 128 over 24,576 before)."""
    from dflash_pipeline.train.from_store import resolve_batch

    lengths = np.random.default_rng(1).normal(266, 90, 4000).clip(10, 1024).astype(int)
    cfg, _ = resolve_batch(TrainConfig(store="s", out="o"), _Supervised(lengths))
    assert (cfg.loss.max_anchors, cfg.data.tokens_per_batch) == (64, 49152)


def test_auto_anchors_are_recorded_and_resume(tiny_store, tmp_path):
    """A run that leaves --max-anchors to the store writes the concrete value into config.json and its
    checkpoints, and resumes with the same options left to the store."""
    from dflash_pipeline.train.from_store import resolve_batch

    run = tmp_path / "auto"
    kw = dict(max_anchors=None, steps=4)
    expected = resolve_batch(_cfg(tiny_store, run, **kw), StoreReader(tiny_store))[0].loss.max_anchors
    run_train(_cfg(tiny_store, run, stop_after=2, **kw))
    assert json.loads((run / "config.json").read_text())["train"]["max_anchors"] == expected
    summary = run_train(_cfg(tiny_store, run, resume=True, **kw))
    assert summary["finished"] and summary["step"] == 4


def test_a_run_resumes_with_the_anchors_and_batch_it_began_with(tiny_store, tmp_path):
    """Options left to the store on --resume take the checkpoint's values, not the rule's: a run begun with
    other values (e.g. before the default changed) continues as it began; a given option still has to match."""
    run = tmp_path / "began"
    run_train(_cfg(tiny_store, run, steps=4, stop_after=2, max_anchors=3, tokens_per_batch=384))
    summary = run_train(_cfg(tiny_store, run, steps=4, resume=True, max_anchors=None, tokens_per_batch=None))
    assert summary["finished"] and summary["step"] == 4
    train = json.loads((run / "config.json").read_text())["train"]
    assert (train["max_anchors"], train["tokens_per_batch"]) == (3, 384)
    run_train(_cfg(tiny_store, tmp_path / "other", steps=4, stop_after=2, max_anchors=3))
    with pytest.raises(ConfigMismatchError, match="max_anchors"):
        run_train(_cfg(tiny_store, tmp_path / "other", steps=4, resume=True, max_anchors=5))


def test_training_learns(tiny_store, tmp_path):
    run = tmp_path / "learn"
    summary = run_train(_cfg(tiny_store, run, steps=40, num_layers=2, lr=5e-3, log_every=5))
    losses = _losses(run)
    assert losses[40] < 0.7 * losses[5]
    ev = summary["eval"]
    assert ev["samples"] > 0 and 1.0 <= ev["tau_chain"] <= 4.0 and ev["acc"] > 0.05
    cfg = json.loads((run / "final" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4


def test_two_ddp_processes(tiny_store, tmp_path):
    """Two ranks past two epoch ends: the ranks agree at each whether to estimate (a collective; ranks that
    disagreed would hang), and the first epoch end and the last step estimate."""
    run = tmp_path / "ddp"
    per_epoch = 13   # of this store on two ranks (config.json says so: asserted below)
    summary = run_train(_cfg(tiny_store, run, steps=2 * per_epoch + 1, num_procs=2))
    assert summary["finished"] and summary["step"] == 2 * per_epoch + 1
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["world_size"] == 2 and cfg["steps_per_epoch"] == per_epoch
    assert all(np.isfinite(v) for v in _losses(run).values())
    steps = [r["step"] for r in _records(run, "eval")]
    assert steps[0] == per_epoch and steps[-1] == 2 * per_epoch + 1 and steps == sorted(set(steps))


def test_sigterm_checkpoints_and_resumes(tiny_store, tmp_path):
    run = tmp_path / "sig"
    cmd = [sys.executable, "-m", "dflash_pipeline", "train", "--store", tiny_store, "--out", str(run),
           "--steps", "400", "--num-layers", "1", "--block-size", "4", "--gamma", "3", "--max-anchors", "8", "--tokens-per-batch", "256",
           "--max-length", "128", "--log-every", "1", "--num-workers", "0", "--device", "cpu", "--save-every", "1000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 180
    while time.time() < deadline:
        if (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 2:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert b"continue with --resume" in err
    state = json.loads((run / "checkpoints" / (run / "checkpoints" / "latest").read_text() / "trainer_state.json").read_text())
    assert 2 <= state["step"] < 400


def test_corrupt_segment_skipped_or_strict(tiny_store, tmp_path):
    import shutil

    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    seg = sorted((store / "segments").iterdir())[0]
    (seg / "hidden" / "c" / "0" / "0" / "0").unlink()
    summary = run_train(_cfg(str(store), tmp_path / "skip", steps=None, epochs=1.0))
    assert summary["finished"] and len(summary["corrupt_segments_skipped"]) == 1
    assert f"segment {seg.name}" in summary["corrupt_segments_skipped"][0]
    from dflash_pipeline.errors import StoreError

    with pytest.raises(StoreError, match=f"segment {seg.name}"):
        run_train(_cfg(str(store), tmp_path / "strict", steps=None, epochs=1.0, strict=True))


def test_extract_to_and_train_from_s3(tmp_path, smollm_dir, s3_server):
    """Both stages against a real S3-compatible server: extraction writes there, the trainer's worker
    processes stream from there."""
    import uuid

    url = f"s3://dflash-test/{uuid.uuid4().hex}/store"
    extract_tiny_store(tmp_path, smollm_dir, out=url)
    from dflash_pipeline.store.verify import verify_store

    assert verify_store(url).ok
    summary = run_train(_cfg(url, tmp_path / "run", steps=3, num_workers=1, kl_weight=0.2))
    assert summary["finished"] and (tmp_path / "run" / "final" / "model.safetensors").exists()


def test_store_with_other_layer_convention_is_refused(tiny_store, tmp_path):
    import shutil

    store = tmp_path / "store"
    shutil.copytree(tiny_store, store)
    doc = json.loads((store / "zarr.json").read_text())
    doc["attributes"]["dflash"]["layer_convention"] = "hidden_states_index"
    (store / "zarr.json").write_text(json.dumps(doc))
    with pytest.raises(DFlashError, match="convention 'hidden_states_index'"):
        run_train(_cfg(str(store), tmp_path / "run"))


def test_export_records_the_store_layers(tiny_store, tmp_path):
    run = tmp_path / "run"
    run_train(_cfg(tiny_store, run, steps=2))
    cfg = json.loads((run / "final" / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == StoreReader(tiny_store).meta.layer_ids
    assert cfg["num_target_layers"] == 6 and cfg["dflash_config"]["mask_token_id"] == 16
    from dflash_pipeline.cli import app
    from typer.testing import CliRunner

    res = CliRunner().invoke(app, ["export", str(run), str(tmp_path / "exported")])
    assert res.exit_code == 0, res.stderr
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["dflash_config"] == cfg["dflash_config"]


def test_fp8_store_trains(tmp_path, smollm_dir):
    _, store = extract_tiny_store(tmp_path, smollm_dir, n=16, codec="fp8", num_features=2)
    r = StoreReader(store)
    assert r.meta.codec == "fp8"
    seg = r.read_segment(int(r.segment_ids()[0]))
    assert seg.hidden_TLH.dtype == torch.bfloat16 and torch.isfinite(seg.hidden_TLH.float()).all()
    summary = run_train(_cfg(store, tmp_path / "run", steps=3, num_workers=1, kl_weight=0.1))
    assert summary["finished"] and all(np.isfinite(v) for v in _losses(tmp_path / "run").values())


def test_activation_checkpointing_changes_memory_not_numbers(tiny_store, tmp_path):
    """Recomputing layers in backward is a memory/compute trade: same losses and weights."""
    run_train(_cfg(tiny_store, tmp_path / "plain", steps=4, num_layers=2))
    run_train(_cfg(tiny_store, tmp_path / "ckpt", steps=4, num_layers=2, activation_checkpointing=True))
    run_train(_cfg(tiny_store, tmp_path / "some", steps=4, num_layers=2, checkpoint_layers=1))
    a, b, c = _losses(tmp_path / "plain"), _losses(tmp_path / "ckpt"), _losses(tmp_path / "some")
    assert [a[s] for s in range(1, 5)] == pytest.approx([b[s] for s in range(1, 5)], rel=1e-6)
    assert [a[s] for s in range(1, 5)] == pytest.approx([c[s] for s in range(1, 5)], rel=1e-6)
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["train"]["activation_checkpointing"] is True


def test_loader_start_up_is_reported_apart_from_data_wait(tiny_store, tmp_path):
    """The first batch's wait (worker processes starting) is `data_startup_s`, not data wait."""
    run_train(_cfg(tiny_store, tmp_path / "run", steps=2, num_workers=1))
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["type"] == "train"]
    assert train[0]["data_startup_s"] > 0.0
    assert "data_startup_s" not in train[1]
    assert all(0.0 <= r["data_wait_frac"] <= 1.0 for r in train)
    # every record says when it was written; the held-out estimate also what it cost
    evals = [r for r in recs if r["type"] == "eval"]
    assert evals and all(r["seconds"] > 0.0 for r in evals)
    times = [r["time"] for r in recs]
    assert times == sorted(times) and times[-1] - times[0] < 600


def test_no_compile_keeps_every_kernel_eager(tiny_store, tmp_path, monkeypatch):
    """--no-compile reaches both compiled paths: the loss's chunk math (forced on here, also on the CPU)
    and the layers' kernels."""
    import dflash_pipeline.train.kernels as kernels_mod
    import dflash_pipeline.train.loss as loss_mod

    def refuse(*_a, **_k):
        raise AssertionError("a compiled kernel was used")

    monkeypatch.setattr(loss_mod, "COMPILE", "always")
    monkeypatch.setattr(loss_mod, "_compiled_terms", refuse)
    monkeypatch.setattr(kernels_mod, "_compiled_set", refuse)
    assert run_train(_cfg(tiny_store, tmp_path / "eager", steps=2, compile=False))["finished"]
    with pytest.raises(AssertionError, match="compiled kernel"):
        run_train(_cfg(tiny_store, tmp_path / "compiled", steps=2, compile=True))


def test_out_of_memory_is_one_line_and_the_checkpoint_stays(tiny_store, tmp_path, monkeypatch):
    """A step that does not fit the device ends the run with one line naming the step's block tokens and the
    options that cut its memory, exit code 2, no traceback; the checkpoint written before it is intact, and the
    run resumed from it ends as the uninterrupted run does."""
    import dflash_pipeline.train.trainer as trainer_mod
    from dflash_pipeline.cli import app
    from typer.testing import CliRunner

    whole = tmp_path / "whole"
    run_train(_cfg(tiny_store, whole, steps=5))
    real, calls = trainer_mod.run_blocks, {"n": 0}

    def fails_at_step_4(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.99 GiB")
        return real(*args, **kw)

    monkeypatch.setattr(trainer_mod, "run_blocks", fails_at_step_4)
    run = tmp_path / "run"
    args = ["train", "--store", tiny_store, "--out", str(run), "--device", "cpu", "--steps", "5", "--num-layers", "1",
            "--block-size", "4", "--gamma", "3", "--max-anchors", "8", "--tokens-per-batch", "256", "--max-length",
            "128", "--eval-fraction", "0.1", "--save-every", "2", "--num-workers", "0", "--lr", "3e-3",
            "--warmup-ratio", "0", "--quiet"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    line = res.stderr.strip()
    assert "\n" not in line and "out of memory" in line and "in step 4" in line, line
    assert "block tokens in a batch (8 anchors a sample over 256 tokens)" in line and "--activation-checkpointing" in line
    assert "--grad-accum" in line and "step-00000002" in line and "--resume" in line
    monkeypatch.setattr(trainer_mod, "run_blocks", real)
    res = CliRunner().invoke(app, args + ["--resume"])
    assert res.exit_code == 0, res.output
    assert (run / "final" / "model.safetensors").read_bytes() == (whole / "final" / "model.safetensors").read_bytes()



def _measured_as_if(monkeypatch, fits):
    """`--checkpoint-layers auto` measuring on the CPU as on a GPU: the real probe step runs (forward and
    backward of the synthetic largest batch), and `fits(layers, rows)` stands in for the device's memory."""
    from dflash_pipeline.train import memory, trainer

    rows = []

    def batch(shape, **kw):
        rows.append(shape.rows)
        return memory.synthetic_batch(shape, **kw)

    def measure(model, step, *, layers, **kw):
        ok, peak = memory.measure_step(model, step, layers=layers, **kw)
        return (ok and fits(layers, rows[-1]), peak)

    monkeypatch.setattr(trainer, "can_measure", lambda device: True)
    monkeypatch.setattr(trainer, "synthetic_batch", batch)
    monkeypatch.setattr(trainer, "measure_step", measure)


def test_auto_recompute_picks_the_fewest_layers_and_changes_no_numbers(tiny_store, tmp_path, monkeypatch):
    """The memory probe runs real forward/backward passes before training: the run it configures is the run
    with that many layers given, weight for weight, and config.json records what was measured."""
    run_train(_cfg(tiny_store, tmp_path / "given", steps=3, num_layers=3, checkpoint_layers=2))
    _measured_as_if(monkeypatch, lambda layers, rows: layers >= 2)
    run_train(_cfg(tiny_store, tmp_path / "auto", steps=3, num_layers=3))
    assert (tmp_path / "auto" / "final" / "model.safetensors").read_bytes() == \
        (tmp_path / "given" / "final" / "model.safetensors").read_bytes()
    plan = json.loads((tmp_path / "auto" / "config.json").read_text())["memory_plan"]
    assert plan["checkpoint_layers"] == 2 and plan["num_layers"] == 3
    assert [(p["checkpoint_layers"], p["fits"]) for p in plan["probes"]] == [(0, False), (3, True), (2, True), (1, False)]
    assert plan["shape"]["rows"] == 2 and plan["shape"]["block_tokens"] == 2 * plan["shape"]["anchors"] * 4
    # held beside the probe: AdamW's two fp32 moments, and 3 loader batches (its prefetch queue of 2 and the
    # one its thread has staged; the probe's own batch is the step's)
    from safetensors.torch import load_file

    from dflash_pipeline.train.memory import StepShape, batch_bytes
    params = sum(t.numel() for t in load_file(str(tmp_path / "auto" / "final" / "model.safetensors")).values())
    meta = StoreReader(tiny_store).meta
    width = len(meta.layer_ids) * meta.target.hidden_size
    s = plan["shape"]
    batch = batch_bytes(StepShape(s["rows"], s["row_len"], s["anchors"], s["block_size"]), width, meta.topk)
    assert plan["held_bytes"] == 2 * 4 * params + 3 * batch
    # the shape is read from every epoch the run trains (at least two)
    run = json.loads((tmp_path / "auto" / "config.json").read_text())
    assert plan["epochs"] == -(-run["steps_total"] // run["steps_per_epoch"])
    assert plan["epochs_planned"] == max(2, plan["epochs"])
    # given layers, or off the GPU, nothing is measured
    assert json.loads((tmp_path / "given" / "config.json").read_text())["memory_plan"] is None


def test_a_batch_that_fits_no_way_whole_runs_in_chunks_of_rows_as_the_same_step(tiny_store, tmp_path, monkeypatch):
    """Where no recompute fits the whole batch, each batch runs forward and backward one row at a time with the
    fewest layers that fit a row: the same steps as the whole batch (losses and weights), and config.json says
    so. Where not even one row fits, the run stops before its first step, nothing written."""
    run_train(_cfg(tiny_store, tmp_path / "whole", steps=3, num_layers=2, checkpoint_layers=1))
    _measured_as_if(monkeypatch, lambda layers, rows: rows == 1 and layers >= 1)
    run_train(_cfg(tiny_store, tmp_path / "chunked", steps=3, num_layers=2))
    plan = json.loads((tmp_path / "chunked" / "config.json").read_text())["memory_plan"]
    assert (plan["checkpoint_layers"], plan["chunk_rows"], plan["shape"]["rows"]) == (1, 1, 2)
    assert [(p["checkpoint_layers"], p["rows"], p["fits"]) for p in plan["probes"]] == \
        [(0, 2, False), (2, 2, False), (2, 1, True), (0, 1, False), (1, 1, True)]
    whole, chunked = _records(tmp_path / "whole"), _records(tmp_path / "chunked")
    assert len(whole) == len(chunked) == 3
    for key in ("loss", "ce", "kl", "cap", "acc", "streak"):
        assert [r[key] for r in chunked] == pytest.approx([r[key] for r in whole], rel=1e-5), key
    # the fp32 weights of the last checkpoint: the bf16 export rounds, and a sum in another order can put one of
    # 8,192 weights on the other side of a bf16 rounding step (0.7%; seen on one CPU, not on another)
    a, b = (torch.load(tmp_path / run / "checkpoints" / "step-00000003" / "model.pt") for run in ("whole", "chunked"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)

    _measured_as_if(monkeypatch, lambda layers, rows: False)
    with pytest.raises(DFlashError, match=r"even one row at a time with all 2 drafter layers recomputed.*pass a "
                                          r"smaller --max-anchors or --max-length"):
        run_train(_cfg(tiny_store, tmp_path / "none", steps=3, num_layers=2))
    assert not (tmp_path / "none" / "checkpoints").exists() and not (tmp_path / "none" / "metrics.jsonl").exists()


def _records(run, kind="train"):
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == kind]


def test_epoch_end_estimates_keep_to_their_share_of_the_run(tiny_store, tmp_path, monkeypatch):
    """--eval-every 0 estimates at epoch ends only while they take at most EPOCH_EVAL_SHARE of the run: a store
    of short epochs once spent a third of a GPU run on them. With the share at 1 every epoch end estimates; at
    ~0 only the first one does; the last step always does."""
    from dflash_pipeline.train import trainer

    per_epoch = 27   # of this store on one rank (config.json says so: asserted below)
    steps = 3 * per_epoch + 1   # three epoch ends inside the run

    def evals(name, share):
        monkeypatch.setattr(trainer, "EPOCH_EVAL_SHARE", share)
        run = tmp_path / name
        run_train(_cfg(tiny_store, run, steps=steps))
        assert json.loads((run / "config.json").read_text())["steps_per_epoch"] == per_epoch
        return [r["step"] for r in _records(run, "eval")]

    assert evals("all", 1.0) == [per_epoch, 2 * per_epoch, 3 * per_epoch, steps]
    assert evals("bounded", 1e-9) == [per_epoch, steps]


def test_the_first_estimate_says_once_when_the_replies_are_not_the_target_s_own(tiny_store, tmp_path):
    """The tiny store holds ShareGPT's replies, which its tiny random target would never have written: the first
    held-out estimate is followed by one line on regenerating them; later estimates do not repeat it."""
    from dflash_pipeline.cli import app
    from typer.testing import CliRunner

    res = CliRunner().invoke(app, [
        "train", "--store", tiny_store, "--out", str(tmp_path / "run"), "--device", "cpu", "--steps", "3",
        "--num-layers", "1", "--block-size", "4", "--gamma", "3", "--max-anchors", "8", "--tokens-per-batch", "256",
        "--max-length", "128", "--eval-fraction", "0.1", "--eval-every", "1", "--num-workers", "0",
        "--eval-tree-budget", "none", "--no-compile"])
    assert res.exit_code == 0, res.output
    evals = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if r.get("type") == "eval"]
    assert len(evals) >= 2 and all(r["target_agreement"] < 0.9 for r in evals)
    assert res.output.count("of the held-out reply tokens are the target's own top-1 choice") == 1, res.output
    assert "dflash generate" in res.output
