"""The target model: loading, identity, and the one forward pass extraction needs.

`TargetRunner.run_batch` returns, for the real tokens of a padded batch, the outputs of the chosen
decoder layers (captured by forward hooks, so the model never materialises all hidden states) and
the top-k next-token log-probabilities, computed from the final hidden state through the LM head in
chunks of tokens, so no [tokens, vocab] tensor exists for a whole batch.

Layer k means the output of decoder layer k (0-based) = HF `output_hidden_states[k + 1]`, before the
final norm (for the last layer HF applies the norm; hooks never do).

Legend: B batch rows, S padded length, N real tokens in a batch, L captured layers, H hidden, K top-k.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_pipeline.errors import DFlashError

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def resolve_target(spec: str | None) -> Path | str:
    """A local HF folder for `spec`: None (embedded default), a folder, a GGUF file, or a cached hub id."""
    from dflash_pipeline.embedded import cache_dir, embedded_target_dir, gguf_to_hf_folder

    if spec is None or spec == "":
        return embedded_target_dir()
    p = Path(spec).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        digest = hashlib.sha256(f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}".encode()).hexdigest()[:12]
        return gguf_to_hf_folder(p, cache_dir() / "models" / f"{p.stem}-{digest}")
    if p.is_dir():
        if not (p / "config.json").exists():
            raise DFlashError(f"{spec}: a folder without config.json is not a Hugging Face model")
        return p
    if p.exists():
        raise DFlashError(f"{spec}: not a model folder or a .gguf file")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(spec, local_files_only=True))
    except Exception:
        raise DFlashError(f"{spec}: not a local model folder, GGUF file, or hub id in the local cache") from None


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layer stack of a causal LM (Llama, Qwen, Gemma, Mistral, ... all name it `layers`)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise DFlashError(f"{type(model).__name__}: cannot find its decoder layers (expected .layers)")
    return layers


def base_model(model):
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def config_hash(config) -> str:
    d = config.to_dict()
    for k in ("_name_or_path", "torch_dtype", "dtype", "transformers_version", "_attn_implementation_autoset",
              "architectures", "_commit_hash"):
        d.pop(k, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


def tokenizer_identity(tokenizer) -> tuple[str, str]:
    """(hash over vocabulary, special tokens and chat template; hash of the chat template)."""
    template = tokenizer.chat_template or ""
    if isinstance(template, dict):
        template = json.dumps(template, sort_keys=True)
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    special = json.dumps(sorted(tokenizer.all_special_tokens))
    t_hash = hashlib.sha256(template.encode()).hexdigest()
    return hashlib.sha256((vocab + special + t_hash).encode()).hexdigest(), t_hash if template else ""


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


# -- attention without a padding mask ------------------------------------------------------------------
# Extraction's batches are right-padded, and a decoder's attention is causal: every padding token comes
# after every real token of its row, so the causal mask alone already hides padding from real tokens
# (padding's own outputs are discarded). The 2D padding mask is therefore redundant, and it is costly:
#   - transformers asks `padding_mask.all()` of every batch to decide whether the causal mask can be
#     skipped (and, without a 2D mask, inspects position ids for packing): a device-to-host sync per
#     forward, after which every host hiccup leaves the GPU idle;
#   - a padded batch gets a materialised [B, 1, S, S] mask, and SDPA with a mask cannot use grouped
#     KV heads natively (transformers copies K and V per query head) and runs a masked kernel, which
#     cuDNN builds anew for every batch shape (tens of ms each; length-sorted batches rarely repeat one).
# An attention implementation registered under our own name (the same SDPA kernel) drops the padding
# mask inside `right_padded_batch()`: the forward runs plain causal attention, as for one sample alone.
# Outside that context (e.g. decoding with a KV cache in `dflash eval`) it is transformers' own SDPA.

SDPA_NO_SYNC = "nosync_sdpa"  # no "flash" in the name: transformers reads that as a flash kernel
_MASK_STATE = threading.local()


def _no_sync_sdpa_mask(*args, attention_mask=None, **kwargs):
    from transformers.masking_utils import sdpa_mask

    if getattr(_MASK_STATE, "right_padded", False):
        attention_mask = None  # causal alone hides right padding; sliding windows still get their mask
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def _register_no_sync_sdpa() -> bool:
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        AttentionInterface.register(SDPA_NO_SYNC, ALL_ATTENTION_FUNCTIONS["sdpa"])
        AttentionMaskInterface.register(SDPA_NO_SYNC, _no_sync_sdpa_mask)
        return True
    except Exception:  # an older transformers: the plain SDPA path (mask, sync) still gives the same outputs
        return False


class right_padded_batch:
    """Context: the forward inside runs a full (no KV cache) causal pass over right-padded rows."""

    def __enter__(self):
        self.prev = getattr(_MASK_STATE, "right_padded", False)
        _MASK_STATE.right_padded = True

    def __exit__(self, *exc):
        _MASK_STATE.right_padded = self.prev


def load_target(path: Path | str, dtype: torch.dtype, device: torch.device | str | None = None,
                replica_devices: list[int] | None = None, quiet: bool = False):
    """Load the target for inference. `replica_devices` splits it over several GPUs of this process;
    `quiet`: without transformers' weight-loading progress bar (a command's --quiet)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if quiet:
        hf_logging.disable_progress_bar()

    kwargs: dict[str, Any] = {"dtype": dtype}
    if replica_devices and len(replica_devices) > 1:
        kwargs["device_map"] = "auto"
        kwargs["max_memory"] = {i: torch.cuda.get_device_properties(i).total_memory * 0.9 for i in replica_devices}
    elif device is not None and torch.device(device).type == "cuda":
        kwargs["device_map"] = {"": str(device)}  # load straight onto the GPU, not through host memory
    model = None
    for impl in ([SDPA_NO_SYNC] if _register_no_sync_sdpa() else []) + ["sdpa", None]:
        try:
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs, **({"attn_implementation": impl} if impl else {}))
            break
        except (ValueError, ImportError):  # models without an sdpa path
            if impl is None:
                raise
    if "device_map" not in kwargs and device is not None:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


@dataclass
class BatchOutput:
    hidden_NLH: torch.Tensor           # captured layers at real tokens, target dtype, on the model's device
    topk_ids_NK: torch.Tensor          # int32
    topk_logprobs_NK: torch.Tensor     # float16, log-softmax over the full vocabulary, rank order
    lengths: list[int]                 # tokens per row, in batch order


class TargetRunner:
    """Runs the target on padded batches and keeps only what the store needs."""

    def __init__(self, model, layer_ids: list[int], topk: int, logit_chunk_tokens: int = 2048):
        self.model = model
        self.layer_ids = list(layer_ids)
        self.topk = topk
        self.logit_chunk = logit_chunk_tokens
        self.layers = decoder_layers(model)
        n = len(self.layers)
        if any(k < 0 or k >= n for k in self.layer_ids):
            raise DFlashError(f"layer ids {self.layer_ids} out of range: the target has {n} decoder layers")
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = [self.layers[k].register_forward_hook(self._hook(k)) for k in self.layer_ids]
        cfg = text_config(model.config)
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.logit_scale = getattr(cfg, "logit_scale", None)  # Cohere-style models scale logits
        self.input_device = model.get_input_embeddings().weight.device

    def _hook(self, k: int):
        def fn(module, args, output):
            self._captured[k] = output[0] if isinstance(output, tuple) else output

        return fn

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    def _logprobs_topk(self, final_NH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        head = self.lm_head()
        ids, lps = [], []
        for a in range(0, final_NH.shape[0], self.logit_chunk):
            raw = head(final_NH[a:a + self.logit_chunk].to(head.weight.device))
            logits = raw.float()
            if self.logit_scale is not None:
                logits = logits * self.logit_scale
            if self.softcap:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            # top-k of the log-softmax = top-k of the logits minus their logsumexp: one pass less over
            # [chunk, vocab] than materialising the log-softmax. Without scaling, the top-k runs on the
            # head's own output (bf16 -> fp32 is exact: same ranks and values, half the bytes to read).
            top = (raw if self.logit_scale is None and not self.softcap else logits).topk(self.topk, dim=-1)
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            ids.append(top.indices.to(torch.int32))
            lps.append((top.values.float() - lse).to(torch.float16))
            del logits, raw
        return torch.cat(ids), torch.cat(lps)

    @torch.inference_mode()
    def run_batch(self, input_ids_BS: torch.Tensor, lengths: list[int]) -> BatchOutput:
        """Forward one right-padded batch; outputs only the real tokens, rows concatenated."""
        B, S = input_ids_BS.shape
        attn = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]
        # Row-major indices of the real tokens, built on the host: selecting with a boolean mask on the
        # device would stall the host until the forward is done.
        keep = torch.cat([r * S + torch.arange(n) for r, n in enumerate(lengths)])
        if self.input_device.type == "cuda":
            keep = keep.pin_memory()
        keep = keep.to(self.input_device, non_blocking=True)
        if self.input_device.type == "cuda":
            # Pinned and asynchronous: a pageable copy would make the host wait for the GPU to finish
            # the previous batch, and any host stall would then leave the GPU idle.
            input_ids_BS, attn = input_ids_BS.pin_memory(), attn.pin_memory()
        ids = input_ids_BS.to(self.input_device, non_blocking=True)
        attn = attn.to(self.input_device, non_blocking=True)
        self._captured.clear()
        with right_padded_batch():
            out = base_model(self.model)(input_ids=ids, attention_mask=attn.long(), use_cache=False)
        final = out.last_hidden_state
        # [B, S, L, H] -> real tokens only, [N, L, H]
        hidden = torch.stack([self._captured[k].to(self.input_device) for k in self.layer_ids], dim=2)
        hidden = hidden.reshape(B * S, len(self.layer_ids), -1).index_select(0, keep)
        self._captured.clear()
        if self.topk:
            final = final.reshape(B * S, -1).index_select(0, keep.to(final.device))
            top_ids, top_lps = self._logprobs_topk(final)
        else:
            n = sum(lengths)
            top_ids = torch.zeros((n, 0), dtype=torch.int32, device=hidden.device)
            top_lps = torch.zeros((n, 0), dtype=torch.float16, device=hidden.device)
        return BatchOutput(hidden, top_ids.to(hidden.device), top_lps.to(hidden.device), list(lengths))

    # -- what the drafter shares with the target ---------------------------------------------------------

    def frozen_tensors(self) -> dict[str, torch.Tensor]:
        """Input embedding, LM head (if untied) and final norm: all `dflash train` needs of the target."""
        emb = self.model.get_input_embeddings().weight
        out = {"embed": emb}
        head = self.lm_head()
        if head.weight.data_ptr() != emb.data_ptr():
            out["lm_head"] = head.weight
        if getattr(head, "bias", None) is not None:
            out["lm_head_bias"] = head.bias
        norm = getattr(base_model(self.model), "norm", None)
        if norm is not None and getattr(norm, "weight", None) is not None:
            out["final_norm"] = norm.weight
        return {k: v.detach() for k, v in out.items()}

    def target_attrs(self) -> dict[str, Any]:
        cfg = text_config(self.model.config)
        emb = self.model.get_input_embeddings()
        return {
            "config": self.model.config.to_dict(),
            "num_layers": len(self.layers),
            "hidden_size": cfg.hidden_size,
            "vocab_size": emb.weight.shape[0],
            "tied_lm_head": "lm_head" not in self.frozen_tensors(),
            "final_logit_softcapping": self.softcap,
            "logit_scale": self.logit_scale,
            "embedding_scale": embedding_scale(self.model),
            "rms_norm_eps": getattr(cfg, "rms_norm_eps", None),
        }


def embedding_scale(model) -> float:
    """Gemma-style models multiply embeddings by sqrt(hidden); the drafter must embed the same way."""
    emb = model.get_input_embeddings()
    scale = getattr(emb, "embed_scale", None)
    if scale is None:
        return 1.0
    return float(scale.item() if isinstance(scale, torch.Tensor) else scale)


def tokenizer_files(path: Path | str) -> dict[str, bytes]:
    """The tokenizer files of a model folder, to store in target/files."""
    wanted = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
              "generation_config.json", "config.json")
    out = {}
    for name in wanted:
        f = Path(path) / name
        if f.is_file():
            out[name] = f.read_bytes()
    return out

