"""The target's own decoding rule, as small pure functions: argmax at T = 0, else a draw from softmax(logits / T).

Every decoder in the package takes its tokens through these (plain decoding, the chain's acceptance, the
tree's walk, training's held-out estimate), so the rule lives here, below all of them: `decoding/` is
imported by `train/` and `eval/` and imports neither for it.

Legend: V vocabulary; `...` any leading shape (one choice per row).
"""

from __future__ import annotations

import torch


def probs_from_logits(logits_V: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in fp32; the distribution both the target and the drafter sample from."""
    return torch.softmax(logits_V.float() / temperature, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def choose(logits_V: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """The target's choice per row of logits [..., V] -> [...] long, on the device: argmax at T = 0, else
    one independent draw from softmax(logits / T) per row."""
    if temperature == 0:
        return logits_V.argmax(-1)
    return sample(probs_from_logits(logits_V, temperature), generator)


def next_token(logits_V: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """`choose` of one position, read back to the host."""
    return int(choose(logits_V, temperature, generator))


__all__ = ["probs_from_logits", "sample", "choose", "next_token"]
