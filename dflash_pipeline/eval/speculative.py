"""Block speculative decoding with a DFlash drafter, and the plain decoding it must reproduce.

Written the way gpt-fast writes it: the acceptance rules are short pure functions over tensors
(`greedy_accept`, `rejection_accept`, `residual`), and the two loops (`speculative_generate`,
`target_generate`) only move tokens, caches and features between them. One prompt at a time
(batch 1): acceptance lengths differ per sequence, and batch 1 is what the paper's tau and speedup
are measured at.

One round of `speculative_generate`, with `start` = position of the last committed token (the anchor,
whose target state is not known yet):
1. the drafter reads the target features of the tokens committed since the last round (positions
   below `start`) and drafts slots 1..B-1 of the block [anchor, MASK x (B-1)] at start..start+B-1;
2. the target verifies [anchor, draft...] in ONE forward with its KV cache: logits at block slot i
   predict the token of slot i + 1;
3. the longest acceptable prefix of the draft is kept, plus one token from the target (the correction
   at the first rejected slot, or the bonus after the last slot);
4. the target cache is cut back to the committed tokens (the new anchor is not in it; in hybrid targets
   the linear-attention states are restored and the committed tokens folded in again, see rollback.py),
   and the features of the anchor and the accepted drafts, from that same verify forward, become the
   next context.

Tokens stay on the device inside a round: the draft's tokens feed the verify block, the acceptance
rule runs on the device, and ONE transfer per round brings the accepted count, the token after them
and the drafts to the host (plain decoding: one per token, the token; at T = 0 the target's two largest
logits of every position stay in a device buffer, read once at the end, for the lossless check). With the graphed
target and drafter (eval/graphed.py) a round is then two graph launches, a few small copies and that
transfer. `timer` (decoding.graphs.StepTimer) times the drafter step, the verify step and the plain
decode step without synchronising.

Legend: V vocabulary, m drafted slots used this round (k - 1), k = m + 1 verified positions, N batch
of independent acceptance decisions (1 in the loop; larger in tests), F concatenated target features.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from dflash_pipeline.decoding.sampling import choose, next_token, probs_from_logits, sample

# ---------------------------------------------------------------- acceptance (pure)
# The target's decoding rule itself (argmax or a draw of softmax(logits / T)) is decoding/sampling.py's.


def greedy_accept(draft_m: torch.Tensor, target_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts n, token to commit after them) at T = 0, as 0-d tensors on the device.

    target_k[i] is the target's argmax after block slot i. A draft token is kept while it equals the
    target's own choice; the first disagreement is replaced by the target's token, and if every draft
    matched, the target's token after the last slot is the bonus. Either way: target_k[n].
    """
    m = draft_m.shape[0]
    n = (draft_m == target_k[:m]).long().cumprod(0).sum()
    return n, target_k[n]


def residual(p_V: torch.Tensor, q_V: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)): the distribution to sample from after a rejection.

    It sums to zero only where p <= q everywhere, i.e. p == q, and then no rejection can happen except
    through rounding; p itself is the right distribution in that case.
    """
    r = (p_V - q_V).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p_V)


def rejection_accept(
    draft_Nm: torch.Tensor, p_NkV: torch.Tensor, q_NmV: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts n [N], token to commit after them [N]) at T > 0, for N independent blocks.

    p_NkV: the target's distributions after block slots 0..m; q_NmV: the drafter's distributions the
    draft tokens were sampled from. The committed tokens are then distributed exactly as the target
    samples them (Leviathan et al. 2023, Chen et al. 2023).
    """
    N, m = draft_Nm.shape
    p_x = p_NkV[:, :m].gather(-1, draft_Nm[..., None])[..., 0]
    q_x = q_NmV.gather(-1, draft_Nm[..., None])[..., 0]
    u = torch.rand(p_x.shape, generator=generator, device=p_x.device)
    # Accept draft token x with probability min(1, p(x) / q(x)); u * q < p is that test without a division.
    ok = u * q_x < p_x
    # Only a run of acceptances from slot 1 counts: everything after the first rejection is discarded.
    n = ok.int().cumprod(-1).sum(-1)
    rows = torch.arange(N, device=n.device)
    # On a rejection at slot n, sample from normalize(max(p - q, 0)) at that slot.
    # With all m accepted, the bonus comes from p after the last slot: pad q with zeros so that the
    # same residual formula gives p there.
    q_pad = torch.cat([q_NmV, torch.zeros_like(p_NkV[:, :1])], dim=1)
    dist = residual(p_NkV[rows, n], q_pad[rows, n])
    return n, sample(dist, generator)


# ---------------------------------------------------------------- the two participants


class Drafter(Protocol):
    """What the decoding loop needs of a drafter; `DFlashDraft` is the real one, tests swap in doubles."""

    block_size: int  # B: drafts slots 1..B-1 of a block of B positions

    def reset(self) -> None:
        """Forget all context: a new prompt starts."""

    def draft(self, context_1nF: torch.Tensor | None, anchor: int, start: int) -> torch.Tensor:
        """Logits [B-1, V] for the block slots 1..B-1 after `anchor` at position `start`.

        context_1nF: target features of the n tokens committed since the last call, at positions
        start - n .. start - 1 (the whole prompt at the first call); None when the target captures no
        layers.
        """


class TargetLike(Protocol):
    """What the decoding loop needs of the target (see `eval.models.Target`)."""

    device: torch.device
    dtype: torch.dtype  # the target's compute dtype (the lossless rule depends on it)
    tie_ulps: int       # and the tie tolerance of its passes (eval/lossless.tie_ulps_for)

    def new_cache(self): ...

    def forward(self, ids: Sequence[int] | torch.Tensor, start: int, cache, *, features: bool = False,
                last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(fp32 logits [n, V], features [1, n, F] or None) of n new tokens at start..start+n-1; `ids` is a
        list (the prompt) or a device tensor (a block built on the device)."""

    def crop(self, cache, length: int) -> None: ...


# ---------------------------------------------------------------- decoding loops


@dataclass
class Step:
    drafted: int    # m: draft tokens verified this round
    accepted: int   # n: of those, how many were accepted (0..m)
    committed: int  # tokens added to the output (n + 1, fewer when a stop token ended the round)


@dataclass
class Generation:
    tokens: list[int]                  # generated ids, the stop token included when one ended it
    seconds: float                     # decoding time after the first token (prefill excluded)
    steps: list[Step] = field(default_factory=list)       # speculative rounds (empty for plain decoding)
    top1: list[float] = field(default_factory=list)       # plain greedy: the target's largest logit per token
    top2: list[float] = field(default_factory=list)       # and its second largest (the lossless rule reads both)

    @property
    def decoded_tokens(self) -> int:
        """Tokens produced by the timed decoding phase (all but the prefill's token)."""
        return max(len(self.tokens) - 1, 0)


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _until_stop(tokens: list[int], stop_ids: frozenset[int]) -> list[int]:
    """tokens up to and including the first stop token."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens


def _propose(draft_logits_mV: torch.Tensor, temperature: float, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft tokens [m] and the distribution q [m, V] they were drawn from (None at T = 0: argmax)."""
    if temperature == 0:
        return draft_logits_mV.argmax(-1), None
    q = probs_from_logits(draft_logits_mV, temperature)
    return sample(q, generator), q


def _verify(draft_m: torch.Tensor, logits_kV: torch.Tensor, q_mV: torch.Tensor | None, temperature: float,
            generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, token) as 0-d device tensors."""
    if draft_m.numel() == 0:  # a lone anchor: the target's next token, as plain decoding takes it
        return torch.zeros((), dtype=torch.long, device=logits_kV.device), choose(logits_kV[0], temperature, generator)
    if temperature == 0:
        return greedy_accept(draft_m, logits_kV.argmax(-1))
    p = probs_from_logits(logits_kV, temperature)
    n, token = rejection_accept(draft_m[None], p[None], q_mV[None], generator)
    return n[0], token[0]


@contextmanager
def _untimed(name: str):
    yield


def prefill(target, drafter: Drafter, prompt: Sequence[int], temperature: float,
            generator: torch.Generator | None):
    """The prompt through the target: (cache, context features, [first token], the anchor's position,
    committed but not yet in the target cache); the drafter starts afresh."""
    cache = target.new_cache()
    logits, context = target.forward(list(prompt), 0, cache, features=True, last_only=True)
    drafter.reset()
    return cache, context, [next_token(logits[-1], temperature, generator)], len(prompt)


@torch.inference_mode()
def speculative_generate(target: TargetLike, drafter: Drafter, prompt: Sequence[int], *, max_new_tokens: int,
                         temperature: float, stop_ids: frozenset[int], generator: torch.Generator | None = None,
                         timer=None) -> Generation:
    """Block speculative decoding of one prompt; the output follows the target's own decoding rule."""
    timer = timer or _untimed
    B = drafter.block_size
    cache, context, tokens, start = prefill(target, drafter, prompt, temperature, generator)
    steps: list[Step] = []
    t0 = _clock(target.device)
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
        k = min(B, max_new_tokens - len(tokens))  # verified positions: never commit past max_new_tokens
        anchor = tokens[-1]
        if k > 1:
            with timer("drafter"):
                draft, q = _propose(drafter.draft(context, anchor, start)[: k - 1], temperature, generator)
        else:  # the final token: nothing to draft (and no later round needs the context)
            draft, q = torch.zeros(0, dtype=torch.long, device=target.device), None
        block = torch.cat([draft.new_full((1,), anchor), draft])  # [anchor, drafts], built on the device
        with timer("target_verify" if k > 1 else "target_decode"):
            logits, features = target.forward(block, start, cache, features=True)
        n, token = _verify(draft, logits, q, temperature, generator)
        # The round's one synchronisation: accepted count, the token after them, and the drafts.
        n, token, *drafted = torch.cat([n.view(1), token.view(1), draft]).tolist()
        committed = _until_stop([*drafted[:n], token], stop_ids)
        tokens += committed
        steps.append(Step(k - 1, n, len(committed)))
        start += n + 1
        target.crop(cache, start)  # drop the rejected drafts' keys and values
        # Features of the anchor and the accepted drafts: committed tokens whose target state is now known.
        context = None if features is None else features[:, : n + 1]
    seconds = _clock(target.device) - t0
    return Generation(tokens, seconds, steps)


@torch.inference_mode()
def target_generate(target: TargetLike, prompt: Sequence[int], *, max_new_tokens: int, temperature: float,
                    stop_ids: frozenset[int], generator: torch.Generator | None = None, timer=None) -> Generation:
    """Plain decoding with the target's KV cache, one token per forward: the reference output and speed.

    At T = 0 it also keeps the target's two largest logits at every position (the lossless rule's
    margin): written into a device buffer as they come, read once after the timed loop, so the loop's
    one transfer per token stays the token itself.
    """
    timer = timer or _untimed
    prompt = list(prompt)
    cache = target.new_cache()
    logits, _ = target.forward(prompt, 0, cache, last_only=True)
    top_N2 = torch.empty(max_new_tokens, 2, device=target.device) if temperature == 0 else None
    tokens: list[int] = []

    def take(logits_V: torch.Tensor) -> torch.Tensor:
        token = choose(logits_V, temperature, generator)
        if top_N2 is not None:
            top_N2[len(tokens)] = logits_V.topk(2).values
        tokens.append(int(token))  # the one synchronisation per token: the stop test needs it
        return token

    token = take(logits[-1])
    t0 = _clock(target.device)
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
        with timer("target_decode"):
            logits, _ = target.forward(token.view(1), len(prompt) + len(tokens) - 1, cache)
        token = take(logits[-1])
    seconds = _clock(target.device) - t0
    top = top_N2[: len(tokens)].T.tolist() if top_N2 is not None else [[], []]
    return Generation(tokens, seconds, top1=top[0], top2=top[1])


__all__ = [
    "Drafter", "TargetLike", "Generation", "Step", "greedy_accept", "residual", "rejection_accept",
    "speculative_generate", "target_generate",
]
