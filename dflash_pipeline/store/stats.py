"""`dflash store stats`: what is in a store, how well it compresses, and whether the features look sane.

Counts come from the manifest (exact). Sizes, per-layer statistics, codec error and top-k mass come
from the commit markers, which the writer fills from the raw features as they are encoded, so no
segment is decoded here. On a large store only a random sample of markers is read (`--sample`), and
the report says so.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np

from dflash_pipeline.errors import CorruptSegmentError
from dflash_pipeline.schemas.store import MANIFEST_KEY, SEGMENTS_PREFIX, TARGET_GROUP, SegmentCommit
from dflash_pipeline.store.manifest import committed_segments, read_commits
from dflash_pipeline.store.reader import StoreReader

HIST_BINS = 20


def incomplete_segments(reader: StoreReader, committed: set[int]) -> list[int]:
    """Segment folders without a commit marker (a crashed or running writer)."""
    out = []
    for name in reader.kv.list_dir(SEGMENTS_PREFIX):
        if name.isdigit() and int(name) not in committed:
            out.append(int(name))
    return sorted(out)


def _chosen_commits(kv, committed: list[int], sample: int | None, seed: int,
                    known: dict[int, SegmentCommit | None] | None) -> tuple[dict[int, SegmentCommit], bool]:
    """The readable markers of every committed segment, or of a random `sample` of them (then True)."""
    chosen = committed
    sampled = sample is not None and 0 < sample < len(committed)
    if sampled:
        chosen = sorted(random.Random(seed).sample(committed, sample))
    missing = [s for s in chosen if known is None or s not in known]
    have = {} if known is None else {s: known[s] for s in chosen if s in known}
    return {s: c for s, c in {**have, **read_commits(kv, missing)}.items() if c is not None}, sampled


def _bytes_per_array(commits: dict[int, SegmentCommit], scale: float) -> dict[str, float]:
    per_array: dict[str, float] = {}
    for c in commits.values():
        for name, a in c.arrays.items():
            per_array[name] = per_array.get(name, 0.0) + a.bytes * scale
    return per_array


def _feature_sums(commits: dict[int, SegmentCommit], L: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], float]:
    """Per-layer sums of the writers' feature statistics and codec error, and the summed top-k mass."""
    sums = {k: np.zeros(L) for k in ("count", "sum", "sumsq", "absmax", "nonfinite")}
    err = {k: np.zeros(L) for k in ("err_sq", "ref_sq", "max_abs")}
    topk_mass = 0.0
    for c in commits.values():
        hs = c.hidden_stats
        for k in sums:
            if k in hs:
                v = np.asarray(hs[k], dtype=np.float64)
                sums[k] = np.maximum(sums[k], v) if k == "absmax" else sums[k] + v
        ce = c.codec_error
        for k in err:
            if k in ce:
                v = np.asarray(ce[k], dtype=np.float64)
                err[k] = np.maximum(err[k], v) if k == "max_abs" else err[k] + v
        topk_mass += c.topk_mass_sum
    return sums, err, topk_mass


def layer_rms(reader: StoreReader, sample: int = 32, seed: int = 0) -> list[float]:
    """The root mean square of each stored feature layer, from the commit markers of up to `sample`
    segments (no segment is decoded): the scale that an absolute setting such as `--feature-noise` meets."""
    commits, _ = _chosen_commits(reader.kv, committed_segments(reader.kv), sample, seed, None)
    sums, _, _ = _feature_sums(commits, len(reader.meta.layer_ids))
    return [math.sqrt(sq / n) if n > 0 else 0.0 for sq, n in zip(sums["sumsq"], sums["count"])]


def _layer_rows(layer_ids: list[int], sums: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    layers = []
    for j, lid in enumerate(layer_ids):
        n = max(sums["count"][j], 1.0)
        mean = sums["sum"][j] / n
        var = max(sums["sumsq"][j] / n - mean * mean, 0.0)
        layers.append({"layer": lid, "mean": mean, "std": math.sqrt(var), "absmax": sums["absmax"][j],
                       "nonfinite": int(sums["nonfinite"][j])})
    return layers


# Segments read for the share of supervised tokens that are the target's own top-1 (small arrays only)
AGREEMENT_SEGMENTS = 8
# Below this share of the text being the target's own top-1, extract, stats and training point at regeneration
OWN_TEXT_HINT_BELOW = 0.9


def own_text_hint(share: float | None) -> str:
    """Where little of the text is the target's own choice: why that matters and what to do ('' otherwise)."""
    if share is None or share >= OWN_TEXT_HINT_BELOW:
        return ""
    return ("decoding accepts only the target's choices, and replies the target wrote itself (`dflash generate`, "
            "then extract its output) trained drafters to 1.5x the acceptance length (README)")


def target_agreement(reader: StoreReader, segments: list[int], seed: int = 0) -> dict[str, Any] | None:
    """The share of supervised tokens that are the target's own top-1 choice after the text before them (1.0 on
    replies the target wrote greedily), from the tokens and stored top-k of up to AGREEMENT_SEGMENTS random
    segments; None without a teacher top-k."""
    if not reader.meta.topk or not segments:
        return None
    chosen = sorted(random.Random(seed).sample(segments, min(AGREEMENT_SEGMENTS, len(segments))))
    agree = supervised = read = 0
    for seg in chosen:
        try:
            a = reader.read_arrays(seg, ("tokens", "loss_mask", "topk_ids", "sample_offsets"))
        except CorruptSegmentError:
            continue   # `store verify` names it; the statistics come from the segments that read
        read += 1
        tokens, mask, top1 = a["tokens"], a["loss_mask"].astype(bool), a["topk_ids"][:, 0]
        follows = np.ones(len(tokens), dtype=bool)   # a sample's first token follows nothing of its own
        follows[a["sample_offsets"][:-1]] = False
        counted = mask[1:] & follows[1:]
        agree += int((counted & (tokens[1:] == top1[:-1])).sum())
        supervised += int(counted.sum())
    return {"share": agree / supervised if supervised else None, "segments": read, "tokens": supervised}


def compute_stats(url: str, sample: int | None = 256, seed: int = 0,
                  commits: dict[int, SegmentCommit | None] | None = None) -> dict[str, Any]:
    """`commits`: markers already read by the caller (by segment); the ones needed are not read again."""
    reader = StoreReader(url)
    meta = reader.meta
    committed = committed_segments(reader.kv)
    incomplete = incomplete_segments(reader, set(committed))
    commits, sampled = _chosen_commits(reader.kv, committed, sample, seed, commits)

    lengths = reader.column("length") if reader.num_samples else np.zeros(0, dtype=np.int64)
    supervised = reader.column("supervised") if reader.num_samples else np.zeros(0, dtype=np.int64)
    tokens = int(lengths.sum())

    # Sizes: measured on the chosen markers, scaled to the whole store when sampled.
    seen_tokens = sum(c.num_tokens for c in commits.values()) or 1
    all_tokens = sum(c.num_tokens for c in commits.values()) if not sampled else tokens
    scale = (all_tokens / seen_tokens) if sampled else 1.0
    per_array = _bytes_per_array(commits, scale)
    other_bytes = reader.kv.size_prefix(TARGET_GROUP) + (len(reader.kv.get(MANIFEST_KEY) or b""))
    segment_bytes = sum(per_array.values())
    bytes_on_disk = segment_bytes + other_bytes

    L, H = len(meta.layer_ids), meta.target.hidden_size
    raw_hidden = tokens * L * H * 2
    stored_hidden = per_array.get("hidden", 0.0) + per_array.get("hidden_scale", 0.0)

    sums, err, topk_mass = _feature_sums(commits, L)
    rel_err = math.sqrt(err["err_sq"].sum() / err["ref_sq"].sum()) if err["ref_sq"].sum() > 0 else 0.0
    nonfinite = int(sums["nonfinite"].sum() * scale)

    hist_counts, hist_edges = (np.histogram(lengths, bins=HIST_BINS) if len(lengths) else (np.zeros(0), np.zeros(0)))
    return {
        "store": url,
        "format_version": meta.format_version,
        "samples": int(reader.num_samples),
        "tokens": tokens,
        "supervised_tokens": int(supervised.sum()),
        "segments_committed": len(committed),
        "segments_incomplete": len(incomplete),
        "segments_in_manifest": int(len(reader.segment_ids())) if reader.num_samples else 0,
        "manifest_missing": reader.manifest_was_missing,
        "sampled_segments": len(commits) if sampled else None,
        "bytes_on_disk": int(bytes_on_disk),
        "bytes_per_array": {k: int(v) for k, v in sorted(per_array.items())},
        # Per token: what the features cost (segments); the target's frozen tensors are a fixed cost.
        "bytes_per_token": segment_bytes / tokens if tokens else 0.0,
        "target_bytes": int(other_bytes),
        "hidden_bytes_per_token": stored_hidden / tokens if tokens else 0.0,
        "raw_bf16_hidden_bytes_per_token": L * H * 2,
        "compression_ratio": raw_hidden / stored_hidden if stored_hidden else 0.0,
        "codec": meta.codec,
        "codec_params": meta.codec_params,
        "codec_rel_rmse": rel_err,
        "codec_max_abs_error": float(err["max_abs"].max()) if L else 0.0,
        "layer_ids": list(meta.layer_ids),
        "layer_convention": meta.layer_convention,
        "target": meta.target.__dict__,
        "tokenizer": meta.tokenizer.__dict__,
        "topk": meta.topk,
        "data_provenance": meta.data_provenance,
        "topk_mass_mean": topk_mass / seen_tokens if meta.topk and commits else 0.0,
        # supervised tokens that are the target's own top-1: how much of the text the target would have written
        "target_agreement": target_agreement(reader, sorted(commits), seed),
        "nonfinite_values": nonfinite,
        "layers": _layer_rows(meta.layer_ids, sums),
        "length_hist": {"counts": [int(x) for x in hist_counts], "edges": [float(x) for x in hist_edges]},
        "length_mean": float(lengths.mean()) if len(lengths) else 0.0,
        "length_max": int(lengths.max()) if len(lengths) else 0,
    }


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def provenance_text(provenance: list[dict[str, Any]]) -> str:
    """Who wrote the replies the store was extracted from: its own target (`dflash generate`) or not."""
    if not provenance:
        return "replies as in the input (not generated by the target)"
    parts = []
    for p in provenance:
        by, gen = p["generated_by"], p["generation"]
        who = "this target" if p.get("same_target") else f"another target, {by['name_or_path']}"
        sampling = "greedy" if gen["temperature"] == 0 else (
            f"temperature {gen['temperature']:g}, top-p {gen['top_p']:g}, top-k {gen['top_k']}, seed {gen['seed']}")
        parts.append(f"generated by {who} (config {by['config_hash'][:12]}; {sampling}; {gen['turns']} turns, "
                     f"up to {gen['max_new_tokens']} new tokens) in {p['folder']}")
    return "; ".join(parts)


def _agreement_text(a: dict[str, Any] | None) -> str:
    if not a or a.get("share") is None:
        return "unknown (no teacher top-k)"
    hint = own_text_hint(a["share"])
    return (f"{a['share']:.1%} of supervised tokens are the target's top-1 ({a['tokens']:,} tokens of "
            f"{a['segments']} segments)" + (f"; {hint}" if hint else ""))


def render_stats(s: dict[str, Any], console) -> None:
    """The readable report (rich tables + a terminal histogram of sample lengths)."""
    from rich.markup import escape
    from rich.table import Table

    head = Table(title=f"dflash store: {s['store']}", show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    rows = [
        ("samples", f"{s['samples']:,}"),
        ("tokens", f"{s['tokens']:,}"),
        ("supervised tokens", f"{s['supervised_tokens']:,} ({s['supervised_tokens'] / max(s['tokens'], 1):.1%})"),
        ("segments", f"{s['segments_committed']:,} committed, {s['segments_incomplete']:,} incomplete"),
        ("bytes on disk", f"{_fmt_bytes(s['bytes_on_disk'])}: features {s['bytes_per_token']:,.0f} B/token, "
                          f"target tensors and manifest {_fmt_bytes(s['target_bytes'])}"),
        ("hidden states", f"{s['hidden_bytes_per_token']:,.0f} B/token stored vs {s['raw_bf16_hidden_bytes_per_token']:,} "
                          f"raw bf16: {s['compression_ratio']:.2f}x"),
        ("codec", f"{s['codec']} (relative RMS error {s['codec_rel_rmse']:.2%}, max abs {s['codec_max_abs_error']:.3g})"),
        ("layers", f"{s['layer_ids']} ({s['layer_convention']}: HF hidden_states[k+1], before final norm)"),
        ("target", f"{s['target']['name_or_path']} [{s['target']['architecture']}] "
                   f"{s['target']['num_layers']} layers, hidden {s['target']['hidden_size']}, "
                   f"vocab {s['target']['vocab_size']}, {s['target']['dtype']}, config {s['target']['config_hash'][:12]}"),
        ("tokenizer", f"{s['tokenizer']['hash'][:12]} (vocab {s['tokenizer']['vocab_size']}, "
                      f"template {s['tokenizer']['chat_template_hash'][:12] or 'none'})"),
        ("data", provenance_text(s.get("data_provenance") or [])),
        ("teacher top-k", f"k={s['topk']}, mean probability mass covered {s['topk_mass_mean']:.1%}"),
        ("target's own text", _agreement_text(s.get("target_agreement"))),
        ("non-finite values", f"{s['nonfinite_values']:,}"),
    ]
    for k, v in rows:
        head.add_row(k, escape(v))
    console.print(head)
    if s["sampled_segments"] is not None:
        console.print(f"[yellow]sizes and statistics from a random sample of {s['sampled_segments']} of "
                      f"{s['segments_committed']} segments (--sample)[/yellow]")
    if s["manifest_missing"]:
        console.print("[yellow]manifest.parquet is missing (extraction running or interrupted): counts rebuilt "
                      "from commit markers; `dflash store verify --repair` writes it[/yellow]")

    arrays = Table(title="bytes per array", title_justify="left")
    for col in ("array", "bytes", "B/token"):
        arrays.add_column(col, justify="right" if col != "array" else "left")
    for name, b in s["bytes_per_array"].items():
        arrays.add_row(name, _fmt_bytes(b), f"{b / max(s['tokens'], 1):,.1f}")
    console.print(arrays)

    layers = Table(title="hidden states per layer", title_justify="left")
    for col in ("layer", "mean", "std", "absmax", "non-finite"):
        layers.add_column(col, justify="right")
    for l in s["layers"]:
        layers.add_row(str(l["layer"]), f"{l['mean']:.4g}", f"{l['std']:.4g}", f"{l['absmax']:.4g}", str(l["nonfinite"]))
    console.print(layers)

    counts, edges = s["length_hist"]["counts"], s["length_hist"]["edges"]
    if counts:
        console.print(f"sample lengths (mean {s['length_mean']:.0f}, max {s['length_max']})")
        peak = max(counts) or 1
        for i, n in enumerate(counts):
            bar = "█" * int(round(40 * n / peak))
            console.print(f"  {edges[i]:>8.0f}-{edges[i + 1]:<8.0f} {bar} {n}", highlight=False)


def plot_stats(s: dict[str, Any], path: str) -> None:
    """A PNG of the sample-length histogram and the per-layer feature scale."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from dflash_pipeline.errors import DFlashError

        raise DFlashError("--plot needs matplotlib: pip install 'dflash-pipeline[plot]'") from None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    counts, edges = s["length_hist"]["counts"], s["length_hist"]["edges"]
    if counts:
        a.bar(edges[:-1], counts, width=np.diff(edges), align="edge", edgecolor="black")
    a.set_xlabel("sample length (tokens)")
    a.set_ylabel("samples")
    a.set_title(f"{s['samples']:,} samples, {s['tokens']:,} tokens")
    ids = [str(l["layer"]) for l in s["layers"]]
    b.bar(ids, [l["std"] for l in s["layers"]], label="std")
    b.plot(ids, [l["absmax"] for l in s["layers"]], "o-", color="C3", label="absmax")
    b.set_yscale("log")
    b.set_xlabel("layer id")
    b.set_title(f"features per layer ({s['codec']}, {s['compression_ratio']:.2f}x)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
