"""Builders shared by the tests: small stores of random features with a known reference."""

from __future__ import annotations

import numpy as np
import torch

from dflash_pipeline.schemas.store import StoreMeta, TargetInfo, TokenizerInfo
from dflash_pipeline.store.manifest import rebuild_manifest
from dflash_pipeline.store.writer import SegmentBuilder, StoreWriter


def make_meta(codec: str = "bf16", layer_ids=(1, 3, 5), hidden: int = 64, vocab: int = 100, topk: int = 4,
              num_layers: int = 8) -> StoreMeta:
    return StoreMeta(
        target=TargetInfo("random-target", "cfg0", num_layers, hidden, vocab, "bfloat16", "LlamaForCausalLM"),
        tokenizer=TokenizerInfo("tok0", vocab, ""),
        layer_ids=list(layer_ids), topk=topk, codec=codec, data_fingerprint="data0",
    )


def random_sample(g: torch.Generator, T: int, L: int, H: int, V: int, K: int):
    tokens = torch.randint(0, V, (T,), generator=g).numpy().astype(np.int32)
    mask = (torch.rand(T, generator=g) > 0.3).numpy()
    hidden = (torch.randn(T, L, H, generator=g) * torch.linspace(0.5, 8, L)[None, :, None]).bfloat16()
    logits = torch.randn(T, V, generator=g)
    lp = torch.log_softmax(logits, -1)
    top = lp.topk(K, dim=-1) if K else None
    ids = top.indices.numpy().astype(np.int32) if K else np.zeros((T, 0), np.int32)
    lps = top.values.numpy().astype(np.float16) if K else np.zeros((T, 0), np.float16)
    return tokens, mask, hidden, ids, lps


def _top1_from_text(tokens: np.ndarray, ids: np.ndarray, share: float, g: torch.Generator) -> np.ndarray:
    """ids [T, K] with the next token of the text moved to rank 0 (kept distinct) at a random `share` of positions."""
    ids = ids.copy()
    follow = (torch.rand(len(tokens), generator=g) < share).numpy()
    for t in np.nonzero(follow[:-1])[0]:
        nxt = tokens[t + 1]
        row = ids[t]
        at = np.nonzero(row == nxt)[0]
        row[at[0] if len(at) else 0] = row[0]
        row[0] = nxt
    return ids


def write_random_store(url: str, *, codec: str = "bf16", segments: int = 3, samples_per_segment: int = 4,
                       hidden: int = 64, layer_ids=(1, 3, 5), vocab: int = 100, topk: int = 4, seed: int = 0,
                       min_len: int = 20, max_len: int = 90, with_target: bool = True, manifest: bool = True,
                       segment_ids=None, top1_is_text: float = 0.0):
    """Write a store of random samples; returns {sample_id: (tokens, mask, hidden, ids, logprobs)}.
    `top1_is_text`: the share of tokens whose stored top-1 is the next token of the text (the target's own
    greedy text where 1.0; the rest random, as on text the target did not write)."""
    meta = make_meta(codec, layer_ids, hidden, vocab, topk)
    writer = StoreWriter(url, meta)
    g = torch.Generator().manual_seed(seed)
    ref = {}
    if with_target:
        writer.write_target({"embed": torch.randn(vocab, hidden, generator=g).bfloat16(),
                             "final_norm": torch.ones(hidden)},
                            {"model_type": "llama", "hidden_size": hidden}, {"tokenizer_config.json": b"{}"})
    for seg in (segment_ids if segment_ids is not None else range(segments)):
        b = SegmentBuilder(writer, seg)
        for i in range(samples_per_segment):
            sid = seg * 1000 + i
            T = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
            s = random_sample(g, T, len(layer_ids), hidden, vocab, topk)
            if top1_is_text and topk:
                s = (s[0], s[1], s[2], _top1_from_text(s[0], s[3], top1_is_text, g), s[4])
            b.add(sid, *s)
            ref[sid] = s
        b.commit()
    if manifest:
        rebuild_manifest(writer.kv)
    return ref


def make_tiny_target(out_dir, tokenizer_dir, *, hidden: int = 64, layers: int = 6, seed: int = 0):
    """A random-weight Llama with the real SmolLM2 tokenizer: a fast stand-in target for pipeline tests."""
    import shutil
    from pathlib import Path

    from transformers import AutoModelForCausalLM, LlamaConfig

    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=49152, max_position_embeddings=2048,
                      tie_word_embeddings=True, rope_theta=10000.0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # real embeddings have norms far above a 0.02-std init; logits need the range
        model.get_input_embeddings().weight.normal_(0.0, 0.5)
    model.save_pretrained(out)
    for f in Path(tokenizer_dir).iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
            shutil.copy(f, out / f.name)
    return out


def write_conversations(path, n: int = 40, seed: int = 0):
    """ShareGPT-style conversations with learnable structure (counting, repeated phrases)."""
    import json
    import random

    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "maple", "copper", "violet"]
    rows = []
    for i in range(n):
        a = rng.randint(1, 50)
        seq = " ".join(str(a + k) for k in range(rng.randint(8, 30)))
        phrase = " ".join(rng.choice(words) for _ in range(rng.randint(3, 8)))
        rows.append({"conversations": [
            {"from": "human", "value": f"Count up from {a} and then repeat: {phrase}"},
            {"from": "gpt", "value": f"{seq}. Repeating: {phrase} {phrase}."},
        ]})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def extract_tiny_store(root, tokenizer_dir, *, n: int = 24, out=None, **options) -> tuple[str, str]:
    """(target folder, store url): a tiny random target under `root` and the real extraction of `n`
    conversations into `out` (default root/store); `options` override the small defaults."""
    from dflash_pipeline.extract.pipeline import run_extract
    from dflash_pipeline.schemas.config import ExtractConfig

    target = make_tiny_target(root / "target", tokenizer_dir)
    data = write_conversations(root / "conv.jsonl", n=n)
    out = str(out or root / "store")
    settings = dict(max_length=128, topk=4, tokens_per_batch=1024, segment_tokens=400, tokenize_workers=1,
                    quiet=True, device="cpu", num_features=3)
    run_extract(ExtractConfig(out=out, target=str(target), data=[str(data)], **{**settings, **options}))
    return str(target), out


def random_heldout(store_url: str, *, vocab: int, block_size: int, tree_budgets=(), **store_kw):
    """A random store, a random 2-layer drafter over it (eval mode) and the held-out set of all its samples:
    (reader, drafter config, model, frozen tensors, HeldoutSet) for tests of the held-out estimate."""
    from dflash_pipeline.store.reader import StoreReader
    from dflash_pipeline.train.from_store import frozen_tensors
    from dflash_pipeline.train.heldout import HeldoutSet
    from dflash_pipeline.train.model import DFlashDrafter, DrafterConfig, init_drafter_weights

    write_random_store(store_url, vocab=vocab, **{"segments": 2, "seed": 3, **store_kw})
    reader = StoreReader(store_url)
    cfg = DrafterConfig(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        vocab_size=vocab, block_size=block_size, mask_token_id=vocab - 1, target_layer_ids=[1, 3, 5],
                        num_target_layers=8)
    model = DFlashDrafter(cfg)
    init_drafter_weights(model, std=0.3, generator=torch.Generator().manual_seed(4))
    model.eval()
    frozen = frozen_tensors(reader, torch.device("cpu"), torch.float32)
    held = HeldoutSet(reader=reader, rows=np.arange(reader.num_samples), frozen=frozen, drafter=cfg, gamma=4.0,
                      max_anchors=7, loss_chunk=64, device=torch.device("cpu"), autocast=False,
                      tree_budgets=tuple(tree_budgets))
    return reader, cfg, model, frozen, held
