"""Rolling back the linear-attention layers of a target after a verify forward whose drafts were partly
rejected: what makes speculative decoding exact on hybrid targets (Qwen3.5, Qwen3.5-MoE, Qwen3-Next).

The cause. A verify forward feeds [anchor, draft 1 .. draft m]; the loop keeps the anchor and the first
n drafts. An attention layer rolls back by cropping its keys and values. A linear-attention layer
(Gated DeltaNet) keeps no per-token keys: it keeps a short-convolution window (its last kernel-size
inputs) and a recurrent state [heads, d_k, d_v] into which every token is folded. transformers' `crop`,
after `activate_past_recording`, cuts the window back right, but it cannot take tokens out of the
recurrent state (`LinearAttentionCacheLayerMixin.is_croppable` said so, in 5.17 as in 5.24, and its
own assisted decoding refused such caches). So after every rejection the next forward started from a
state that had seen the rejected drafts. A test shows it on the states themselves
(tests/test_eval.py, test_verify_then_rollback_leaves_the_committed_states): after verify + crop the
recurrent state of every linear layer differs from the state after feeding only the committed tokens
by as much as the state's own size, the window equals it to rounding; the block (chunked kernel) and
token-by-token (recurrent kernel) paths agree to rounding, so the kernels are not the cause. On a
random model the damage to the logits is small (the linear layers add little to the residual stream
at the default init), which is why a greedy check with large margins can pass anyway (it did for a
tiny qwen3_5_moe on two prompts).

The fix, in two small parts that a static-cache decoding runner can reuse:
- `LinearStates`: saves the window and recurrent state of every linear-attention layer of a
  transformers cache before a verify forward, and puts them back after a rejection (recurrent states
  are copied into the live tensors, so their addresses stay, as CUDA graphs need; save buffers are
  reused);
- `MixerReplay`: folds the committed tokens in again by re-running only the linear-attention modules
  on their own inputs, captured (as references, no copy) during the verify forward. A module's input
  at a committed position does not depend on any later (rejected) position, so this is exact.

Measured, how to fold the committed tokens in again (bench/rollback.py: random qwen3_5 of 8 layers, 6 of
them linear, hidden 64; fp32, one thread, CPU time; 4 prompts x 48 new tokens, a drafter that proposes
the target's own continuation but errs at every 3rd drafted slot; transformers 5.25), per verify round,
block 8 (tau 2.04) / block 16 (tau 2.94):
  crop the attention layers only (WRONG: leaves plain decoding on 4 of 4 prompts)     33 / 40 ms
  restore + replay only the linear-attention modules (MixerReplay)                    43-45 / 58 ms
  transformers 5.25's own: per-token recurrent states recorded in the verify          46-48 / 71 ms
  restore + a second target forward over the committed tokens                         56-62 / 73 ms
On a GPU at batch 1 a forward is bound by reading the weights and by kernel launches. For a
Qwen3.5-27B shape the second forward reads all 54 GB of weights again and launches every layer's
kernels (~64 layers); the module replay reads the linear-attention projections of 48 layers
(~11 GB: in_proj_qkv 5120x10240, in_proj_z and out_proj 5120x6144, in_proj_a/b) and launches ~48 x
10 kernels: about a fifth of the forward's bytes, so the replay wins there too.

transformers 5.25 added a rollback of its own: `activate_past_recording(recurrent_states_to_keep=N)`
makes the linear layers record their state after each of a forward's last N tokens, and `crop` picks
one. It computes those N tokens one by one with the recurrent kernel instead of the chunked one, so a
16-token verify makes 16 sequential steps in every linear layer: exact, but slower than the replay
above (1.23x at block 16 on the CPU; on a GPU each step is a few more kernel launches per layer). We keep
N = 0 (the verify stays chunked) and crop those layers ourselves (`LinearStates.crop_others`), on 5.17
through 5.25 alike.
"""

from __future__ import annotations

import inspect

import torch

from dflash_pipeline.errors import DFlashError

# The child of a decoder layer that holds its linear-attention state (Qwen3.5, Qwen3.5-MoE, Qwen3-Next).
MIXER_NAMES = ("linear_attn",)


def linear_layer_ids(cache) -> list[int]:
    """Indices of the layers of a transformers cache that keep linear-attention states."""
    try:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin
    except ImportError:  # transformers without linear-attention cache layers
        return []
    return [i for i, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]


def past_recording_options() -> dict:
    """Keywords for `Cache.activate_past_recording` that leave the linear layers' rollback to us.

    transformers 5.25 can record a linear layer's recurrent state after each of a forward's last N tokens
    (`recurrent_states_to_keep`), which it computes token by token with the recurrent kernel; left unset
    it reads as None and the layer's forward fails. 0 keeps the verify forward chunked, as before."""
    try:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin
    except ImportError:
        return {}
    params = inspect.signature(LinearAttentionCacheLayerMixin.activate_past_recording).parameters
    return {"recurrent_states_to_keep": 0} if "recurrent_states_to_keep" in params else {}


def _keep(src: torch.Tensor | None, buf: torch.Tensor | None) -> torch.Tensor | None:
    """A copy of src, into buf when buf fits (no allocation per verify step)."""
    if src is None:
        return None
    if buf is not None and buf.shape == src.shape and buf.dtype == src.dtype and buf.device == src.device:
        return buf.copy_(src)
    return src.clone()


class LinearStates:
    """Saves and restores the convolution windows and recurrent states of a cache's linear-attention layers."""

    def __init__(self, cache):
        self.cache = cache
        self.layer_ids = linear_layer_ids(cache)
        if self.layer_ids:
            from transformers.cache_utils import CacheLayerMixin
        for i in self.layer_ids:
            if isinstance(cache.layers[i], CacheLayerMixin):
                raise DFlashError(f"cache layer {i} ({type(cache.layers[i]).__name__}) holds linear and softmax "
                                  "attention in one layer; rolling such a layer back is not supported")
        # (layer, state index) -> (window or None, recurrent state or None, has_previous_state)
        self._saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor | None, bool]] = {}
        # transformers 5.25 counts the tokens a linear layer has seen (the cache's length when it is layer 0)
        self._lengths: dict[int, torch.Tensor] = {}

    def __bool__(self) -> bool:
        return bool(self.layer_ids)

    def save(self) -> None:
        """Remember every linear-attention layer as it is now."""
        for i in self.layer_ids:
            layer = self.cache.layers[i]
            for s in range(layer.number_of_states):
                window = layer.conv_states[s] if layer.is_conv_states_initialized[s] else None
                state = layer.recurrent_states[s] if layer.is_recurrent_states_initialized[s] else None
                old = self._saved.get((i, s), (None, None, False))
                self._saved[(i, s)] = (_keep(window, old[0]), _keep(state, old[1]), bool(layer.has_previous_state[s]))
            length = getattr(layer, "cumulative_length_linear", None)
            if isinstance(length, torch.Tensor):
                self._lengths[i] = _keep(length, self._lengths.get(i))

    def restore(self) -> None:
        """Put every linear-attention layer back as it was at the last `save()`."""
        for (i, s), (window, state, had_previous) in self._saved.items():
            layer = self.cache.layers[i]
            # Saved before any token: the next forward starts the layer afresh, as a prefill does.
            layer.has_previous_state[s] = had_previous
            if window is not None:
                live = layer.conv_states[s]
                if live is not None and live.shape == window.shape:
                    live.copy_(window)
                else:  # past recording grew the window during the forward; it is reassigned anyway
                    layer.conv_states[s] = window.clone()
            if state is not None:
                layer.recurrent_states[s].copy_(state)
        for i, length in self._lengths.items():
            self.cache.layers[i].cumulative_length_linear.copy_(length)

    def crop_others(self, drop: int) -> None:
        """Remove the last `drop` positions from every layer but the linear-attention ones, which `restore`
        and `MixerReplay` roll back (transformers' own crop of those needs recurrent states recorded per
        token, see `past_recording_options`)."""
        linear = set(self.layer_ids)
        for i, layer in enumerate(self.cache.layers):
            if i not in linear:
                layer.crop(-drop)


def _head(value, keep: int):
    """The first `keep` positions of a [batch, positions, ...] tensor (a 2D padding mask included)."""
    return value[:, :keep] if isinstance(value, torch.Tensor) and value.dim() >= 2 else value


class MixerReplay:
    """Re-runs a model's linear-attention modules over the first positions of their captured inputs.

    While `capture(into)` is set, each module's forward pre-hook puts a reference to its arguments into
    `into` (one dict per cache, so two caches decoded in turn never mix); `replay(into, keep)` calls
    every module again on the first `keep` positions, which folds them into the cache the module was
    called with (restored by `LinearStates` first). The modules' outputs are dropped.
    """

    def __init__(self, model, layer_ids: list[int]):
        from dflash_pipeline.extract.target import decoder_layers

        layers = decoder_layers(model)
        self.mixers: dict[int, torch.nn.Module] = {}
        for i in layer_ids:
            mixer = next((getattr(layers[i], n) for n in MIXER_NAMES if hasattr(layers[i], n)), None)
            if mixer is None:
                raise DFlashError(f"{type(model).__name__}: decoder layer {i} keeps a linear-attention state, but "
                                  f"has none of the modules {', '.join(MIXER_NAMES)} whose state can be rolled "
                                  "back; speculative decoding of this model is not supported")
            self.mixers[i] = mixer
        self._into: dict | None = None
        self._hooks = [m.register_forward_pre_hook(self._hook(i), with_kwargs=True) for i, m in self.mixers.items()]

    def _hook(self, i: int):
        def fn(module, args, kwargs):
            if self._into is not None:
                self._into[i] = (args, kwargs)

        return fn

    def capture(self, into: dict | None) -> None:
        """Where the modules' inputs of the forwards that follow go (None: nowhere)."""
        self._into = into

    def replay(self, inputs: dict, keep: int) -> None:
        """Fold the first `keep` positions of the captured inputs into the modules' cache again."""
        assert len(inputs) == len(self.mixers), "replay needs the inputs of a whole forward"
        for i, mixer in self.mixers.items():
            args, kwargs = inputs[i]
            mixer(*(_head(a, keep) for a in args), **{k: _head(v, keep) for k, v in kwargs.items()})

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._into = None


__all__ = ["LinearStates", "MixerReplay", "linear_layer_ids", "past_recording_options", "MIXER_NAMES"]
