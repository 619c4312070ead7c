"""TrainConfig: flat options in, owned sections inside, flat JSON out and back, and the resume rule
(the sections that decide the computation must match; runtime and output may change)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dflash_pipeline.schemas.config import (
    DataConfig, LossConfig, ModelConfig, OptimConfig, OutputConfig, RuntimeConfig, TrainConfig,
)


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(**{"store": "s", "out": "o", **kw})


def test_flat_options_land_in_their_sections():
    cfg = _cfg(lr=1e-3, block_size=8, kl_weight=0.2, max_length=1024, tokens_per_batch=4096, num_workers=3,
               log_every=7, seed=5)
    assert cfg.optim.lr == 1e-3 and cfg.model.block_size == 8 and cfg.loss.kl_weight == 0.2
    assert cfg.data.rows_per_batch == 4 and cfg.data.store == "s" and cfg.runtime.num_workers == 3
    assert cfg.output.log_every == 7 and cfg.output.out == "o" and cfg.seed == 5
    assert cfg.optim.epochs == 1.0   # neither epochs nor steps: one epoch
    with pytest.raises(TypeError, match="unexpected option 'learning_rate'"):
        _cfg(learning_rate=1.0)
    with pytest.raises(TypeError, match="missing"):
        TrainConfig(out="o")
    with pytest.raises(TypeError, match="not both"):
        _cfg(model=ModelConfig(), num_layers=2)


def test_sections_or_options_build_the_same_config():
    by_sections = TrainConfig(model=ModelConfig(num_layers=2), loss=LossConfig(), optim=OptimConfig(steps=9),
                              data=DataConfig(store="s"), runtime=RuntimeConfig(), output=OutputConfig(out="o"))
    assert by_sections == _cfg(num_layers=2, steps=9)
    assert dataclasses.replace(by_sections, seed=3).seed == 3


def test_json_round_trip_is_flat_under_the_option_names():
    cfg = _cfg(swa_layers=[0, 1], sliding_window=64, layers=[1, 9], ema=0.99, steps=10, wandb="proj")
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["swa_layers"] == [0, 1] and d["store"] == "s" and d["activation_checkpointing"] is False
    assert TrainConfig.from_dict(d) == cfg
    fields = {f.name for sec in (ModelConfig, LossConfig, OptimConfig, DataConfig, RuntimeConfig, OutputConfig)
              for f in dataclasses.fields(sec)}
    assert set(d) == fields | {"seed"}   # every option once, nothing else


def test_each_section_validates_its_own_options():
    for kw, needle in [(dict(num_layers=0), "--num-layers"), (dict(max_anchors=0), "--max-anchors"),
                       (dict(kl_weight=2.0), "--kl-weight"), (dict(grad_accum=0), "--grad-accum"),
                       (dict(eval_fraction=1.0), "--eval-fraction"), (dict(checkpoint_layers=-1), "--checkpoint-layers"),
                       (dict(keep_checkpoints=0), "--keep-checkpoints"), (dict(swa_layers=[5]), "--swa-layers"),
                       (dict(device="tpu"), "device must be")]:
        with pytest.raises(ValueError, match=needle):
            _cfg(**kw)


def test_resume_compares_the_computation_not_the_runtime():
    saved = _cfg(steps=10, lr=3e-3).to_dict()
    same_math = _cfg(steps=10, lr=3e-3, num_workers=7, log_every=1, quiet=True, wandb="w", out="elsewhere",
                     eval_every=5, save_every=3, checkpoint_layers=2, compile=False, loss_chunk=512, resume=True)
    assert same_math.resume_diff(saved) == []
    assert _cfg(steps=10, lr=1e-3).resume_diff(saved) == ["lr: checkpoint has 0.003, this run has 0.001"]
    assert _cfg(steps=10, lr=3e-3, seed=1).resume_diff(saved) == ["seed: checkpoint has 0, this run has 1"]
    # a run begun before the loss defaults changed, resumed without the options: the message says what moved
    older = {**saved, "kl_weight": 0.0}
    assert _cfg(steps=10, lr=3e-3).resume_diff(older)[0] == "kl_weight: checkpoint has 0.0, this run has the default"
    diff = _cfg(steps=10, lr=3e-3, store="t", block_size=8, max_anchors=64).resume_diff(saved)
    assert [d.split(":")[0] for d in diff] == ["block_size", "max_anchors", "store"]


def test_loss_defaults_resolve_the_kl_weight_from_the_store():
    loss = LossConfig()
    assert (loss.cap_weight, loss.feature_noise) == (0.1, 0.2)
    assert loss.kl_for(32) == 0.15 and loss.kl_for(0) == 0.0      # no top-k stored: no KL by default
    assert LossConfig(kl_weight=0.0).kl_for(32) == 0.0 and LossConfig(kl_weight=0.4).kl_for(0) == 0.4
    # the unresolved default round-trips, so a resumed run compares like with like
    assert TrainConfig.from_dict(_cfg().to_dict()).loss.kl_weight is None

