"""The lossless rule: exact in fp32; in bf16/fp16 a divergence at a tie (top-2 margin within the dtype's
rounding at that magnitude) is counted, one at a clear margin fails; after a tie the rest is judged
along the speculative path. Constructed logits, no model."""

from __future__ import annotations

import pytest
import torch

from dflash_pipeline.eval.lossless import check_greedy, is_tie, logit_ulp, rule_text, top2_logits


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
    assert is_tie(20.25, 20.0, bf16)                 # two steps: the rule's edge
    assert not is_tie(20.5, 20.0, bf16)              # a clear margin
    assert not is_tie(1.0, 0.9, bf16)                # 0.1 is many ulps at 1.0
    assert not is_tie(5.0, 5.0, torch.float32)       # fp32 is exact: never a tie
    assert "exact" in rule_text(torch.float32) and "ulp" in rule_text(bf16)


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
    c = check_greedy(3, [5, 9], [5, 7], [9.0, 20.5], [1.0, 20.0], torch.bfloat16, _never)
    assert c.failure is not None and c.failure.position == 1 and c.failure.margin == pytest.approx(0.5)


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
