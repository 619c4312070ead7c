"""`dflash extract --gpus-per-replica 2` on a real two-GPU host: the target split over two GPUs in one
process must write the same store as the target whole on one GPU.

Builds (or reuses) the random-weight Qwen3-8B-shaped target of `bench/extract.py`, extracts the same
data twice (`--gpus 1`, then `--gpus 2 --gpus-per-replica 2`), and compares every sample of the two
stores: tokens and loss masks exactly, hidden states (relative RMS error and worst element, against
the bf16 rounding of a different summation order), the top-k ids (agreement) and their log-probs.
Also reports each run's throughput (a split target runs its halves one after the other: no speedup is
expected, only that a model too large for one GPU runs at all).

    python bench/replica.py --tokenizer .bench_assets/tokenizer --work /tmp/bench [--tokens 60000] [--json OUT]
    python bench/replica.py --smoke --tokenizer .bench_assets/tokenizer   # CPU: --gpus-per-replica 1 twice
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import extract as xb  # noqa: E402
from common import save_json  # noqa: E402


def compare(a_url: str, b_url: str) -> dict:
    from dflash_pipeline.store.reader import StoreReader

    a, b = StoreReader(a_url), StoreReader(b_url)
    if a.num_samples != b.num_samples:
        raise SystemExit(f"sample counts differ: {a.num_samples} vs {b.num_samples}")
    err2 = ref2 = 0.0
    worst = 0.0
    ids_same = ids_total = 0
    lp_worst = 0.0
    for row in range(a.num_samples):
        sa = a.read_sample(row)
        sb = b.read_sample(b.find_sample(sa.sample_id))
        if not (np.array_equal(sa.tokens_T, sb.tokens_T) and np.array_equal(sa.loss_mask_T, sb.loss_mask_T)):
            raise SystemExit(f"sample {sa.sample_id}: tokens or loss mask differ")
        ha, hb = sa.hidden_TLH.float(), sb.hidden_TLH.float()
        err2 += float((ha - hb).pow(2).sum())
        ref2 += float(ha.pow(2).sum())
        worst = max(worst, float(((ha - hb).abs() / (ha.abs().amax() + 1e-6)).max()))
        ids_same += int((sa.topk_ids_TK[:, 0] == sb.topk_ids_TK[:, 0]).sum())
        ids_total += len(sa.topk_ids_TK)
        lp_worst = max(lp_worst, float(np.abs(sa.topk_logprobs_TK[:, 0].astype(np.float32)
                                              - sb.topk_logprobs_TK[:, 0].astype(np.float32)).max()))
    return {"samples": a.num_samples, "tokens": a.num_tokens, "hidden_rel_rms_error": (err2 / max(ref2, 1e-30)) ** 0.5,
            "hidden_worst_abs_over_max": worst, "top1_id_agreement": ids_same / max(ids_total, 1),
            "top1_logprob_worst_abs_diff": lp_worst}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--work", default="/tmp/dflash-bench")
    ap.add_argument("--tokens", type=int, default=60_000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    from dflash_pipeline.extract.pipeline import run_extract
    from dflash_pipeline.schemas.config import ExtractConfig

    shape = xb.SMOKE if args.smoke else xb.QWEN3_8B
    if args.smoke:
        xb.SMOKE_MODE = True
        args.tokens = min(args.tokens, 20_000)
    os.makedirs(args.work, exist_ok=True)
    target = os.path.join(args.work, "qwen3-8b-random" if not args.smoke else "smoke-random")
    data = os.path.join(args.work, "replica-data.jsonl")
    xb.build_target(target, args.tokenizer, shape)
    xb.write_data(data, args.tokens, seed=3)
    cuda = torch.cuda.is_available()
    split = 2 if cuda and torch.cuda.device_count() >= 2 else 1
    out = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
           "gpus_per_replica": split, "runs": {}}
    stores = {}
    for name, gpus, per in (("whole", 1, 1), ("split", split, split)):
        store = os.path.join(args.work, f"replica-{name}")
        shutil.rmtree(store, ignore_errors=True)
        cfg = ExtractConfig(out=store, target=target, data=[data], max_length=8192, topk=32, codec="bf16",
                            tokens_per_batch=16384, segment_tokens=32768, gpus=str(gpus), gpus_per_replica=per,
                            dtype="bf16" if cuda else "fp32", tokenize_workers=1, device="cuda" if cuda else "cpu",
                            num_procs=None if cuda else 1)
        rec = run_extract(cfg)
        ws = [w for w in rec["workers"] if w.get("tokens")]
        out["runs"][name] = {"gpus": gpus, "gpus_per_replica": per, "tokens": rec["tokens_this_run"],
                             "tok_per_s": sum(w["tokens"] for w in ws) / max(w["seconds"] for w in ws)}
        stores[name] = store
        save_json(args.json, out)
    out["comparison"] = compare(stores["whole"], stores["split"])
    save_json(args.json, out)
    c = out["comparison"]
    print(f"\n{out['gpu']}: --gpus-per-replica {split} against the whole target on one GPU, {c['samples']} samples, "
          f"{c['tokens']:,} tokens: hidden relative RMS error {c['hidden_rel_rms_error']:.2e} (worst element "
          f"{c['hidden_worst_abs_over_max']:.2e} of its sample's max), top-1 ids agree {c['top1_id_agreement']:.4f}, "
          f"top-1 log-prob worst diff {c['top1_logprob_worst_abs_diff']:.3f}; tok/s whole "
          f"{out['runs']['whole']['tok_per_s']:,.0f}, split {out['runs']['split']['tok_per_s']:,.0f}")
    ok = c["hidden_rel_rms_error"] < 2e-2 and c["top1_id_agreement"] > 0.95
    print("same store (within bf16 rounding)" if ok else "STORES DIFFER")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
