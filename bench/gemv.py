"""The decode step's matrix products alone: how near the memory-bandwidth bound they can come.

`bench/profile_decode.py` put the GEMMs of a graphed Qwen3-8B-shaped decode step at 4.69 ms for 15.1 GB of
weights (3.2 TB/s, 1.49x the bound at the H200's 4.8 TB/s datasheet figure), so the issue's goal for the
whole step (1.3x) is missed by the products alone. This times, inside one CUDA graph, every product of
the 36 layers and the LM head at the Qwen3-8B shape, for the rows of a decode step (1), a block-16 verify
(16) and `dflash generate`'s step (128), in two layouts over the same weight memory:

  separate  seven products per layer, as transformers' modules run them: q, k, v, o, gate, up, down
  fused     four: q|k|v and gate|up as one product each (their weights are one buffer per layer, of which
            the separate layout's weights are row views: fusing needs no second copy of the weights)

and, for the ceiling the memory system sets, a plain device-to-device copy and a plain read (a sum) of
2 GiB. Reported: ms, TB/s (weight bytes / time) and the ratio to the datasheet bound per layout.

With `--compiled`, two more layouts of the fused products, both from what torch ships, to learn whether a
matrix-vector kernel faster than cuBLAS's is to be had without writing one:

  fused-autotune   the fused products under `torch.compile(mode="max-autotune-no-cudagraphs")`: Inductor's
                   Triton matrix-product templates compete with cuBLAS per shape, the fastest kept
  fused-reduce     each product written as a broadcast multiply and a sum over the inner dimension (fp32
                   accumulation), compiled: Inductor makes one Triton reduction kernel of each, its launch
                   configuration tuned by coordinate descent (a plain read's access pattern; rows <= 16 only,
                   where the product is all weight traffic)

    python bench/gemv.py [--json OUT] [--compiled]    # the GPU
    python bench/gemv.py --smoke                      # tiny, CPU: checks the script
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import save_json  # noqa: E402
from eval import DEVICE, HBM_BYTES_S, QWEN3_8B, SMOKE_QWEN, median_ms  # noqa: E402


def layer_weights(shape: dict, dtype: torch.dtype) -> list[dict[str, torch.Tensor]]:
    """Per layer: the fused buffers (qkv [q+2kv, H], gate_up [2I, H]) and o, down."""
    H, I, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    D = shape.get("head_dim") or H // shape["num_attention_heads"]
    nq, nkv = shape["num_attention_heads"] * D, shape["num_key_value_heads"] * D
    out = []
    for _ in range(L):
        w = {"qkv": torch.empty(nq + 2 * nkv, H), "o": torch.empty(H, nq), "gate_up": torch.empty(2 * I, H),
             "down": torch.empty(H, I)}
        out.append({k: v.to(DEVICE, dtype).normal_(0, 0.02) for k, v in w.items()})
    for w in out:
        w["splits"] = (nq, nkv, nkv, I)
    return out


def reduce_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T as a broadcast multiply and a sum over the inner dimension, both in fp32 (as a matrix product's
    accumulation): under torch.compile one reduction kernel that streams w once in its own dtype (for few rows
    of x); eager, it would materialise an fp32 copy of w (the CPU check only)."""
    return (x.unsqueeze(-2).float() * w.float()).sum(-1).to(x.dtype)


def products(layers, head: torch.Tensor, x: torch.Tensor, fused: bool, linear=F.linear):
    """One step's products, each layer's fed from the same input x (the products are what is timed); fn()
    returns every product's output, in the same order for both layouts. `linear` computes each product."""
    def fn() -> list[torch.Tensor]:
        out = []
        for w in layers:
            nq, nkv, _, I = w["splits"]
            if fused:
                q, k, v = linear(x, w["qkv"]).split([nq, nkv, nkv], dim=-1)
                a = linear(q, w["o"])
                g, u = linear(a, w["gate_up"]).split([I, I], dim=-1)
            else:
                q_w, k_w, v_w = w["qkv"].split([nq, nkv, nkv])  # row views of the fused buffer
                g_w, u_w = w["gate_up"].split([I, I])
                q, k, v = linear(x, q_w), linear(x, k_w), linear(x, v_w)
                a = linear(q, w["o"])
                g, u = linear(a, g_w), linear(a, u_w)
            out += [q, k, v, a, g, u, linear(g, w["down"])]
        return out + [linear(x, head)]
    return fn


def compiled_layouts(layers, head: torch.Tensor, x: torch.Tensor) -> dict[str, object]:
    """The `--compiled` layouts: name -> fn, each compiled for this x's shape (compilation happens at the
    first call, i.e. in graphed()'s warm-up, outside the capture)."""
    import torch._inductor.config as inductor_config

    inductor_config.coordinate_descent_tuning = True
    out = {"fused-autotune": torch.compile(products(layers, head, x, True), mode="max-autotune-no-cudagraphs",
                                           dynamic=False)}
    if x.shape[0] <= 16:
        out["fused-reduce"] = torch.compile(products(layers, head, x, True, linear=reduce_linear), dynamic=False)
    return out


def graphed(fn):
    """fn captured once into a CUDA graph (the step as the runner replays it); fn itself on the CPU."""
    if DEVICE != "cuda":
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up: cuBLAS picks its kernels and workspace outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,128")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--compiled", action="store_true",
                    help="also the fused products compiled by Inductor: autotuned templates, and as reductions")
    a = ap.parse_args()
    shape = SMOKE_QWEN if a.smoke else QWEN3_8B
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    iters = 3 if a.smoke else a.iters
    torch.manual_seed(0)
    layers = layer_weights(shape, dtype)
    head = torch.empty(shape["vocab_size"], shape["hidden_size"], device=DEVICE, dtype=dtype).normal_(0, 0.02)
    weight_bytes = head.numel() * head.element_size() + sum(
        t.numel() * t.element_size() for w in layers for k, t in w.items() if k != "splits")
    bound_ms = weight_bytes / HBM_BYTES_S * 1e3
    res = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
           "shape": "smoke" if a.smoke else "qwen3-8b", "weight_bytes": weight_bytes, "bound_ms": bound_ms, "rows": {}}
    print(f"{res['device']}: {weight_bytes / 1e9:.2f} GB of weights, bound {bound_ms:.3f} ms at 4.8 TB/s", flush=True)

    n = (1 << 30) if not a.smoke else (1 << 16)  # elements: 2 GiB of bf16
    src, dst = torch.empty(n, device=DEVICE, dtype=dtype).normal_(), torch.empty(n, device=DEVICE, dtype=dtype)
    nbytes = n * src.element_size()
    copy_ms = median_ms(graphed(lambda: dst.copy_(src)), iters)
    read_ms = median_ms(graphed(lambda: src.sum(dtype=torch.float32)), iters)
    res["copy_tb_s"] = 2 * nbytes / copy_ms / 1e9
    res["read_tb_s"] = nbytes / read_ms / 1e9
    print(f"copy {res['copy_tb_s']:.2f} TB/s (read + write), read {res['read_tb_s']:.2f} TB/s", flush=True)
    del src, dst

    for R in (int(r) for r in a.rows.split(",")):
        x = torch.randn(R, shape["hidden_size"], device=DEVICE, dtype=dtype)
        row = {}
        layouts = {"separate": products(layers, head, x, False), "fused": products(layers, head, x, True)}
        if a.compiled:
            layouts.update(compiled_layouts(layers, head, x))
        for name, fn in layouts.items():
            ms = median_ms(graphed(fn), iters)
            row[name] = {"ms": ms, "tb_s": weight_bytes / ms / 1e9, "x_bound": ms / bound_ms}
            if name.startswith("fused-"):
                row[name]["vs_fused"] = row["fused"]["ms"] / ms
            print(f"rows {R:4d} {name:14s} {ms:7.3f} ms  {row[name]['tb_s']:.2f} TB/s  {ms / bound_ms:.2f}x the bound"
                  + (f"  {row[name]['vs_fused']:.2f}x cuBLAS's fused" if "vs_fused" in row[name] else ""), flush=True)
        row["fused_speedup"] = row["separate"]["ms"] / row["fused"]["ms"]
        res["rows"][str(R)] = row
        save_json(a.json, res)  # after every row: a part stopped at its limit keeps the rows it finished


if __name__ == "__main__":
    main()
