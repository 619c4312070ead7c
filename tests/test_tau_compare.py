"""bench/tau_compare.py: two drafters' `dflash eval --records` paired by prompt. Its pooled taus are the
eval's own (records written by the eval's record writer, against `summarize`), a drafter equal to itself
is within the noise, one better on every prompt is separated, a difference that flips sign from prompt to
prompt is not, and records of other prompts or another target's output are refused in one line."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_pipeline.eval.lossless import check_greedy
from dflash_pipeline.eval.prompts import Prompt
from dflash_pipeline.eval.report import PromptResult, prompt_record, summarize
from dflash_pipeline.eval.speculative import Generation, Step

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import tau_compare  # noqa: E402


def _result(sid: int, committed: list[int], target: list[int] | None = None) -> PromptResult:
    tokens = target if target is not None else [sid] * 8   # the target's output: the prompt's own, whatever drafts
    spec = Generation(tokens, 1.0, [Step(16, c - 1, c) for c in committed])
    base = Generation(tokens, 2.0, top1=[2.0] * len(tokens), top2=[1.0] * len(tokens))
    check = check_greedy(sid, tokens, tokens, base.top1, base.top2, torch.float32, lambda: None)
    return PromptResult(Prompt("/somewhere/prompts-chat.jsonl", sid, 0, [1, 2]), spec, base, check)


def _write(path: Path, results: list[PromptResult]) -> str:
    path.write_text("".join(json.dumps(prompt_record(r)) + "\n" for r in results))
    return str(path)


def _steps(rng: random.Random, n: int, p: float) -> list[int]:
    """n verification steps, each committing 1 + (accepted drafts), geometric with acceptance p."""
    out = []
    for _ in range(n):
        c = 1
        while c < 16 and rng.random() < p:
            c += 1
        out.append(c)
    return out


def test_pooled_taus_are_the_evals_and_a_drafter_equals_itself(tmp_path):
    rng = random.Random(0)
    a = [_result(i, _steps(rng, rng.randint(5, 40), 0.6)) for i in range(30)]
    b = [_result(i, _steps(rng, rng.randint(5, 40), 0.7)) for i in range(30)]
    fa, fb = _write(tmp_path / "a.jsonl", a), _write(tmp_path / "b.jsonl", b)
    _, counts = tau_compare.paired_counts(tau_compare.read_records(fa), tau_compare.read_records(fb), 0)
    res = tau_compare.compare(counts, boot=2000)
    want = [summarize(x, block_size=16, temperature=0.0, dtype=torch.float32)["tau"] for x in (a, b)]
    assert res["tau"] == pytest.approx(want) and res["ratio"] == pytest.approx(want[1] / want[0])
    lo, hi = res["ratio_ci95"]
    assert lo <= res["ratio"] <= hi

    _, same = tau_compare.paired_counts(tau_compare.read_records(fa), tau_compare.read_records(fa), 0)
    res = tau_compare.compare(same, boot=500)
    assert res["ratio"] == 1 and res["ratio_ci95"] == [1, 1] and not res["separated"]
    assert res["per_prompt"] == {"b_wins": 0, "a_wins": 0, "ties": 30}


def test_better_on_every_prompt_is_separated_and_a_sign_flipping_difference_is_not():
    rng = random.Random(1)
    base = [(rng.randint(50, 400), rng.uniform(2, 4)) for _ in range(60)]   # (steps, tau) per prompt
    a = [[tau * n, n, (tau + 0.1) * n, n] for n, tau in base]                # B: +0.1 on every prompt
    res = tau_compare.compare(np.asarray(a, dtype=np.float64), boot=2000)
    assert res["separated"] and res["ratio_ci95"][0] > 1 and res["per_prompt"]["b_wins"] == 60
    flip = [[tau * n, n, (tau + (0.5 if i % 2 else -0.5)) * n, n] for i, (n, tau) in enumerate(base)]
    res = tau_compare.compare(np.asarray(flip, dtype=np.float64), boot=2000)
    assert not res["separated"] and res["ratio_ci95"][0] < 1 < res["ratio_ci95"][1]
    assert res["per_prompt"]["b_wins"] == res["per_prompt"]["a_wins"] == 30
    # more prompts of the same spread: a narrower interval
    res_half = tau_compare.compare(np.asarray(flip[:20], dtype=np.float64), boot=2000)
    width = lambda r: r["ratio_ci95"][1] - r["ratio_ci95"][0]  # noqa: E731
    assert width(res) < width(res_half)


def test_other_prompts_or_another_targets_output_are_refused_in_one_line(tmp_path):
    a = [_result(i, [3, 2, 1]) for i in range(4)]
    fa = _write(tmp_path / "a.jsonl", a)
    fewer = _write(tmp_path / "fewer.jsonl", a[:3])
    other = _write(tmp_path / "other.jsonl", [*a[:3], _result(3, [3, 2, 1], target=[9] * 7)])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(Path(fa).read_text() + '{"file": "x"}\n')
    script = str(REPO / "bench" / "tau_compare.py")
    for b, words in ((fewer, "1 only in the first"), (other, "the target's own output differs"),
                     (str(bad), "bad.jsonl: line 5: not a `dflash eval --records` line")):
        out = subprocess.run([sys.executable, script, fa, b], capture_output=True, text=True)
        assert out.returncode != 0 and words in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_command_line_prints_and_writes_json(tmp_path):
    rng = random.Random(2)
    a = [_result(i, _steps(rng, 20, 0.5)) for i in range(10)]
    b = [_result(i, _steps(rng, 20, 0.8)) for i in range(10)]
    fa, fb = _write(tmp_path / "a.jsonl", a), _write(tmp_path / "b.jsonl", b)
    out = subprocess.run([sys.executable, str(REPO / "bench" / "tau_compare.py"), fa, fb, "--names", "ours,theirs",
                          "--boot", "500", "--json", str(tmp_path / "c.json")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rec = json.loads((tmp_path / "c.json").read_text())
    assert rec["names"] == ["ours", "theirs"] and rec["prompts"] == 10 and rec["budget"] == 0
    assert f"theirs/ours {rec['ratio']:.3f}" in out.stdout


def test_common_pairs_the_prompts_both_files_hold(tmp_path):
    """--common: an eval of the first prompts against a longer one pairs their shared prompts (the same numbers
    as the longer file cut to them); files that share no prompt are still refused in one line."""
    rng = random.Random(3)
    a = [_result(i, _steps(rng, 20, 0.5)) for i in range(8)]
    b = [_result(i, _steps(rng, 20, 0.7)) for i in range(8)]
    fa, fb_first = _write(tmp_path / "a.jsonl", a), _write(tmp_path / "b5.jsonl", b[:5])
    keys, counts = tau_compare.paired_counts(tau_compare.read_records(fa), tau_compare.read_records(fb_first), 0,
                                             common=True)
    want_keys, want = tau_compare.paired_counts(tau_compare.read_records(_write(tmp_path / "a5.jsonl", a[:5])),
                                                tau_compare.read_records(fb_first), 0)
    assert keys == want_keys and len(keys) == 5 and np.array_equal(counts, want)
    apart = _write(tmp_path / "apart.jsonl", [_result(i, [2, 1]) for i in range(10, 12)])
    out = subprocess.run([sys.executable, str(REPO / "bench" / "tau_compare.py"), fa, apart, "--common"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "share no prompt" in out.stderr and "Traceback" not in out.stderr
