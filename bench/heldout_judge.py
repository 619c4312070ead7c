"""The held-out estimate of an exported drafter, judged two ways, next to its real acceptance length.

`dflash train`'s estimate walks held-out samples of the store and judges every drafted slot. Against the
store's text (`tau_chain_text`) it reads low on text the target did not write itself (a draft the target
would accept counts as wrong wherever the text says something else); against the target's own top-1, with
runs censored where the text leaves the target's choice (`tau_chain`, train/heldout.py), it judges as decoding
does. This prints both for a store and a drafter, and with `--real` (a `dflash eval --json` record of the same
drafter on the same prompts) the ratio of each to the real tau.

    python bench/heldout_judge.py --store STORE --drafter DRAFTER_DIR [--new-tokens 256] [--tree-budgets 64]
        [--real chain.json tree64.json] [--json out.json] [--device cpu|cuda]

Made for the store of the eval prompts' own original replies, so that the estimate and the real tau read the
same questions: `python bench/heldout_judge.py first-exchanges prompts-chat.jsonl 80 first80.jsonl` writes the
first user turn and reply of the first 80 conversations (those `dflash eval --num-prompts 80` decodes from),
then `dflash extract --data first80.jsonl --max-length 1024 --layers LAYERS` (the drafter's target layers).
`python bench/heldout_judge.py unseen-exchanges 40000 400 unseen.jsonl` writes instead the 400 train-split
exchanges after the 40,000 a `bench/quality.py --turns each --n 40000` drafter trained on: text of a training
run's own kind that the drafter never saw, for `dflash train --init-from DRAFTER` to estimate in a run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specforge_dflash import exported_heldout_estimate  # noqa: E402  (our estimate of an exported drafter)


def first_exchanges(prompts: str, n: int, out: str) -> int:
    """The first exchange (`quality_data.first_exchange`: the system message if any, the first user turn and its
    reply) of the first `n` conversations of a ShareGPT JSONL file that have one, as `dflash eval` prompts them."""
    from quality_data import first_exchange

    written = 0
    with open(prompts, encoding="utf-8") as f, open(out, "w", encoding="utf-8") as o:
        for line in f:
            conv = first_exchange(json.loads(line))[0] if line.strip() else None
            if conv is None:
                continue
            o.write(json.dumps({"conversations": conv}, ensure_ascii=False) + "\n")
            written += 1
            if written == n:
                break
    return written


def unseen_exchanges(skip: int, n: int, out: str, max_prompt_tokens: int = 512) -> int:
    """Exchanges `skip` .. `skip + n` of the embedded train split as `bench/quality.py --turns each --n SKIP` writes
    them (`quality_data.write_first_exchanges`, the same order and filters): the replies a drafter trained on the
    first `skip` never saw, for a held-out split of a training run's own kind (train-split text, not eval prompts)."""
    from quality_data import write_first_exchanges

    tmp = Path(out).with_suffix(".all.jsonl")
    write_first_exchanges(tmp, None, skip + n, max_prompt_tokens, "each")
    # by "\n" alone: replies hold characters str.splitlines() also breaks at (U+2028, U+0085, ...)
    with open(tmp, encoding="utf-8", newline="\n") as f:
        lines = list(f)
    tmp.unlink()
    with open(out, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(lines[skip:])
    return max(0, len(lines) - skip)


def real_taus(paths: list[str]) -> dict[int, tuple[float, list | None]]:
    """{budget: (real tau, acceptance rate per position)} from `dflash eval --json` records (0: the chain)."""
    out: dict[int, tuple[float, list | None]] = {}
    for path in paths:
        rep = json.loads(Path(path).read_text())
        for b, r in (rep.get("per_budget") or {str(rep.get("tree_budget", 0)): rep}).items():
            out[int(b)] = (r["tau"], r.get("accept_rate_per_position"))
    return out


def _ratio(est: float | None, real: float) -> float | None:
    return round(est / real, 3) if est and real else None


def _count(text: str, usage: str) -> int:
    if not text.isdigit():
        raise SystemExit(f"{text!r} is not a count (a whole number >= 0); usage: {usage}")
    return int(text)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["first-exchanges"]:
        usage = "bench/heldout_judge.py first-exchanges PROMPTS.jsonl N OUT.jsonl"
        if len(argv) != 4:
            raise SystemExit(f"usage: {usage}")
        print(f"{first_exchanges(argv[1], _count(argv[2], usage), argv[3])} conversations -> {argv[3]}")
        return
    if argv[:1] == ["unseen-exchanges"]:
        usage = "bench/heldout_judge.py unseen-exchanges SKIP N OUT.jsonl"
        if len(argv) != 4:
            raise SystemExit(f"usage: {usage}")
        print(f"{unseen_exchanges(_count(argv[1], usage), _count(argv[2], usage), argv[3])} conversations -> {argv[3]}")
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--drafter", required=True, help="an exported drafter folder (dflash train's final/)")
    ap.add_argument("--new-tokens", type=int, default=256, help="walk each reply's first N tokens, as "
                    "`dflash eval --max-new-tokens N` decodes (0: whole replies)")
    ap.add_argument("--rows", type=int, default=0, help="the store's first N samples (0: all)")
    ap.add_argument("--tree-budgets", default="", help="also the tree estimates at these budgets, e.g. 64 "
                    "(`dflash eval --tree-budget N`'s trees, judged both ways)")
    ap.add_argument("--real", nargs="*", default=[], help="`dflash eval --json` outputs of the same drafter on the "
                    "same prompts: the chain's (budget 0) and/or trees' (--tree-budget N), matched by budget")
    ap.add_argument("--json", default=None, help="write the record here")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)

    from dflash_pipeline.store.reader import StoreReader

    budgets = tuple(int(b) for b in a.tree_budgets.split(",") if b.strip())
    reader = StoreReader(a.store)
    rows = np.arange(reader.num_samples if a.rows <= 0 else min(a.rows, reader.num_samples))
    t = time.time()
    # gamma weighs only the loss, which this does not report: the taus and accuracies do not depend on it
    est = exported_heldout_estimate(Path(a.drafter), reader, rows, gamma=7.0, device=torch.device(a.device),
                                    max_anchors=512, loss_chunk=0, new_tokens=a.new_tokens, tree_budgets=budgets)
    rec = {"store": a.store, "drafter": a.drafter, "samples": est["samples"], "seconds": round(time.time() - t, 1),
           **{k: est.get(k) for k in ("tau_chain", "tau_chain_text", "target_agreement", "accept_per_pos", "acc_per_pos")}}
    # per budget (0: the chain): the estimate judged against the target, and against the text
    judged = {0: (est.get("tau_chain"), est.get("tau_chain_text"))}
    for b in budgets:
        rec[f"tau_tree_{b}"] = est.get(f"tau_tree_{b}")
        judged[b] = (est.get(f"tau_tree_{b}"), est.get("text_tau_tree", {}).get(str(b)))
    rec["text_tau_tree"] = est.get("text_tau_tree")
    real = real_taus(a.real)
    if real:
        rec["real"] = {}
        for b, (tau, _) in real.items():
            target_judged, text_judged = judged.get(b, (None, None))   # no estimate at a budget not asked for
            rec["real"][str(b)] = {"real_tau": tau, "ratio_target_judged": _ratio(target_judged, tau),
                                   "ratio_text_judged": _ratio(text_judged, tau)}
        if 0 in real:
            rec["real_accept_per_pos"] = real[0][1]
    text = json.dumps(rec, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
