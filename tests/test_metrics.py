"""train/metrics.py: interval sums against the numbers of the steps that went into them."""

from __future__ import annotations

import torch

from dflash_pipeline.train.metrics import IntervalMetrics, render_eval_line, render_train_line
from dflash_pipeline.train.step import StepOut


class _Cfg:
    block_size, hidden_size, intermediate_size, head_dim = 3, 8, 16, 4
    num_heads, num_kv_heads, num_layers, num_features, vocab_size = 2, 1, 1, 2, 10


def _out(loss, correct, count, streak, blocks, topk=((0, 4, 2), (0, 4, 2))):
    t = torch.tensor
    return StepOut(t(loss), t(loss / 2), t(0.0), t(0.0), t(correct, dtype=torch.float64),
                   t(count, dtype=torch.float64), t(streak), t(blocks), 12, 20, 30.0, t([[0]]),
                   t(topk, dtype=torch.float64))


def test_interval_sums_are_means_over_micro_batches_and_ratios_of_totals():
    m = IntervalMetrics(torch.device("cpu"), _Cfg())
    m.add(_out(2.0, [0, 3, 1], [0, 4, 2], 5.0, 2.0), context_tokens=20)
    m.add(_out(4.0, [0, 1, 1], [0, 4, 2], 3.0, 2.0, topk=((0, 2, 1), (0, 3, 2))), context_tokens=20)
    m.add_step(torch.tensor(1.5))
    rec = m.reduce(1, None)
    assert rec["loss"] == 3.0 and rec["ce"] == 1.5
    assert rec["acc"] == 6 / 12 and rec["acc_per_pos"] == [0.5, 0.5]
    assert rec["acc_top4"] == 9 / 12 and rec["acc_top4_per_pos"] == [0.75, 0.75]
    assert rec["acc_top8"] == 11 / 12 and rec["acc_top8_per_pos"] == [0.875, 1.0]
    assert rec["streak"] == 8 / 4 and rec["grad_norm"] == 1.5
    assert rec["input_tok_s"] > 0 and rec["flops_per_s"] > 0
    m.clear()
    assert m.reduce(1, None)["loss"] == 0.0


def test_lines_render_every_number_they_are_given():
    rec = dict(step=3, epoch=0.5, loss=1.25, ce=1.0, kl=0.25, cap=0.0, acc=0.5, acc_top4=0.75, streak=2.0, lr=1e-3, grad_norm=0.7,
               input_tok_s=1500.0, block_tok_s=3000.0, mfu=0.42, data_wait_frac=0.01, peak_mem_gb=12.0, eta_s=75)
    line = render_train_line(rec, 10)
    for part in ("step 3/10", "loss 1.250", "kl 0.250", "MFU 42%", "mem 12.0G", "ETA 1m15s", "1.50K tok/s", "top4 0.750"):
        assert part in line
    assert "cap" not in line
    assert render_eval_line(dict(step=3, loss=1.0, acc=0.5, streak=2.0, tau_chain=2.5, samples=4)) == \
        "eval @ step 3: loss 1.000 acc 0.500 streak 2.00 greedy-chain tau 2.50 (4 samples)"
    judged = dict(step=3, loss=1.0, acc=0.5, streak=2.0, tau_chain=1.96, tau_chain_text=1.68, target_agreement=0.648,
                  samples=4)
    assert "greedy-chain tau 1.96 (against the text 1.68; 65% of it the target's top-1) (4 samples)" in \
        render_eval_line(judged)
    assert "against the text" not in render_eval_line({**judged, "tau_chain_text": 1.96, "target_agreement": 1.0})
