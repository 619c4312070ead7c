"""Training-step benchmark on one GPU: our fused step against a conventional one, and the memory case.

  step      Qwen3-8B-shaped drafter (5 layers, hidden 4096, intermediate 12288, 32/8 heads, vocab
            151,936), rows of 4 x 3,072 tokens, 512 anchors per row, block 16, gamma 7: step time,
            input and block tok/s, peak memory and MFU (model FLOPs without recompute over the step
            time and the 790 TFLOP/s measured bf16 peak), and in the same run the conventional step
            (chunked CE under activation checkpointing: the frozen head runs forward, again in the
            recompute, and once more for the metrics), and the same step with its elementwise chains
            eager (`--no-compile`): what the compiled kernels are worth. Goal: MFU >= 60%.
  memory    hidden 5120, vocab 248,320, intermediate 17,408, 5 layers, block 32, 1,024 anchors,
            one 49,152-token row, KL on: the case that crashed an online pipeline. Goal: peak < 80 GB.
  short     (only when asked) the Qwen3-8B-shaped drafter on samples of 340 tokens packed into rows of 3,072,
            KL on: 512 anchors a sample over 4 rows, 128 over 8 and 64 over 16 (`dflash train`'s store rule
            for such samples, earlier and now): step time and peak memory of each
  smollm2   (only when asked) the SmolLM2-135M-shaped drafter that bench/quality.py trains (hidden 576,
            intermediate 1,536, 9/3 heads of 64, vocab 49,152), same rows, anchors and block: it ran at
            ~47K input tok/s on an H200 (2026-12-02), its step far from compute-bound; with --profile,
            where its time goes (every quality run's training minutes are these steps); and the same
            with 8 layers (the deeper recipe), as a ratio to the 5-layer step.

  auto      (only when asked) `dflash train --checkpoint-layers auto`'s measured choice on the short-sample and
            memory cases: the layers it picks, its search time, and the chosen configuration's steps (they must
            run; the probe's peak should bound theirs)

    python bench/train.py [--only step|memory|smollm2|short|auto] [--steps 10] [--json OUT.json] [--profile KERNELS.txt]
    python bench/train.py --smoke      # tiny shapes on the CPU: checks the script before GPU time
    python bench/train.py --smoke-auto # the same for the auto case's search
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import save_json  # noqa: E402

from dflash_pipeline.train.batch import Batch  # noqa: E402
from dflash_pipeline.train.model import DFlashDrafter, DrafterConfig, DrafterOptions, init_drafter_weights  # noqa: E402
from dflash_pipeline.train.step import Frozen, draw_anchors, run_blocks, step_flops  # noqa: E402

PEAK = 790e12


def make_batch(R: int, S: int, L: int, H: int, V: int, K: int, device, doc_len: int | None = None) -> Batch:
    """R rows of S tokens: one sample a row, or samples of doc_len tokens packed (positions restart in each)."""
    g = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, V, (R, S), device=device, generator=g)
    idx = torch.arange(S, device=device)
    pos, doc = (idx, torch.zeros_like(idx)) if doc_len is None else (idx % doc_len, idx // doc_len)
    return Batch(tokens=tokens, loss_mask=torch.ones(R, S, dtype=torch.bool, device=device),
                 pos=pos[None].expand(R, S).contiguous(), doc=doc[None].expand(R, S).contiguous(),
                 features=torch.randn(R, S, L * H, device=device, dtype=torch.bfloat16, generator=g),
                 topk_ids=torch.randint(0, V, (R, S, K), device=device, generator=g),
                 topk_logprobs=torch.log_softmax(torch.randn(R, S, K, device=device, generator=g), -1), num_tokens=R * S)


def conventional_loss(hidden_NH, head_VH, labels, weights, chunk=2048):
    """The public trainers' approach: chunked CE, each chunk under activation checkpointing, metrics in
    a separate pass. The head runs three times per chunk."""
    from torch.utils.checkpoint import checkpoint

    def ce(h, y, w):
        logits = (h @ head_VH.T).float()
        return (F.cross_entropy(logits, y, reduction="none") * w).sum()

    total = hidden_NH.new_zeros((), dtype=torch.float32)
    correct = 0
    for a in range(0, hidden_NH.shape[0], chunk):
        h, y, w = hidden_NH[a:a + chunk], labels[a:a + chunk], weights[a:a + chunk]
        total = total + checkpoint(ce, h, y, w, use_reentrant=False)
        with torch.no_grad():
            correct += int(((h @ head_VH.T).argmax(-1) == y).sum())
    return total / weights.sum()


def timed_steps(fn, steps: int) -> tuple[float, float]:
    for _ in range(2):
        fn()
    if not torch.cuda.is_available():
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - t) / steps, 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return times[len(times) // 2], torch.cuda.max_memory_allocated() / 2 ** 30


def profile_table(fn, path: str, steps: int = 2) -> None:
    """CUDA kernels of `steps` calls of fn, by total GPU time: where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    with open(path, "w") as f:
        f.write(f"{steps} steps\n")
        f.write(prof.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=90))


def setup(*, H, I, heads, kv, V, B, anchors, R, S, layers=5, head_dim=128, checkpoint_layers=0,
          compiled: bool = True, doc_len: int | None = None):
    """(device, drafter config, drafter, optimizer, frozen head, batch, host-drawn anchors, gamma) of a case."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = DrafterConfig(hidden_size=H, intermediate_size=I, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                        head_dim=head_dim, vocab_size=V, block_size=B, mask_token_id=V - 1,
                        target_layer_ids=[1, 9, 17, 25, 33], num_target_layers=36, rope_theta=1e6)
    # compile_kernels=False also keeps the loss eager (run_blocks)
    model = DFlashDrafter(cfg, DrafterOptions(checkpoint_layers=checkpoint_layers,
                                              compile_kernels=None if compiled else False))
    init_drafter_weights(model)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    head = (torch.randn(V, H, device=device) * 0.02).to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    frozen = Frozen(head, head)
    batch = make_batch(R, S, 5, H, V, 32, device, doc_len)
    gamma = {16: 7.0, 32: 10.0}.get(B, 7.0)
    g = torch.Generator().manual_seed(1)
    anchors = draw_anchors(batch, anchors, g, B)  # on the host, as the trainer draws them
    return device, cfg, model, opt, frozen, batch, anchors, gamma


def bench_case(name: str, *, H, I, heads, kv, V, B, anchors, R, S, kl, steps, layers=5, conventional=True,
               head_dim=128, checkpoint_layers=0, profile: str | None = None, compiled: bool = True,
               doc_len: int | None = None):
    device, cfg, model, opt, frozen, batch, anchors, gamma = setup(
        H=H, I=I, heads=heads, kv=kv, V=V, B=B, anchors=anchors, R=R, S=S, layers=layers, head_dim=head_dim,
        checkpoint_layers=checkpoint_layers, compiled=compiled, doc_len=doc_len)
    head = frozen.head_VH
    g = torch.Generator().manual_seed(1)
    flops = {}

    stages = {"forward+loss": [], "backward": [], "optimizer": []}

    def ours():
        cuda = device.type == "cuda"
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if cuda else None
        opt.zero_grad(set_to_none=True)
        if cuda:
            ev[0].record()
        out = run_blocks(model, frozen, batch, anchors, block_size=B, mask_token_id=cfg.mask_token_id, gamma=gamma,
                         kl_weight=0.15 if kl else 0.0, cap_weight=0.0, feature_noise=0.0, loss_chunk=4096, g=g,
                         autocast=cuda)
        if cuda:
            ev[1].record()
        out.loss.backward()
        if cuda:
            ev[2].record()
        opt.step()
        if cuda:
            ev[3].record()
            ev[3].synchronize()
            for k, name in enumerate(stages):
                stages[name].append(ev[k].elapsed_time(ev[k + 1]) / 1e3)
        flops["f"] = step_flops(cfg, out, R * S)
        flops["block_tokens"] = out.block_tokens

    t, mem = timed_steps(ours, steps)
    if profile:
        profile_table(ours, profile)
    med = {k: sorted(v)[len(v) // 2] if v else None for k, v in stages.items()}
    res = {"case": name, "step_s": t, "peak_gib": mem, "input_tok_s": R * S / t, "stage_s": med,
           "block_tok_s": flops["block_tokens"] / t, "mfu": flops["f"] / t / PEAK, "model_tflops_per_step": flops["f"] / 1e12}
    if conventional:
        from dflash_pipeline.train.blocks import build_blocks

        def conv():
            opt.zero_grad(set_to_none=True)
            blocks = build_blocks(batch.tokens, batch.pos, batch.doc, batch.loss_mask, anchors.to(device), block_size=B,
                                  mask_token_id=cfg.mask_token_id, gamma=gamma)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                hid = model(batch.features, batch.pos, batch.doc, head[blocks.token_ids_RQ], blocks.pos_RQ,
                            blocks.doc_RQ, blocks.block_id_RQ)
            sel = blocks.weights_RQ.reshape(-1) > 0
            loss = conventional_loss(hid.reshape(-1, H)[sel].to(head.dtype), head, blocks.labels_RQ.reshape(-1)[sel],
                                     blocks.weights_RQ.reshape(-1)[sel])
            loss.backward()
            opt.step()

        t2, mem2 = timed_steps(conv, steps)
        res.update(baseline_step_s=t2, baseline_peak_gib=mem2, speedup_vs_baseline=t2 / t)
    return res


def plan_case(name: str, *, kl: bool, steps: int, **shape) -> dict:
    """`dflash train --checkpoint-layers auto` on a case: the trainer's search (train/memory.py) over a synthetic
    batch of the case's step shape, holding what the trainer holds beside a step (AdamW's moments, the loader's
    device batches in flight: `held_bytes`), then the case's real steps with the layers it chose (where the
    batch runs in chunks of rows, the steps of one chunk): whether they ran, and the probe's peak against
    theirs (the probe's should be the larger: every block slot labelled, the held bytes)."""
    import dataclasses

    from dflash_pipeline.train.memory import (Probe, StepShape, batch_bytes, device_budget, held_bytes,
                                              measure_step, search_recompute, synthetic_batch)

    device, cfg, model, opt, frozen, batch, anchors, gamma = setup(**shape)
    st = StepShape(rows=shape["R"], row_len=shape["S"], anchors=anchors.shape[1], block_size=shape["B"])
    width, K = cfg.num_features * cfg.hidden_size, batch.topk_ids.shape[-1]
    moments = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    del batch, opt
    budget, total = device_budget(device)

    def measure(layers: int, rows: int) -> Probe:
        small = dataclasses.replace(st, rows=rows)

        def step(m):
            b, a = synthetic_batch(small, width=width, topk=K, vocab=cfg.vocab_size, device=device)
            return run_blocks(m, frozen, b, a, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
                              gamma=gamma, kl_weight=0.15 if kl else 0.0, cap_weight=0.0, feature_noise=0.0,
                              loss_chunk=4096, g=None, autocast=device.type == "cuda").loss
        t0 = time.perf_counter()
        held = held_bytes(moments=moments, batch=batch_bytes(st, width, K), chunk=batch_bytes(small, width, K),
                          prefetch=2, grad_accum=1)   # the trainer's loader defaults
        fits, peak = measure_step(model, step, layers=layers, device=device, budget_bytes=budget, held_bytes=held)
        print(f"  probe: {layers} layers recomputed, {rows} rows: "
              + (f"peak {peak / 2 ** 30:.1f} GiB" if peak is not None else "out of memory")
              + f" ({'fits' if fits else 'does not fit'} {budget / 2 ** 30:.1f} GiB), {time.perf_counter() - t0:.1f} s",
              flush=True)
        return Probe(layers, rows, fits, peak, round(time.perf_counter() - t0, 2))

    t0 = time.perf_counter()
    layers, probes, rows = search_recompute(cfg.num_layers, st.rows, measure)
    res = {"case": name, "block_tokens": st.block_tokens, "budget_gib": budget / 2 ** 30, "total_gib": total / 2 ** 30,
           "chosen_layers": layers, "chunk_rows": rows, "search_s": time.perf_counter() - t0,
           "probes": [dataclasses.asdict(p) for p in probes]}
    del model, frozen
    gc.collect()
    torch.cuda.empty_cache()
    chunked = layers is not None and rows < st.rows
    if layers is not None:
        chosen = next(p for p in probes if p.fits and (p.checkpoint_layers, p.rows) == (layers, rows))
        step = bench_case(f"{name}, {layers} layers recomputed (chosen)" + (f", one chunk of {rows} rows" if chunked
                                                                           else ""),
                          kl=kl, steps=steps, conventional=False, checkpoint_layers=layers, **{**shape, "R": rows})
        res.update(step=step, probe_peak_gib=chosen.peak_bytes / 2 ** 30,
                   probe_over_step_peak=chosen.peak_bytes / 2 ** 30 / max(step["peak_gib"], 1e-9))
    chunks = f" in chunks of {rows} of {st.rows} rows" if chunked else ""
    print(f"{name}: auto chose {layers} layers recomputed{chunks}" + (" (nothing fits)" if layers is None else
          f"; probe peak {res['probe_peak_gib']:.1f} GiB, steps' peak {res['step']['peak_gib']:.1f} GiB, "
          f"{res['step']['step_s'] * 1e3:.0f} ms/step") + f"; search {res['search_s']:.0f} s", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["step", "memory", "smollm2", "short", "auto"], default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, help="write the step's CUDA kernels by GPU time to this file")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU is fine): check the script runs")
    ap.add_argument("--smoke-auto", action="store_true", help="the auto case's search on tiny shapes (CPU is fine)")
    args = ap.parse_args()
    out = {"date": time.strftime("%Y-%m-%d"),
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "results": []}
    if args.smoke:
        out["results"].append(bench_case("smoke", H=128, I=256, heads=4, kv=2, V=500, B=16, anchors=8, R=2, S=64,
                                         kl=True, steps=2, layers=2, head_dim=32, profile=args.profile,
                                         doc_len=24))
        print(out["results"])
        return
    if args.smoke_auto:
        out["auto"] = [plan_case("smoke", H=128, I=256, heads=4, kv=2, V=500, B=16, anchors=8, R=2, S=64, kl=True,
                                 steps=2, layers=2, head_dim=32, doc_len=24)]
        print(out["auto"])
        return
    if args.only in (None, "step"):
        out["results"].append(bench_case("qwen3-8b drafter, 4x3072, 512 anchors, B=16", H=4096, I=12288, heads=32,
                                         kv=8, V=151936, B=16, anchors=512, R=4, S=3072, kl=False, steps=args.steps,
                                         profile=args.profile))
        # The same step with the elementwise chains and the loss's softmax left to eager PyTorch: what
        # the compiled kernels are worth, measured in the same run.
        out["results"].append(bench_case("the same, eager elementwise (no compiled kernels)", H=4096, I=12288,
                                         heads=32, kv=8, V=151936, B=16, anchors=512, R=4, S=3072, kl=False,
                                         steps=args.steps, conventional=False, compiled=False))
        out["results"][-1]["compiled_speedup"] = out["results"][-1]["step_s"] / out["results"][-2]["step_s"]
    if args.only == "smollm2":
        out["results"].append(bench_case("smollm2-135m drafter, 4x3072, 512 anchors, B=16", H=576, I=1536, heads=9,
                                         kv=3, V=49152, B=16, anchors=512, R=4, S=3072, kl=False, steps=args.steps,
                                         head_dim=64, profile=args.profile))
        # bench/quality.py's deeper recipe (kl15-cap-noise-l8): what 3 more layers cost per step
        out["results"].append(bench_case("smollm2-135m drafter, 8 layers", H=576, I=1536, heads=9, kv=3, V=49152,
                                         B=16, anchors=512, R=4, S=3072, kl=False, steps=args.steps, layers=8,
                                         head_dim=64, conventional=False))
        out["results"][-1]["step_over_5_layers"] = out["results"][-1]["step_s"] / out["results"][-2]["step_s"]
    if args.only == "short":
        # `dflash train`'s store rule on reply-length samples (340 tokens packed into rows of 3,072), the
        # Qwen3-8B-shaped drafter with KL on: the paper's 512 anchors a sample over 4 rows (nearly every
        # position), the rule's earlier 128 over 8 rows and its current 64 over 16 (BENCHMARKS.md, 2026-12-05):
        # step time and peak memory per configuration, same run
        for anchors, rows, ckpt in ((512, 4, 0), (128, 8, 0), (64, 16, 0), (64, 16, 5)):
            torch.cuda.empty_cache()
            case = f"short samples (340 tokens): {anchors} anchors a sample over {rows}x3072" + (
                f", {ckpt} layers checkpointed" if ckpt else "")
            try:
                out["results"].append(bench_case(case, H=4096, I=12288, heads=32, kv=8, V=151936, B=16,
                                                 anchors=anchors, R=rows, S=3072, kl=True, steps=args.steps,
                                                 conventional=False, doc_len=340, checkpoint_layers=ckpt))
            except torch.OutOfMemoryError as e:   # a finding here, not a failure: the next case still runs
                out["results"].append({"case": case, "oom": str(e).split(". ")[0]})
                print(f"{case}: out of memory ({out['results'][-1]['oom']})", flush=True)
            gc.collect()
    if args.only == "auto":
        # `--checkpoint-layers auto` on the cases whose recompute was chosen by hand before: the 8B-shaped drafter
        # on short samples (out of memory on 80 GB without recompute, 68 GiB with all 5 layers) and the memory case
        # (65 GiB with none, 52 with 2): what it picks, how long its search takes, and whether the steps then run
        out["auto"] = [
            plan_case("short samples (340 tokens): 64 anchors a sample over 16x3072", H=4096, I=12288, heads=32,
                      kv=8, V=151936, B=16, anchors=64, R=16, S=3072, kl=True, steps=args.steps, doc_len=340),
            plan_case("memory case: H=5120, V=248320, B=32, 1024 anchors, 49152-token row, KL", H=5120, I=17408,
                      heads=40, kv=8, V=248320, B=32, anchors=1024, R=1, S=49152, kl=True,
                      steps=max(3, args.steps // 3))]
        out["results"] = [a["step"] for a in out["auto"] if "step" in a]
    if args.only in (None, "memory"):
        out["results"].append(bench_case("memory case: H=5120, V=248320, B=32, 1024 anchors, 49152-token row, KL",
                                         H=5120, I=17408, heads=40, kv=8, V=248320, B=32, anchors=1024, R=1, S=49152,
                                         kl=True, steps=max(3, args.steps // 3), conventional=False))
        for n, label in ((2, "2 of 5 layers checkpointed (--checkpoint-layers 2)"),
                         (5, "every layer checkpointed (--activation-checkpointing)")):
            torch.cuda.empty_cache()
            out["results"].append(bench_case(f"memory case, {label}", H=5120, I=17408, heads=40, kv=8,
                                             V=248320, B=32, anchors=1024, R=1, S=49152, kl=True,
                                             steps=max(3, args.steps // 3), conventional=False, checkpoint_layers=n))
    torch.cuda.empty_cache()
    for r in out["results"]:
        if "oom" in r:
            continue
        r["model_flops_note"] = "MFU counts model FLOPs only (no recompute)"
        line = (f"{r['case']}: {r['step_s'] * 1e3:.0f} ms/step, {r['input_tok_s']:,.0f} input tok/s, "
                f"{r['block_tok_s']:,.0f} block tok/s, MFU {r['mfu']:.1%}, peak {r['peak_gib']:.1f} GiB")
        if r.get("stage_s") and all(v is not None for v in r["stage_s"].values()):
            line += " [" + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in r["stage_s"].items()) + "]"
        if "compiled_speedup" in r:
            line += f"; compiled kernels are {r['compiled_speedup']:.2f}x faster"
        if "baseline_step_s" in r:
            line += (f"; conventional {r['baseline_step_s'] * 1e3:.0f} ms, {r['baseline_peak_gib']:.1f} GiB "
                     f"-> {r['speedup_vs_baseline']:.2f}x")
        print(line)
    save_json(args.json, out)


if __name__ == "__main__":
    main()
