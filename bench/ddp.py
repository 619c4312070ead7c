"""Data-parallel scaling of the training step: tok/s on N GPUs (DDP) over one GPU, in one run.

The step of `bench/train.py` (Qwen3-8B-shaped drafter, 4 x 3,072-token rows, 512 anchors, block 16,
fused loss, compiled kernels) plus what the trainer adds (gradient clipping, fused AdamW), on one GPU
without DDP (the baseline), then on N GPUs under DDP in several all-reduce configurations: bucket
sizes (`dflash train --ddp-bucket-mb`) and, for reference, bf16-compressed gradients (not what the
trainer does: it reduces fp32 gradients). Synthetic batches, so the loader is not measured here (the
train-store part of gpu_all.sh measures it).

    python bench/ddp.py [--gpus 2] [--steps 10] [--buckets 25,100,400] [--json OUT.json]
    python bench/ddp.py --smoke     # CPU, gloo, tiny shapes: checks the script
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import save_json  # noqa: E402

from dflash_pipeline.launch import free_port  # noqa: E402

SHAPE = dict(H=4096, I=12288, heads=32, kv=8, V=151936, B=16, anchors=512, R=4, S=3072, layers=5, head_dim=128)
SMOKE = dict(H=128, I=256, heads=4, kv=2, V=500, B=16, anchors=8, R=2, S=64, layers=2, head_dim=32)


def worker(rank: int, world: int, port: int, variants: list[tuple[str, float | None, bool]], steps: int,
           shape: dict, results) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from train import make_batch

    from dflash_pipeline.train.model import DFlashDrafter, DrafterConfig, init_drafter_weights
    from dflash_pipeline.train.step import Frozen, draw_anchors, run_blocks

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    s = shape
    cfg = DrafterConfig(hidden_size=s["H"], intermediate_size=s["I"], num_layers=s["layers"], num_heads=s["heads"],
                        num_kv_heads=s["kv"], head_dim=s["head_dim"], vocab_size=s["V"], block_size=s["B"],
                        mask_token_id=s["V"] - 1, target_layer_ids=[1, 9, 17, 25, 33], num_target_layers=36)
    torch.manual_seed(0)
    model = DFlashDrafter(cfg)
    init_drafter_weights(model)
    model.to(device)
    head = (torch.randn(s["V"], s["H"], device=device) * 0.02).to(torch.bfloat16 if cuda else torch.float32)
    frozen = Frozen(head, head)
    batch = make_batch(s["R"], s["S"], 5, s["H"], s["V"], 32, device)
    g = torch.Generator().manual_seed(1 + rank)  # anchors are drawn on the host
    anchors = draw_anchors(batch, s["anchors"], g, s["B"])
    for name, bucket_mb, bf16 in variants:
        if world > 1:
            kw = {} if bucket_mb is None else {"bucket_cap_mb": bucket_mb}
            net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if cuda else None,
                                                            gradient_as_bucket_view=True, **kw)
            if bf16:
                net.register_comm_hook(None, default_hooks.bf16_compress_hook)
        else:
            net = model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)

        def step(net=net, opt=opt):
            opt.zero_grad(set_to_none=True)
            out = run_blocks(net, frozen, batch, anchors, block_size=s["B"], mask_token_id=cfg.mask_token_id,
                             gamma=7.0, kl_weight=0.0, cap_weight=0.0, feature_noise=0.0, loss_chunk=4096, g=g,
                             autocast=cuda)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        for _ in range(3):
            step()
        times = []
        for _ in range(steps):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        med = sorted(times)[len(times) // 2]
        if world > 1:
            t_all = torch.tensor([med], device=device, dtype=torch.float64)
            dist.all_reduce(t_all, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            med = float(t_all)
        if rank == 0:
            results.put((name, world, med))
        net = opt = step = None  # free the buckets and optimizer state before the next variant
        if cuda:
            torch.cuda.empty_cache()
    if world > 1:
        dist.destroy_process_group()


def run(world: int, variants, steps: int, shape: dict) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.start_processes(worker, args=(world, free_port(), variants, steps, shape, q), nprocs=world, join=True,
                       start_method="spawn")
    out = {}
    while not q.empty():
        name, w, t = q.get()
        out[name] = t
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--buckets", default="25,100,400", help="DDP bucket sizes in MB to compare")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    shape = SMOKE if args.smoke else SHAPE
    tokens = shape["R"] * shape["S"]
    res = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "gpus": args.gpus, "shape": shape, "tokens_per_step_per_gpu": tokens}
    one = run(1, [("single", None, False)], args.steps, shape)["single"]
    res["one_gpu_step_s"] = one
    save_json(args.json, res)
    variants = [(f"bucket {b} MB", float(b), False) for b in args.buckets.split(",")]
    if torch.cuda.is_available():  # the bf16 hook needs NCCL
        variants.append((f"bucket {args.buckets.split(',')[0]} MB, bf16-compressed gradients (reference only)",
                         float(args.buckets.split(",")[0]), True))
    multi = run(args.gpus, variants, args.steps, shape)
    res["variants"] = {}
    print(f"{res['gpu']}: one GPU {one * 1e3:.0f} ms/step, {tokens / one:,.0f} input tok/s")
    for name, t in multi.items():
        speedup = (args.gpus * tokens / t) / (tokens / one)
        res["variants"][name] = {"step_s": t, "tok_per_s": args.gpus * tokens / t, "speedup_vs_1gpu": speedup}
        print(f"  {args.gpus} GPUs, {name}: {t * 1e3:.0f} ms/step, {args.gpus * tokens / t:,.0f} input tok/s, "
              f"{speedup:.3f}x one GPU")
    save_json(args.json, res)


if __name__ == "__main__":
    main()
