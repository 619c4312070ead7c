"""Codec benchmark: encode/decode MB/s per core and bytes per token, for each hidden-state codec.

Features: real hidden states of the embedded model (SmolLM2-135M, default), or with --random-qwen3
activations of a random-weight Qwen3-8B-shaped target on the GPU (where the statistics differ).
Baselines measured in the same run: numcodecs Shuffle + Zstd (the GIL-holding alternative) and plain
zstd without shuffle. Each codec is timed on one thread and on all cores, chunk by chunk (one layer
per chunk, as the store does), plus the full store write path (zarr, sharded, to a temp dir).

    python bench/store_codecs.py [--tokens 16384] [--random-qwen3] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from common import save_json  # noqa: E402

from dflash_pipeline.store.codecs import chunk_tokens, get_codec  # noqa: E402


def real_hidden(tokens: int, layers: list[int]) -> torch.Tensor:
    """[T, L, H] bf16 outputs of the embedded model over embedded ShareGPT conversations."""
    from transformers import AutoTokenizer

    from dflash_pipeline.embedded import embedded_target_dir
    from dflash_pipeline.extract.samples import load_samples
    from dflash_pipeline.extract.target import TargetRunner, load_target

    path = embedded_target_dir()
    tok = AutoTokenizer.from_pretrained(path)
    samples, _ = load_samples(None, tok, 1024, limit=max(8, tokens // 300), workers=1)
    model = load_target(path, torch.float32, "cpu")
    runner = TargetRunner(model, layers, 0)
    out, n = [], 0
    for s in samples:
        ids = torch.from_numpy(s.input_ids.astype(np.int64))[None]
        out.append(runner.run_batch(ids, [ids.shape[1]]).hidden_NLH.bfloat16())
        n += ids.shape[1]
        if n >= tokens:
            break
    return torch.cat(out)[:tokens]


def random_qwen3_hidden(tokens: int) -> torch.Tensor:
    """Layer outputs of a random-weight Qwen3-8B-shaped target (5 DFlash layers) on the GPU."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=8192)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    from dflash_pipeline.extract.target import TargetRunner

    runner = TargetRunner(model.eval(), [1, 9, 17, 25, 33], 0)
    out = []
    for _ in range(max(1, tokens // 4096)):
        ids = torch.randint(0, 151936, (1, 4096))
        out.append(runner.run_batch(ids, [4096]).hidden_NLH.cpu())
    del model
    torch.cuda.empty_cache()
    return torch.cat(out)[:tokens]


def chunks_of(arr: np.ndarray, C: int) -> list[np.ndarray]:
    T, L, _ = arr.shape
    return [np.ascontiguousarray(arr[a:a + C, l]) for l in range(L) for a in range(0, T, C)]


def timed_map(fn, items, threads: int) -> tuple[float, list]:
    t = time.perf_counter()
    if threads == 1:
        res = [fn(x) for x in items]
    else:
        with ThreadPoolExecutor(threads) as pool:
            res = list(pool.map(fn, items))
    return time.perf_counter() - t, res


def bench_compressor(name: str, comp, chunks: list[np.ndarray], raw_bf16_bytes: int, threads: int, repeat: int = 3):
    nbytes = sum(c.nbytes for c in chunks)
    enc1 = min(timed_map(comp.encode, chunks, 1)[0] for _ in range(repeat))
    encn, encoded = min((timed_map(comp.encode, chunks, threads) for _ in range(repeat)), key=lambda x: x[0])
    dec1 = min(timed_map(comp.decode, encoded, 1)[0] for _ in range(repeat))
    stored = sum(len(e) for e in encoded)
    return {"compressor": name, "stored_bytes": stored, "ratio_vs_raw_bf16": raw_bf16_bytes / stored,
            "encode_MBps_1thread": nbytes / enc1 / 1e6, f"encode_MBps_{threads}threads": nbytes / encn / 1e6,
            "decode_MBps_1thread": nbytes / dec1 / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--random-qwen3", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import numcodecs

    numcodecs.blosc.use_threads = False  # parallelism comes from our threads, as in the store
    if args.random_qwen3:
        hidden = random_qwen3_hidden(args.tokens)
        source = "random-weight Qwen3-8B-shaped target, layers [1, 9, 17, 25, 33]"
    else:
        hidden = real_hidden(args.tokens, [1, 8, 14, 20, 27])
        source = "SmolLM2-135M-Instruct (real weights) on embedded ShareGPT, layers [1, 8, 14, 20, 27]"
    T, L, H = hidden.shape
    raw = T * L * H * 2
    results = []
    for codec_name in ("bf16", "fp8"):
        codec = get_codec(codec_name)
        dev = hidden.cuda() if args.random_qwen3 else hidden
        t = time.perf_counter()
        enc = codec.encode(dev)
        if dev.is_cuda:
            torch.cuda.synchronize()
        t_enc = time.perf_counter() - t
        data = enc.data_TLH.cpu().numpy().view(codec.storage_dtype)
        C = chunk_tokens(H, data.dtype.itemsize)
        chunks = chunks_of(data, C)
        comps = [(f"{codec_name}: blosc zstd-1 (store)", __import__("numcodecs").Blosc(
            cname="zstd", clevel=1, shuffle=1 if data.dtype.itemsize > 1 else 0, blocksize=1 << 20))]
        if codec_name == "bf16":
            from numcodecs import Shuffle, Zstd
            from numcodecs.abc import Codec

            class ShuffleZstd(Codec):  # baseline: numcodecs' Shuffle holds the GIL
                codec_id = "shuffle_zstd"

                def __init__(self):
                    self.s, self.z = Shuffle(elementsize=2), Zstd(level=1)

                def encode(self, buf):
                    return self.z.encode(self.s.encode(buf))

                def decode(self, buf, out=None):
                    return self.s.decode(self.z.decode(buf))

            comps += [("bf16: numcodecs Shuffle+Zstd-1 (baseline)", ShuffleZstd()),
                      ("bf16: zstd-1 without shuffle (baseline)", Zstd(level=1))]
        for name, comp in comps:
            r = bench_compressor(name, comp, chunks, raw, args.threads)
            r["codec_encode_MBps"] = raw / t_enc / 1e6
            if codec_name == "fp8":
                r["stored_bytes"] += enc.scale_TL.numel() * 4
                r["ratio_vs_raw_bf16"] = raw / r["stored_bytes"]
                r["rel_rmse"] = float((enc.err_sq_L.sum() / enc.ref_sq_L.sum()).sqrt())
            r["bytes_per_token"] = r["stored_bytes"] / T
            results.append(r)
        # Full store write path (zarr + sharding + CRC32C), one segment, to a temp dir.
        from dflash_pipeline.schemas.store import StoreMeta, TargetInfo, TokenizerInfo
        from dflash_pipeline.store.writer import SegmentArrays, StoreWriter

        with tempfile.TemporaryDirectory() as d:
            meta = StoreMeta(TargetInfo("bench", "x", max(L, 34), H, 10, "bfloat16"), TokenizerInfo("t", 10),
                             list(range(L)), 0, codec_name)
            w = StoreWriter(os.path.join(d, "s"), meta)
            arrays = SegmentArrays(np.zeros(T, np.int32), np.ones(T, bool), np.array([0, T], np.int64),
                                   np.zeros(1, np.int64), data,
                                   None if enc.scale_TL is None else enc.scale_TL.cpu().numpy(),
                                   np.zeros((T, 0), np.int32), np.zeros((T, 0), np.float16))
            t = time.perf_counter()
            marker = w.write_segment(0, arrays)
            t_w = time.perf_counter() - t
            results.append({"compressor": f"{codec_name}: store write_segment (all threads)",
                            "write_MBps_of_raw_bf16": raw / t_w / 1e6,
                            "bytes_per_token": sum(a.bytes for a in marker.arrays.values()) / T})
    report = {"date": time.strftime("%Y-%m-%d"), "host_cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "source": source, "tokens": T, "layers": L, "hidden": H, "raw_bf16_bytes_per_token": L * H * 2,
              "threads": args.threads, "results": results}
    print(json.dumps(report, indent=1))
    print(f"\n{source}: {T} tokens x {L} layers x {H}, raw bf16 {L * H * 2} B/token, {args.threads} threads")
    print(f"{'compressor':52s} {'B/token':>9s} {'ratio':>6s} {'enc MB/s 1t':>11s} {'enc MB/s Nt':>11s} {'dec MB/s 1t':>11s}")
    for r in results:
        if "encode_MBps_1thread" in r:
            print(f"{r['compressor']:52s} {r['bytes_per_token']:9.0f} {r['ratio_vs_raw_bf16']:6.2f} "
                  f"{r['encode_MBps_1thread']:11.0f} {r[f'encode_MBps_{args.threads}threads']:11.0f} {r['decode_MBps_1thread']:11.0f}")
        else:
            print(f"{r['compressor']:52s} {r['bytes_per_token']:9.0f} {'':6s} write {r['write_MBps_of_raw_bf16']:.0f} MB/s of raw bf16")
    save_json(args.json, report)


if __name__ == "__main__":
    main()
