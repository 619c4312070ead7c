"""Opening a store of 100,000 segments: the reader against listing the commit markers.

Writes a store with a few real segments and a manifest (plus commit markers) for N segments of 8
samples each, then times, in the same run:
  reader    StoreReader(url) + num_samples + segment_ids (root metadata + manifest.parquet);
  baseline  finding the committed segments by listing commits/ (the least a reader without a
            manifest must do; opening each marker would cost far more).

    python bench/store_open.py [--segments 100000] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import save_json  # noqa: E402


def main() -> None:
    import warnings

    warnings.simplefilter("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--segments", type=int, default=100_000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from helpers import write_random_store

    from dflash_pipeline.schemas.store import SegmentCommit
    from dflash_pipeline.store.backends import KV, open_zarr_store
    from dflash_pipeline.store.manifest import committed_segments, manifest_from_commits, write_manifest
    from dflash_pipeline.store.reader import StoreReader

    with tempfile.TemporaryDirectory() as d:
        url = os.path.join(d, "store")
        write_random_store(url, segments=2, manifest=False)
        kv = KV(open_zarr_store(url, read_only=False))
        t = time.perf_counter()
        commits = {}
        root = os.path.join(url, "commits")
        for s in range(args.segments):
            offsets = list(range(0, 8 * 100 + 1, 100))
            c = SegmentCommit(format_version=1, segment=s, writer="bench", created="", num_samples=8,
                              num_tokens=800, num_supervised=480, sample_ids=list(range(s * 8, s * 8 + 8)),
                              sample_offsets=offsets, sample_supervised=[60] * 8, arrays={}, codec="bf16",
                              hidden_stats={}, codec_error={}, topk_mass_sum=0.0)
            commits[s] = c
            if s >= 2:
                with open(os.path.join(root, f"{s:08d}.json"), "wb") as f:
                    f.write(c.to_json())
        write_manifest(kv, manifest_from_commits(commits))
        build = time.perf_counter() - t
        del commits

        def timed(fn, repeat=5):
            best = float("inf")
            for _ in range(repeat):
                t = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t)
            return best

        def open_reader():
            r = StoreReader(url)
            return r.num_samples, len(r.segment_ids())

        n_samples, n_segs = open_reader()
        t_reader = timed(open_reader)
        t_list = timed(lambda: committed_segments(KV(open_zarr_store(url, read_only=True))))
    res = {"date": time.strftime("%Y-%m-%d"), "segments": n_segs, "samples": n_samples, "build_s": build,
           "reader_open_s": t_reader, "baseline_list_commits_s": t_list, "ratio_baseline_over_reader": t_list / t_reader}
    print(json.dumps(res, indent=1))
    print(f"{n_segs:,} segments / {n_samples:,} samples: reader opens in {t_reader * 1e3:.0f} ms; "
          f"listing the commit markers alone takes {t_list * 1e3:.0f} ms ({t_list / t_reader:.1f}x)")
    save_json(args.json, res)


if __name__ == "__main__":
    main()
