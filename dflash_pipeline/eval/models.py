"""The target and the drafter as the decoding loop sees them.

`Target` wraps a Hugging Face causal LM: one forward over new tokens at explicit positions with a KV
cache, fp32 logits out, and optionally the outputs of the decoder layers the drafter reads. Those are
taken by forward hooks, as extraction takes them (layer k output = HF hidden_states[k + 1], before the
final norm), so no forward ever materialises every layer's hidden states.

Transformers renamed the model's cache argument (`past_key_values` -> `cache` in 5.24) and the meaning
of a positive `Cache.crop` argument; the keyword is read from the forward's signature and the cache is
only ever cropped with a negative count, which both versions read as "remove this many".

A rejected draft is rolled back by cropping keys and values, and, in hybrid targets, by restoring the
linear-attention layers' states saved before the verify forward and folding the committed tokens in
again (`rollback.py`: transformers' crop cannot take tokens out of a recurrent state). `TargetCache`
carries what that needs; single-token forwards (plain decoding) and prefills save nothing, as nothing
rolls them back.

`DFlashDraft` puts a `DFlashDrafter` behind the loop's `Drafter` protocol. The drafter owns neither
embedding nor LM head: it embeds with the target's frozen table times the model's embedding scale
(exactly as training does) and reads logits through the target's LM head, with the target's logit
scale and soft-capping, so its distribution q lives on the target's vocabulary.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.nn import functional as F

from dflash_pipeline.eval.lossless import TIE_ULPS
from dflash_pipeline.eval.rollback import LinearStates, MixerReplay, past_recording_options
from dflash_pipeline.extract.target import embedding_scale, decoder_layers, text_config
from dflash_pipeline.method import block_input_ids
from dflash_pipeline.train.model import DFlashDrafter


@dataclass
class TargetCache:
    """The target's transformers cache as the decoding loop holds it, with what a rollback needs."""

    kv: Any                              # the transformers cache (DynamicCache)
    states: LinearStates | None = None   # the linear-attention layers' states; None: no such layers
    length: int = 0                      # positions held
    saved_at: int | None = None          # where the last multi-token forward started (states saved there)
    mixer_inputs: dict = field(default_factory=dict)  # that forward's linear-attention inputs (MixerReplay)


class Target:
    """A causal LM decoding at explicit positions with a cache; captures `layer_ids` outputs on request."""

    tie_ulps = TIE_ULPS  # the lossless check's tie tolerance for this target's passes (eval/lossless.py)

    def __init__(self, model, layer_ids: Sequence[int] = ()):
        self.model = model
        self.layer_ids = [int(k) for k in layer_ids]
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._can_keep_last = "logits_to_keep" in params
        emb = model.get_input_embeddings()
        self.device, self.dtype = emb.weight.device, emb.weight.dtype
        self.embed_scale = embedding_scale(model)
        cfg = text_config(model.config)
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.logit_scale = getattr(cfg, "logit_scale", None)
        self._capturing = False
        self._captured: dict[int, torch.Tensor] = {}
        layers = decoder_layers(model)
        self._hooks = [layers[k].register_forward_hook(self._hook(k)) for k in self.layer_ids]
        self._replay: MixerReplay | None = None  # made with the first cache of a hybrid target

    def _hook(self, k: int):
        def fn(module, args, output):
            if self._capturing:
                self._captured[k] = output[0] if isinstance(output, tuple) else output

        return fn

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._replay is not None:
            self._replay.close()
            self._replay = None

    def new_cache(self) -> TargetCache:
        from transformers import DynamicCache

        kv = DynamicCache(config=self.model.config)
        # Sliding-window layers keep their past until cropped, so a rejected draft can be rolled back;
        # linear-attention layers keep their convolution window (their recurrent state: LinearStates).
        kv.activate_past_recording(**past_recording_options())
        states = LinearStates(kv)
        if states and self._replay is None:
            self._replay = MixerReplay(self.model, states.layer_ids)
        return TargetCache(kv, states if states else None)

    def crop(self, cache: TargetCache, length: int) -> None:
        """Keep the first `length` positions of the cache (the last forward's first position or later)."""
        drop = cache.length - length
        if drop <= 0:
            return
        cache.length = length
        if cache.states is None:
            cache.kv.crop(-drop)
        else:
            cache.states.crop_others(drop)
            assert cache.saved_at is not None and length >= cache.saved_at, "rollback past the last verify forward"
            cache.states.restore()
            self._replay.replay(cache.mixer_inputs, length - cache.saved_at)
            cache.saved_at = None
            cache.mixer_inputs.clear()

    def forward(self, ids: Sequence[int] | torch.Tensor, start: int, cache: TargetCache, *, features: bool = False,
                last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(fp32 logits [n, V] (or [1, V] with last_only), features [1, n, F] or None) of n new tokens
        at positions start .. start + n - 1, appending them to `cache` (which must hold `start`)."""
        n = len(ids)
        assert cache.length == start, f"the cache holds {cache.length} positions, the forward starts at {start}"
        if cache.length:
            # Past recording expects a crop after every forward: without one, transformers 5.17 hands a
            # sliding-window layer its whole recorded past (a shape error past the window) and 5.24 keeps
            # it in memory. crop(0) cuts every window back to what the next forward needs.
            cache.kv.crop(0)
        if isinstance(ids, torch.Tensor):  # a block built on the device: no host round trip
            ids_1n = ids.reshape(1, n).to(self.device)
        else:
            ids_1n = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        kwargs = {self._cache_kw: cache.kv, "use_cache": True,
                  "position_ids": torch.arange(start, start + n, device=self.device)[None]}
        if last_only and self._can_keep_last:
            kwargs["logits_to_keep"] = 1
        # Only a verify forward is ever rolled back: more than one token, logits for all of them (a
        # prefill keeps only the last; capturing its inputs would hold every layer's activations).
        rollback = cache.states is not None and n > 1 and not last_only
        if cache.states is not None:
            cache.mixer_inputs.clear()
            cache.saved_at = start if rollback else None
            if rollback:
                cache.states.save()
            self._replay.capture(cache.mixer_inputs if rollback else None)
        self._capturing = features and bool(self.layer_ids)
        try:
            out = self.model(input_ids=ids_1n, **kwargs)
            feats = None
            if self._capturing:
                # Concatenated in the drafter's layer order, as `fc` expects them.
                feats = torch.cat([self._captured[k].to(self.device) for k in self.layer_ids], dim=-1)
        finally:
            self._capturing = False
            self._captured.clear()
            if self._replay is not None:
                self._replay.capture(None)
        cache.length = start + n
        logits = out.logits[0].float()
        return (logits[-1:] if last_only else logits), feats

    # -- what the drafter borrows -------------------------------------------------------------------

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The frozen input embedding rows, scaled as the model scales them (Gemma: sqrt(H))."""
        e = F.embedding(ids, self.model.get_input_embeddings().weight)
        return e * self.embed_scale if self.embed_scale != 1.0 else e

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final-normed hidden states through the target's LM head."""
        head = self.model.get_output_embeddings()
        logits = head(hidden.to(head.weight.dtype)).float()
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class DFlashDraft:
    """A DFlash drafter behind the `Drafter` protocol, with its context cache for the current prompt."""

    def __init__(self, model: DFlashDrafter, target: Target, block_size: int | None = None):
        if list(target.layer_ids) != list(model.config.target_layer_ids):
            raise ValueError(f"the target captures layers {target.layer_ids}, the drafter reads "
                             f"{model.config.target_layer_ids}")
        self.model = model.eval()
        self.target = target
        self.block_size = int(block_size or model.config.block_size)
        self.mask_token_id = model.config.mask_token_id
        self.cache = model.new_cache()

    def reset(self) -> None:
        self.cache = self.model.new_cache()

    @torch.inference_mode()
    def draft(self, context_1nF: torch.Tensor | None, anchor: int, start: int) -> torch.Tensor:
        B, device = self.block_size, self.target.device
        n = context_1nF.shape[1]
        assert len(self.cache) + n == start, "context must cover every committed position exactly once"
        ids_1B = block_input_ids(torch.tensor([anchor], device=device), B, self.mask_token_id)
        hidden_1BH = self.model.draft_step(
            context_1nF, torch.arange(start - n, start, device=device), self.target.embed(ids_1B),
            torch.arange(start, start + B, device=device), self.cache,
        )
        return self.target.logits(hidden_1BH[0, 1:])


# Strings that close a turn in common chat templates; used only when the template probe finds none.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "</s>")


def stop_token_ids(tokenizer, model=None) -> frozenset[int]:
    """Token ids that end a reply: the tokenizer's and generation config's EOS, and the token the chat
    template writes right after an assistant reply (<|im_end|>, <|eot_id|>, <end_of_turn>, ...)."""
    ids: set[int] = set()

    def add(value) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(tokenizer.eos_token_id)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        add(gen.eos_token_id)
    probe = "pong 7"
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "ping"}, {"role": "assistant", "content": probe}], tokenize=False)
    except Exception:  # no template, or one that refuses the probe: EOS alone decides
        rendered = None
    if rendered and probe in rendered:
        after = rendered[rendered.rindex(probe) + len(probe):]
        # Any added token may close a turn; longest first so that a prefix never wins.
        specials = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.content},
                          key=len, reverse=True)
        closing = re.match("|".join(map(re.escape, specials)), after) if specials else None
        if closing:
            add(tokenizer.convert_tokens_to_ids(closing.group(0)))
    if not ids:
        vocab = tokenizer.get_vocab()
        add([vocab[s] for s in _END_OF_TURN if s in vocab])
    return frozenset(ids)


__all__ = ["Target", "TargetCache", "DFlashDraft", "stop_token_ids"]
