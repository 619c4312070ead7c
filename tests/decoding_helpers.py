"""Tiny random causal LMs and drafters for the decoding tests, and transformers' greedy reference.

Kept apart from helpers.py (store builders) so that the CUDA tests import nothing but torch and
transformers on the GPU machine.
"""

from __future__ import annotations

import torch

from dflash_pipeline.train.model import DFlashDrafter, DrafterConfig, init_drafter_weights


def tiny_causal_lm(kind: str, seed: int = 0, vocab: int = 96):
    """A tiny random causal LM: llama (GQA), qwen3 and gemma3 (sliding-window layers), gemma2 (attention
    soft-capping). Peaked logits, so that greedy decoding has no near-ties."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if kind == "llama":
        cfg, cls = tf.LlamaConfig(num_hidden_layers=3, tie_word_embeddings=False, **common), tf.LlamaForCausalLM
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(num_hidden_layers=3, head_dim=16, sliding_window=5, use_sliding_window=True,
                             layer_types=["sliding_attention", "full_attention", "sliding_attention"], **common)
        cls = tf.Qwen3ForCausalLM
    elif kind == "gemma3":
        cfg = tf.Gemma3TextConfig(num_hidden_layers=3, head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
                                  layer_types=["sliding_attention", "sliding_attention", "full_attention"], **common)
        cls = tf.Gemma3ForCausalLM
    elif kind == "gemma2":
        cfg = tf.Gemma2Config(num_hidden_layers=2, head_dim=16, sliding_window=4, attn_logit_softcapping=2.0,
                              final_logit_softcapping=5.0, **common)
        cls = tf.Gemma2ForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(seed + 1))
    return model


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy decoding (it stops at the model's EOS, if it has one)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def tiny_drafter(layer_ids: list[int], block_size: int = 4, seed: int = 0) -> DFlashDrafter:
    """A random drafter for `tiny_causal_lm` (hidden 64, vocabulary 96, 3 target layers)."""
    cfg = DrafterConfig(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        vocab_size=96, block_size=block_size, mask_token_id=95, target_layer_ids=layer_ids,
                        num_target_layers=3)
    model = DFlashDrafter(cfg)
    init_drafter_weights(model, std=0.3, generator=torch.Generator().manual_seed(seed))
    return model.eval()


class Steered:
    """A drafter whose first j slots (j = round number mod B) are forced to the target's own continuation:
    acceptances then vary over 0..B-1, so the wrapped drafter gets context appends of every length. Keeps
    the wrapped drafter's own logits of every round."""

    def __init__(self, inner, sequence: list[int]):
        self.inner, self.sequence, self.block_size = inner, sequence, inner.block_size
        self.seen: list[torch.Tensor] = []

    def reset(self) -> None:
        self.inner.reset()
        self.seen = []

    def draft(self, context, anchor, start):
        logits = self.inner.draft(context, anchor, start).clone()
        self.seen.append(logits.clone())
        want = self.sequence[start + 1:start + 1 + len(self.seen) % self.block_size]
        logits[torch.arange(len(want)), torch.tensor(want, dtype=torch.long)] = 1e4
        return logits


class Requests:
    """A request source for generate's Engine: each request once; what came back, by key, as
    (tokens, finish)."""

    def __init__(self, requests):
        self.todo, self.done = list(requests), {}

    def next_request(self):
        return self.todo.pop(0) if self.todo else None

    def finished(self, done):
        self.done[done.request.key] = (done.tokens, done.finish)

    def exhausted(self):
        return not self.todo
