"""Two drafters' real tau on the same prompts, paired: is the difference larger than the prompts' noise?

`dflash eval --records FILE` writes one line per prompt (and tree budget) with the tokens each verification
step committed. Given two such files from the same prompts, target and settings, this pairs them by
(file name, row, turn, tree budget) and reports each drafter's pooled tau (committed tokens / steps over all
prompts, as `dflash eval` reports it), their ratio and difference, and a paired bootstrap over prompts: the
same resampled prompts for both drafters, so what the prompts have in common (easy prompts, long prompts)
cancels and only the drafters' difference varies. A 95% interval of the ratio that excludes 1 says the
prompt set separates the two; one that includes it says the difference is within the noise of these prompts.
Per-prompt wins, losses and ties (per-prompt tau) are counted beside it.

At T = 0 both runs decode every prompt to the target's own greedy output, so the paired prompts produced the
same text; where their target tokens differ (another target, dtype or length), the pairing is refused.

    python bench/tau_compare.py A.records.jsonl B.records.jsonl [--names A,B] [--json OUT] [--budget 0] [--common]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

from common import save_json  # noqa: E402

Key = tuple[str, int, int, int]


def read_records(path: str | Path) -> dict[Key, dict[str, Any]]:
    """{(file name, row, turn, tree budget): record} of a `dflash eval --records` file."""
    out: dict[Key, dict[str, Any]] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            key = (Path(r["file"]).name, int(r["sample_id"]), int(r["turn"]), int(r.get("tree_budget", 0)))
            r["committed_per_step"] = [int(c) for c in r["committed_per_step"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: line {n}: not a `dflash eval --records` line ({e})") from None
        if key in out:
            raise ValueError(f"{path}: line {n}: prompt {key} appears twice")
        out[key] = r
    return out


def paired_counts(a: dict[Key, dict], b: dict[Key, dict], budget: int,
                  common: bool = False) -> tuple[list[Key], np.ndarray]:
    """The prompts both files hold at `budget`, and per prompt [committed A, steps A, committed B, steps B].
    Files of other prompt sets are refused, unless `common`: then the prompts both hold (an eval of the first
    40 prompts against one of 80), refused still where they share none."""
    ka = {k for k in a if k[3] == budget}
    kb = {k for k in b if k[3] == budget}
    if common:
        if ka and kb and not ka & kb:
            raise ValueError(f"the two files share no prompt at budget {budget}")
        ka = kb = ka & kb
    if ka != kb:
        only_a, only_b = sorted(ka - kb)[:3], sorted(kb - ka)[:3]
        raise ValueError(f"the two files hold different prompts at budget {budget}: {len(ka - kb)} only in the "
                         f"first (e.g. {only_a}), {len(kb - ka)} only in the second (e.g. {only_b})")
    if not ka:
        raise ValueError(f"no prompts at tree budget {budget}")
    keys = sorted(ka)
    rows = []
    for k in keys:
        ta, tb = a[k].get("target_tokens"), b[k].get("target_tokens")
        if ta is not None and tb is not None and ta != tb:
            raise ValueError(f"prompt {k}: the target's own output differs between the two runs (another target, "
                             "dtype or --max-new-tokens?): their taus are not comparable")
        ca, cb = a[k]["committed_per_step"], b[k]["committed_per_step"]
        rows.append([sum(ca), len(ca), sum(cb), len(cb)])
    return keys, np.asarray(rows, dtype=np.float64)


def compare(counts: np.ndarray, *, boot: int = 10_000, seed: int = 0) -> dict[str, Any]:
    """Pooled taus, ratio B/A and difference B-A with paired-bootstrap 95% intervals, from per-prompt counts."""
    ca, sa, cb, sb = counts.T
    tau_a, tau_b = ca.sum() / sa.sum(), cb.sum() / sb.sum()
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(counts), size=(boot, len(counts)))
    ba = ca[idx].sum(1) / sa[idx].sum(1)
    bb = cb[idx].sum(1) / sb[idx].sum(1)
    ratio, diff = bb / ba, bb - ba
    per_a, per_b = ca / np.maximum(sa, 1), cb / np.maximum(sb, 1)
    lo, hi = np.percentile(ratio, [2.5, 97.5])
    return {
        "prompts": int(len(counts)), "steps": [int(sa.sum()), int(sb.sum())],
        "tau": [float(tau_a), float(tau_b)],
        "ratio": float(tau_b / tau_a), "ratio_ci95": [float(lo), float(hi)],
        "diff": float(tau_b - tau_a), "diff_ci95": [float(x) for x in np.percentile(diff, [2.5, 97.5])],
        "p_b_above_a": float((ratio > 1).mean()),
        "separated": bool(lo > 1 or hi < 1),
        "per_prompt": {"b_wins": int((per_b > per_a).sum()), "a_wins": int((per_a > per_b).sum()),
                       "ties": int((per_a == per_b).sum())},
        "bootstrap": {"samples": boot, "seed": seed},
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--names", default="A,B", help="the two drafters' names, comma-separated")
    ap.add_argument("--budget", type=int, default=0, help="the tree budget to compare (0: the chain)")
    ap.add_argument("--boot", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--common", action="store_true", help="pair the prompts both files hold (e.g. the first 40 "
                    "prompts of an 80-prompt eval); without it files of other prompt sets are refused")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    names = a.names.split(",")
    if len(names) != 2:
        raise SystemExit("--names: two names, comma-separated")
    try:
        keys, counts = paired_counts(read_records(a.a), read_records(a.b), a.budget, common=a.common)
    except (OSError, ValueError) as e:  # the user's files: one line, no traceback
        raise SystemExit(str(e)) from None
    res = {"names": names, "files": [a.a, a.b], "budget": a.budget, "common": a.common,
           **compare(counts, boot=a.boot, seed=a.seed)}
    save_json(a.json, res)
    (na, nb), (ta, tb) = names, res["tau"]
    lo, hi = res["ratio_ci95"]
    print(f"{len(keys)} prompts, budget {a.budget}: tau {na} {ta:.3f}, {nb} {tb:.3f}; {nb}/{na} {res['ratio']:.3f} "
          f"(95% paired bootstrap {lo:.3f}-{hi:.3f}: {'separated' if res['separated'] else 'within the noise'}); "
          f"per prompt {nb} better on {res['per_prompt']['b_wins']}, {na} on {res['per_prompt']['a_wins']}, "
          f"equal on {res['per_prompt']['ties']}")


if __name__ == "__main__":
    main()
