"""The lossless rule: exact in fp32; in bf16/fp16 a divergence at a tie (top-2 margin within the dtype's
rounding at that magnitude) is counted, one at a clear margin fails; after a tie the rest is judged
along the speculative path. Constructed logits, no model: the rule's functions, then the whole of
`evaluate`, its report and the command's exit code on a target whose verify and decode passes differ at
one position by a tie or by a clear margin."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console

from dflash_pipeline.eval.lossless import check_greedy, is_tie, logit_ulp, rule_text, top2_logits
from dflash_pipeline.eval.report import render_report


def test_ulp_matches_the_dtypes_spacing():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for x in (0.3, 1.0, 7.9, 20.0, -33.0, 250.0):
            t = torch.tensor(abs(x), dtype=dtype)
            up = torch.nextafter(t, torch.tensor(float("inf"), dtype=dtype))
            assert logit_ulp(x, dtype) == pytest.approx(float(up - t)), (dtype, x)
    assert logit_ulp(20.0, torch.bfloat16) == 0.125


def test_tie_rule_per_dtype():
    bf16 = torch.bfloat16
    assert is_tie(20.0, 20.0, bf16)                  # exact bf16 tie
    assert is_tie(20.125, 20.0, bf16)                # one bf16 step at that magnitude
    assert is_tie(20.5, 20.0, bf16)                  # four steps: within the passes' measured spread
    assert is_tie(21.0, 20.0, bf16)                  # eight steps
    assert is_tie(21.5, 20.0, bf16)                  # twelve: the rule's edge
    assert not is_tie(21.75, 20.0, bf16)             # fourteen: a clear margin
    assert not is_tie(1.0, 0.9, bf16)                # 0.1 is many ulps at 1.0 (ulp 2^-7)
    assert not is_tie(5.0, 5.0, torch.float32)       # fp32 is exact: never a tie
    assert "exact" in rule_text(torch.float32) and "ulp" in rule_text(bf16)


def test_compiled_passes_have_their_own_measured_tolerance():
    from dflash_pipeline.eval.lossless import TIE_ULPS, TIE_ULPS_COMPILED, tie_ulps_for

    bf16 = torch.bfloat16
    assert tie_ulps_for(False) == TIE_ULPS == 12 and tie_ulps_for(True) == TIE_ULPS_COMPILED == 16
    assert not is_tie(21.75, 20.0, bf16) and is_tie(21.75, 20.0, bf16, TIE_ULPS_COMPILED)   # 14 ulp
    assert is_tie(22.0, 20.0, bf16, 16) and not is_tie(22.125, 20.0, bf16, 16)               # 16: the edge
    assert not is_tie(5.0, 5.0, torch.float32, 16)                                            # fp32 stays exact
    assert "<= 16 ulp" in rule_text(bf16, 16) and "<= 12 ulp" in rule_text(bf16)
    c = check_greedy(3, [5, 9], [5, 7], [9.0, 21.75], [1.0, 20.0], bf16, lambda: ([5, 9], [9.0, 21.75], [1.0, 20.0]),
                     tie_ulps=16)
    assert c.failure is None and len(c.ties) == 1 and c.tie_ulps == 16
    c = check_greedy(3, [5, 9], [5, 7], [9.0, 21.75], [1.0, 20.0], bf16, _never)
    assert c.failure is not None and c.tie_ulps == 12


def _never():
    raise AssertionError("path scores must not be computed without a tie")


def test_equal_outputs_pass_without_scoring():
    c = check_greedy(1, [5, 6, 7], [5, 6, 7], [9.0] * 3, [1.0] * 3, torch.bfloat16, _never)
    assert c.failure is None and c.ties == []


def test_fp32_any_difference_fails_even_at_a_tiny_margin():
    c = check_greedy(3, [5, 6, 8], [5, 6, 7], [9.0, 9.0, 4.0], [1.0, 1.0, 4.0 - 1e-6], torch.float32, _never)
    assert c.failure is not None and c.failure.position == 2 and not c.failure.tie and c.ties == []
    assert (c.failure.spec_token, c.failure.target_token, c.failure.against) == (8, 7, "plain")


def test_bf16_clear_margin_fails():
    c = check_greedy(3, [5, 9], [5, 7], [9.0, 22.0], [1.0, 20.0], torch.bfloat16, _never)
    assert c.failure is not None and c.failure.position == 1 and c.failure.margin == pytest.approx(2.0)


def test_bf16_tie_then_the_speculative_path_is_judged_by_teacher_forcing():
    spec, plain = [5, 9, 4, 2], [5, 7, 7, 7]
    top1, top2 = [9.0, 20.0, 9.0, 9.0], [1.0, 20.0, 1.0, 1.0]
    calls = []

    def path_ok():
        calls.append(1)
        return [5, 9, 4, 2], [9.0, 20.0, 8.0, 8.0], [1.0, 20.0, 1.0, 1.0]

    c = check_greedy(4, spec, plain, top1, top2, torch.bfloat16, path_ok)
    assert c.failure is None and len(c.ties) == 1 and c.ties[0].position == 1 and calls == [1]

    def path_with_second_tie():
        return [5, 9, 3, 2], [9.0, 20.0, 16.0, 8.0], [1.0, 20.0, 15.875, 1.0]

    c = check_greedy(4, spec, plain, top1, top2, torch.bfloat16, path_with_second_tie)
    assert c.failure is None and [t.position for t in c.ties] == [1, 2] and c.ties[1].against == "path"

    def path_with_clear_error():
        return [5, 9, 4, 6], [9.0, 20.0, 8.0, 12.0], [1.0, 20.0, 1.0, 3.0]

    c = check_greedy(4, spec, plain, top1, top2, torch.bfloat16, path_with_clear_error)
    assert c.failure is not None and c.failure.position == 3 and c.failure.against == "path"
    assert (c.failure.spec_token, c.failure.target_token) == (2, 6) and len(c.ties) == 1


def test_top2_logits_reads_values():
    a, b = top2_logits(torch.tensor([[1.0, 3.0, 2.0], [0.5, -1.0, 0.25]]))
    assert a == [3.0, 0.5] and b == [2.0, 0.25]


# ---------------------------------------------------------------- end to end, with constructed logits

V = 32


def _next(t: int) -> int:
    return (3 * t + 1) % V


def _runner_up(t: int) -> int:
    return (3 * t + 2) % V


class TwoPassTarget:
    """A test double of the target whose passes disagree at one position, as bf16 kernels may.

    After token t its greedy choice is _next(t) at logit 20 and the runner-up _runner_up(t) at 20 - margin.
    The one-token decode pass always says so; the passes over several tokens (prefill, verify, teacher
    forcing) swap the two at absolute position `at`."""

    device = torch.device("cpu")

    def __init__(self, dtype: torch.dtype, margin: float, at: int):
        self.dtype, self.margin, self.at = dtype, margin, at
        self.teacher_forced = 0

    def new_cache(self):
        return []

    def crop(self, cache, length):
        del cache[length:]

    def forward(self, ids, start, cache, *, features=False, last_only=False):
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        assert len(cache) == start
        cache += ids
        self.teacher_forced += start == 0 and not last_only
        logits = torch.zeros(len(ids), V)
        for i, t in enumerate(ids):
            best, second = _next(t), _runner_up(t)
            if len(ids) > 1 and start + i == self.at:
                best, second = second, best
            logits[i, best], logits[i, second] = 20.0, 20.0 - self.margin
        return (logits[-1:] if last_only else logits), None


class ChainDrafter:
    """Drafts the decode pass's own chain from the anchor: every draft right except where verify swaps."""

    block_size = 4

    def reset(self):
        pass

    def draft(self, context, anchor, start):
        logits = torch.full((self.block_size - 1, V), -30.0)
        t = anchor
        for k in range(self.block_size - 1):
            t = _next(t)
            logits[k, t] = 30.0
        return logits


PROMPT = [1, 2, 3, 4]
AT = len(PROMPT) + 5  # logits at position 9 predict generated token 6


def _report(dtype, margin, tie_ulps=None):
    from dflash_pipeline.eval.run import evaluate

    target = TwoPassTarget(dtype, margin, AT)
    if tie_ulps is not None:
        target.tie_ulps = tie_ulps
    report = evaluate(target, ChainDrafter(), [(7, PROMPT)], max_new_tokens=20, temperature=0.0,
                      stop_ids=frozenset(), warmup=False)
    return report, target


def _cli_exit(monkeypatch, report) -> tuple[int, str]:
    from typer.testing import CliRunner

    from dflash_pipeline.cli import app
    from dflash_pipeline.eval import run

    monkeypatch.setattr(run, "run_eval", lambda cfg, progress=None: report)
    res = CliRunner().invoke(app, ["eval", "--drafter", "unused", "--json"])
    return res.exit_code, res.stderr


def test_a_bf16_tie_is_counted_and_decoding_goes_on_along_the_speculative_path(monkeypatch):
    report, target = _report(torch.bfloat16, 0.125)  # one bf16 step at 20: within the rule's 12 ulp
    assert report["lossless"] is True and report["mismatches"] == [] and report["num_tie_divergences"] == 1
    (tie,) = report["tie_divergences"]
    assert (tie["prompt"], tie["position"], tie["against"], tie["tie"]) == (7, 6, "plain", True)
    assert tie["margin"] == pytest.approx(0.125) and (tie["top1"], tie["top2"]) == (20.0, 19.875)
    assert tie["spec_token"] != tie["target_token"]
    assert target.teacher_forced == 1  # the rest was judged by one forward along the speculative path
    assert "bfloat16" in report["lossless_rule"] and "ulp" in report["lossless_rule"]
    # tau is measured on the speculative path: the rejection at the tie, full blocks elsewhere
    assert report["generated_tokens"] == 20 and 1 < report["tau"] < 4
    assert report["per_file"][""]["num_tie_divergences"] == 1
    json.dumps(report)
    code, err = _cli_exit(monkeypatch, report)
    assert code == 0 and "error" not in err


def test_a_compiled_targets_wider_gap_is_a_tie_and_the_report_says_which_rule(monkeypatch):
    """14 ulp at 20 (1.75): past the eager passes' 12, within the compiled passes' 16. The target's
    `tie_ulps` (GraphedTarget: by its compile flag) reaches the check, the rule text and the JSON."""
    report, _ = _report(torch.bfloat16, 1.75)
    assert report["lossless"] is False and report["tie_ulps"] == 12 and "<= 12 ulp" in report["lossless_rule"]
    report, target = _report(torch.bfloat16, 1.75, tie_ulps=16)
    assert report["lossless"] is True and report["num_tie_divergences"] == 1 and target.teacher_forced == 1
    assert report["tie_ulps"] == 16 and "<= 16 ulp" in report["lossless_rule"]
    out = io.StringIO()
    render_report(report, Console(file=out, width=200))
    assert "within 16 ulp" in out.getvalue()
    assert _report(torch.float32, 0.125, tie_ulps=16)[0]["tie_ulps"] is None     # fp32: exact, no tolerance


def test_graphed_target_tolerance_follows_its_compile_flag(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash_pipeline.eval import graphed

    class Runner:
        def __init__(self, *a, **kw):
            pass

    monkeypatch.setattr(graphed, "DecodingRunner", Runner)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert graphed.GraphedTarget(model, [0], max_len=8, block_size=4).tie_ulps == 12
    assert graphed.GraphedTarget(model, [0], max_len=8, block_size=4, compile=True).tie_ulps == 16
    assert graphed.GraphedTarget(model, [0], max_len=8, block_size=4, compile="max-autotune").tie_ulps == 16


@pytest.mark.parametrize("dtype, margin", [(torch.bfloat16, 2.0), (torch.float32, 0.125)])
def test_a_clear_margin_or_any_fp32_divergence_fails(monkeypatch, dtype, margin):
    report, target = _report(dtype, margin)
    assert report["lossless"] is False and report["mismatches"] == [7] and report["tie_divergences"] == []
    (d,) = report["mismatch_details"]
    assert (d["position"], d["tie"], d["margin"]) == (6, False, pytest.approx(margin))
    assert target.teacher_forced == 0
    assert ("exact" in report["lossless_rule"]) == (dtype == torch.float32)
    out = io.StringIO()
    render_report(report, Console(file=out, width=150))
    assert "NOT LOSSLESS" in out.getvalue() and "prompt 7: generated token 6" in out.getvalue()
    code, err = _cli_exit(monkeypatch, report)
    assert code == 1 and "differs from the target's at a clear margin on 1 prompt" in err
