"""`dflash eval`: speculative decoding must be exactly the target's decoding, and must say so.

- T = 0: a random drafter through the whole `run_eval` path reproduces the real SmolLM2's greedy output
  token for token; an oracle drafter (the target's own continuation) is accepted in full blocks; a
  broken verifier is caught and names the prompt.
- T > 0: on a tiny random Llama with 6 tokens, the joint distribution of the first 4 generated tokens
  over 2000 speculative runs matches the target's exact sampling distribution (chi-square, alpha 1e-3),
  while the same test clearly rejects the distribution that a loop accepting every draft would give.
  The acceptance rule itself is checked against min(1, p/q) and normalize(max(p - q, 0)).
"""

from __future__ import annotations

import io
import itertools
import json
import math

import pytest
import torch

from dflash_pipeline.errors import DFlashError
from dflash_pipeline.eval import speculative
from dflash_pipeline.eval.graphed import GraphedDraft, GraphedTarget
from dflash_pipeline.eval.models import DFlashDraft, Target, stop_token_ids
from dflash_pipeline.eval.lossless import check_greedy
from dflash_pipeline.eval.prompts import Prompt, as_prompt
from dflash_pipeline.eval.report import PromptResult, render_report, summarize
from dflash_pipeline.eval.run import EvalConfig, evaluate, make_participants, run_eval
from dflash_pipeline.progress import LiveLine
from dflash_pipeline.eval.speculative import (
    greedy_accept, rejection_accept, residual, speculative_generate, target_generate,
)
from dflash_pipeline.train.export import export_drafter
from dflash_pipeline.train.model import DFlashDrafter, DrafterConfig, init_drafter_weights
from decoding_helpers import Steered, hf_greedy, tiny_causal_lm, tiny_drafter

SMOL_LAYERS = [1, 8, 14, 20, 27]


def smol_drafter_config(**overrides) -> DrafterConfig:
    kw = dict(hidden_size=576, intermediate_size=1536, num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64,
              vocab_size=49152, block_size=8, mask_token_id=16, target_layer_ids=SMOL_LAYERS, num_target_layers=30)
    kw.update(overrides)
    return DrafterConfig(**kw)


def export_random(cfg: DrafterConfig, out) -> str:
    model = DFlashDrafter(cfg)
    init_drafter_weights(model, generator=torch.Generator().manual_seed(0))
    export_drafter(model, cfg, out, dtype=torch.float32)
    return str(out)


def write_prompts(path) -> str:
    records = [
        {"prompt": "Name three primary colors."},
        {"messages": [{"role": "user", "content": "What is the capital of France?"},
                      {"role": "assistant", "content": "Paris."}]},
        {"conversations": [{"from": "human", "value": "Write one sentence about the sea."},
                           {"from": "gpt", "value": "The sea is wide."}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def chat_ids(tokenizer, text: str) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


class OracleDrafter:
    """Drafts `sequence` (prompt + the target's own continuation) exactly: every draft is right, or, with
    `err_every` = k, every k-th drafted slot is wrong (rounds then end in rejections at varied slots)."""

    def __init__(self, sequence: list[int], vocab: int, block_size: int, err_every: int = 0):
        self.sequence, self.vocab, self.block_size, self.err_every = list(sequence), vocab, block_size, err_every
        self.calls: list[tuple[torch.Tensor | None, int, int]] = []
        self.drafted = 0

    def reset(self) -> None:
        self.calls = []
        self.drafted = 0

    def draft(self, context, anchor, start):
        self.calls.append((None if context is None else context.clone(), anchor, start))
        B = self.block_size
        want = torch.tensor((self.sequence[start + 1:start + B] + [0] * B)[:B - 1])
        if self.err_every:
            slot = self.drafted + torch.arange(1, self.block_size)
            want = torch.where(slot % self.err_every == 0, (want + 1) % self.vocab, want)
            self.drafted += self.block_size - 1
        logits = torch.full((self.block_size - 1, self.vocab), -30.0)
        logits[torch.arange(self.block_size - 1), want] = 30.0
        return logits


class TableDrafter:
    """q depends only on the anchor and the slot: a fixed random table, unlike the target's p."""

    def __init__(self, table_VmV: torch.Tensor):
        self.table = table_VmV
        self.block_size = table_VmV.shape[1] + 1

    def reset(self) -> None:
        pass

    def draft(self, context, anchor, start):
        return self.table[anchor]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models decode faster on one thread


def tiny_llama(vocab: int = 6, seed: int = 0, head_std: float = 0.3):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # peaked next-token distributions, so that the joint has few dominant cells
        model.lm_head.weight.normal_(0.0, head_std, generator=torch.Generator().manual_seed(seed + 1))
    return model


# ---------------------------------------------------------------- acceptance rules, exact math


def test_greedy_accept_takes_matching_prefix_then_target_token():
    target = torch.tensor([5, 6, 7, 8])

    def accept(draft):
        n, token = greedy_accept(torch.tensor(draft, dtype=torch.long), target[:len(draft) + 1])
        assert n.shape == token.shape == ()  # device tensors: the loop reads them in one transfer
        return int(n), int(token)

    assert accept([5, 6, 7]) == (3, 8)  # all accepted: bonus
    assert accept([5, 0, 7]) == (1, 6)  # first miss replaced by the target's token
    assert accept([0, 6, 7]) == (0, 5)  # later matches do not count
    assert accept([]) == (0, 5)


def test_residual_is_normalized_positive_part():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.5, 0.1, 0.2])
    torch.testing.assert_close(residual(p, q), torch.tensor([0.75, 0.0, 0.25, 0.0]))
    torch.testing.assert_close(residual(p, p), p)  # nothing left over: never used, but a valid distribution


def test_rejection_accept_matches_exact_probabilities():
    """Per draft token x: accepted with probability min(1, p(x)/q(x)); on rejection the token is drawn from
    normalize(max(p - q, 0)); all accepted: bonus from p after the last slot. 200K draws per case, 5 sigma."""
    g = torch.Generator().manual_seed(0)
    p0 = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q0 = torch.tensor([0.2, 0.5, 0.1, 0.2])
    p1 = torch.tensor([0.1, 0.6, 0.1, 0.2])  # after slot 1
    p2 = torch.tensor([0.4, 0.1, 0.4, 0.1])  # after slot 2 (the bonus)
    q1 = torch.tensor([0.25, 0.25, 0.25, 0.25])
    N = 200_000
    for x in range(4):
        if q0[x] == 0:
            continue
        draft = torch.tensor([[x, 1]]).expand(N, 2)
        n, tok = rejection_accept(draft, torch.stack([p0, p1, p2])[None].expand(N, 3, 4),
                                  torch.stack([q0, q1])[None].expand(N, 2, 4), g)
        accept = min(1.0, float(p0[x] / q0[x]))
        rate = (n >= 1).float().mean().item()
        assert abs(rate - accept) < 5 * math.sqrt(accept * (1 - accept) / N) + 1e-9, (x, rate, accept)
        rejected = tok[n == 0]
        if len(rejected):
            emp = torch.bincount(rejected, minlength=4).float() / len(rejected)
            assert (emp - residual(p0, q0)).abs().max() < 5 * math.sqrt(0.25 / len(rejected)), (x, emp)
        # Slot 2 drafts token 1: accepted with min(1, p1(1)/q1(1)) = 1, so whoever passed slot 1 gets the bonus.
        assert bool((n[n >= 1] == 2).all())
        bonus = tok[n == 2]
        if len(bonus):
            emp = torch.bincount(bonus, minlength=4).float() / len(bonus)
            assert (emp - p2).abs().max() < 5 * math.sqrt(0.25 / len(bonus))


def test_rejection_accept_commits_first_token_distributed_as_p():
    """Draft sampled from q, first committed token (accepted draft or residual sample) ~ p exactly."""
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.5, 0.1, 0.2])
    N = 200_000
    draft = torch.multinomial(q, N, replacement=True, generator=g)[:, None]
    n, tok = rejection_accept(draft, torch.stack([p, p])[None].expand(N, 2, 4), q[None, None].expand(N, 1, 4), g)
    first = torch.where(n >= 1, draft[:, 0], tok)
    emp = torch.bincount(first, minlength=4).float() / N
    assert (emp - p).abs().max() < 0.005, emp
    assert abs((n >= 1).float().mean().item() - float(torch.minimum(p, q).sum())) < 0.005


# ---------------------------------------------------------------- the decoding loop on a tiny target


def test_oracle_on_tiny_target_accepts_full_blocks_stops_like_target_and_passes_committed_features():
    model = tiny_llama(vocab=16, seed=3)
    target = Target(model, layer_ids=[0, 1])
    prompt = [3, 1, 4, 1, 5, 9]
    base = target_generate(target, prompt, max_new_tokens=30, temperature=0.0, stop_ids=frozenset())
    B = 5
    oracle = OracleDrafter(prompt + base.tokens, 16, B)
    spec = speculative_generate(target, oracle, prompt, max_new_tokens=30, temperature=0.0, stop_ids=frozenset())
    assert spec.tokens == base.tokens
    assert [s.committed for s in spec.steps[:-1]] == [B] * (len(spec.steps) - 1)
    assert sum(s.committed for s in spec.steps) == 29  # the prefill gave the first of the 30

    # Every committed position reached the drafter once, in order, with the target's own features.
    contexts = torch.cat([c for c, _, _ in oracle.calls], dim=1)
    starts = [s for _, _, s in oracle.calls]
    assert starts[0] == len(prompt) and contexts.shape[1] == starts[-1]
    captured = {}
    hooks = [model.model.layers[k].register_forward_hook(lambda m, a, o, k=k: captured.__setitem__(k, o))
             for k in (0, 1)]
    with torch.no_grad():
        model(torch.tensor([prompt + spec.tokens]), use_cache=False)
    for h in hooks:
        h.remove()
    full = torch.cat([captured[0], captured[1]], dim=-1)[:, :starts[-1]]
    torch.testing.assert_close(contexts, full, atol=1e-5, rtol=1e-4)

    # A stop token inside an accepted block ends the output right there, as plain decoding does.
    stop = frozenset({base.tokens[7]})
    base_stop = target_generate(target, prompt, max_new_tokens=30, temperature=0.0, stop_ids=stop)
    spec_stop = speculative_generate(target, oracle, prompt, max_new_tokens=30, temperature=0.0, stop_ids=stop)
    assert spec_stop.tokens == base_stop.tokens and spec_stop.tokens[-1] in stop
    target.close()


def _joint_exact(model, prompt: list[int], V: int, L: int, temperature: float) -> torch.Tensor:
    """P(t1..tL) [V]*L of the target's own sampling, by enumerating every prefix in one forward."""
    prefixes = list(itertools.product(range(V), repeat=L - 1))
    ids = torch.tensor([prompt + list(p) for p in prefixes])
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[:, len(prompt) - 1:].float()
    probs = torch.softmax(logits / temperature, dim=-1)  # [V^(L-1), L, V]
    joint = torch.zeros([V] * L, dtype=torch.float64)
    for row, prefix in enumerate(prefixes):
        pr = 1.0
        for i, t in enumerate(prefix):
            pr *= float(probs[row, i, t])
        joint[prefix] = pr * probs[row, L - 1].double()
    return joint


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, critical value at alpha = 1e-3), cells with expected count < 5 pooled into one."""
    n = counts.sum()
    expected = (probs * n).flatten()
    counts = counts.flatten().double()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    z = 3.09  # Wilson-Hilferty approximation of the chi-square quantile
    return stat, df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampling_keeps_target_distribution():
    V, B, L, T, runs = 6, 4, 4, 0.8, 1500
    model = tiny_llama(vocab=V, seed=0)
    target = Target(model)
    prompt = [1, 2, 3, 4, 5]
    exact = _joint_exact(model, prompt, V, L, T)
    # q: the target's marginal p(t_{1+k} | t1) for slot k, plus noise. Close enough to p that every
    # outcome (rejection at slot 1 or 2, full acceptance + bonus) is common, never equal to p.
    marginals = [exact.sum(dim=(2, 3)), exact.sum(dim=(1, 3)), exact.sum(dim=(1, 2))]
    cond = torch.stack([m / m.sum(1, keepdim=True) for m in marginals], dim=1)  # [anchor, slot, V]
    noise = torch.randn(V, B - 1, V, generator=torch.Generator().manual_seed(7))
    table = (cond.log() * T).float() + noise
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros([V] * L, dtype=torch.long)
    hist = torch.zeros(B + 1, dtype=torch.long)
    for _ in range(runs):
        out = speculative_generate(target, TableDrafter(table), prompt, max_new_tokens=L, temperature=T,
                                   stop_ids=frozenset(), generator=g)
        counts[tuple(out.tokens)] += 1
        for s in out.steps:
            hist[s.committed] += 1
    assert min(hist[1:4]) > runs / 5  # rejections at slot 1 and 2, and full acceptance, all common

    stat, critical = _chi_square(counts, exact)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f}: not the target's distribution"

    # Power: a loop that accepted every draft would give t2, t3 from q; the same test must reject it
    # (measured: a residual drawn from p instead of max(p - q, 0), or a bonus from the wrong slot, fail too).
    q = torch.softmax(table / T, dim=-1).double()
    p1 = exact.sum(dim=(1, 2, 3))
    p4 = exact / exact.sum(dim=3, keepdim=True).clamp_min(1e-300)
    always = p1[:, None, None, None] * q[:, 0][:, :, None, None] * q[:, 1][:, None, :, None] * p4
    stat_alt, _ = _chi_square(counts, always)
    assert stat_alt > 5 * critical, (stat_alt, critical)


def test_broken_verifier_is_reported(monkeypatch):
    model = tiny_llama(vocab=16, seed=3)
    target = Target(model)
    prompts = [(11, [3, 1, 4, 1, 5]), (12, [2, 7, 1, 8])]
    kw = dict(max_new_tokens=12, temperature=0.0, stop_ids=frozenset(), warmup=False)
    good = evaluate(target, TableDrafter(torch.zeros(16, 3, 16)), prompts, **kw)
    assert good["lossless"] is True and good["mismatches"] == []

    real = speculative.greedy_accept
    monkeypatch.setattr(speculative, "greedy_accept",
                        lambda d, t: (lambda n, tok: (n, (tok + 1) % 16))(*real(d, t)))  # commits a wrong token
    bad = evaluate(target, TableDrafter(torch.zeros(16, 3, 16)), prompts, **kw)
    assert bad["lossless"] is False and bad["mismatches"] == [11, 12]
    d = bad["mismatch_details"][0]
    assert d["prompt"] == 11 and d["position"] == 1 and d["spec_token"] == (d["target_token"] + 1) % 16
    out = io.StringIO()
    from rich.console import Console

    render_report(bad, Console(file=out, width=120))
    assert "NOT LOSSLESS" in out.getvalue() and "prompt 11" in out.getvalue()
    target.close()


def _no_path_scores():
    raise AssertionError("equal outputs need no teacher forcing")


def test_summary_counts_slots_and_hist():
    from dflash_pipeline.eval.speculative import Generation, Step

    steps = [Step(3, 3, 4), Step(3, 1, 2), Step(3, 0, 1), Step(2, 2, 2)]  # last: truncated by a stop token
    spec = Generation([0] * 10, 1.0, steps)
    base = Generation([0] * 10, 2.0, top1=[2.0] * 10, top2=[1.0] * 10)
    check = check_greedy(5, spec.tokens, base.tokens, base.top1, base.top2, torch.float32, _no_path_scores)
    rep = summarize([PromptResult(Prompt("p.jsonl", 5, 0, [1]), spec, base, check)], block_size=4, temperature=0.0,
                    dtype=torch.float32)
    assert rep["tau"] == 9 / 4 and rep["accept_hist"] == [0, 1, 2, 0, 1]
    # slot 1: reached 4, accepted 3; slot 2: reached 3 (n >= 1), accepted 2; slot 3: reached 1 of drafted-3 steps.
    assert rep["accept_rate_per_position"] == [3 / 4, 2 / 3, 1 / 1]
    assert rep["speedup"] == pytest.approx(2.0) and rep["lossless"] is True


# ---------------------------------------------------------------- hybrid targets (linear attention)


def tiny_hybrid(model_type: str, vocab: int = 64, seed: int = 0):
    """A random Qwen3.5-family text model: 4 layers, 3 Gated DeltaNet (linear attention) + 1 full attention.
    Weights drawn wide (std 0.1) so that the linear layers' states move the logits."""
    import transformers

    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=512, initializer_range=0.1)
    if model_type == "qwen3_5_moe":
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    config, model = {"qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
                     "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM")}[model_type]
    torch.manual_seed(seed)
    return getattr(transformers, model)(getattr(transformers, config)(**kw)).eval()


def _layer_states(cache) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(kind, a, b) per layer: linear layers (conv window, recurrent state), attention layers (keys, values)."""
    out = []
    for layer in cache.kv.layers:
        if hasattr(layer, "recurrent_states"):
            out.append(("linear", layer.conv_states[0][..., -layer.conv_kernel_size[0]:], layer.recurrent_states[0]))
        else:
            out.append(("attention", layer.keys, layer.values))
    return out


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_verify_then_rollback_leaves_the_committed_states(model_type, monkeypatch):
    """After a verify of [anchor, 5 drafts] that keeps `keep` of them, every layer's state equals the state
    after feeding only the committed tokens one by one, as plain decoding does: linear layers' convolution
    windows and recurrent states, attention layers' keys and values, and the next token's logits.
    The cause of the issue, on the same states: cropping without the restore and replay (what transformers'
    crop did up to 5.24) leaves the recurrent states holding the rejected drafts, off by as much as the
    states' own size; the block (chunked kernel) and token-by-token (recurrent kernel) paths agree to
    rounding."""
    from dflash_pipeline.eval import rollback

    model = tiny_hybrid(model_type)
    target = Target(model)
    prompt, block = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [7, 8, 10, 11, 12, 13]
    P = len(prompt)

    def fresh():
        cache = target.new_cache()
        target.forward(prompt, 0, cache, last_only=True)
        return cache

    for keep in (1, 2, 4, 6):
        rolled = fresh()
        target.forward(block, P, rolled)
        target.crop(rolled, P + keep)
        assert int(rolled.kv.get_seq_length()) == P + keep  # 5.25 reads it from layer 0, a linear one
        stepwise = fresh()
        for j in range(keep):
            target.forward([block[j]], P + j, stepwise)
        as_block = fresh()
        target.forward(block[:keep], P, as_block)
        target.crop(as_block, P + keep)
        for (kind, a, b), (_, c, d), (_, e, f) in zip(_layer_states(rolled), _layer_states(stepwise),
                                                      _layer_states(as_block)):
            for x, y, z in ((a, c, e), (b, d, f)):
                assert x.shape == y.shape, (keep, kind)
                torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)  # rollback == committed tokens only
                torch.testing.assert_close(z, y, atol=1e-5, rtol=1e-4)  # chunked == recurrent kernel
        if keep < len(block):  # the cause: a crop that leaves the linear layers' states as the verify left them
            crop_only = fresh()
            target.forward(block, P, crop_only)
            with monkeypatch.context() as m:
                m.setattr(rollback.LinearStates, "restore", lambda self: None)
                m.setattr(rollback.MixerReplay, "replay", lambda self, inputs, keep: None)
                target.crop(crop_only, P + keep)
            linear = [(s1, s2) for s1, s2 in zip(_layer_states(crop_only), _layer_states(stepwise))
                      if s1[0] == "linear"]
            assert len(linear) == 3
            for (_, _, state), (_, _, want_state) in linear:
                assert (state - want_state).abs().max() > 0.1 * want_state.abs().max()

        nxt = [block[keep] if keep < len(block) else 0]
        torch.testing.assert_close(target.forward(nxt, P + keep, rolled)[0],
                                   target.forward(nxt, P + keep, stepwise)[0], atol=1e-5, rtol=1e-4)
    target.close()


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_hybrid_speculative_decoding_equals_plain_decoding(model_type, monkeypatch):
    """fp32, token for token, on several prompts: drafters that are right, wrong at every 3rd slot (rounds
    end at varied slots), or always wrong. The same prompts without the rollback (transformers' crop
    alone) leave plain decoding: the test has the power to see the issue."""
    from dflash_pipeline.eval import rollback

    V, B = 64, 6
    model = tiny_hybrid(model_type, vocab=V, seed=1)
    target = Target(model)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 12, 20)]
    kw = dict(max_new_tokens=32, temperature=0.0, stop_ids=frozenset())
    bases = [target_generate(target, p, **kw) for p in prompts]
    committed = []
    for p, base in zip(prompts, bases):
        for drafter in (OracleDrafter(p + base.tokens, V, B), OracleDrafter(p + base.tokens, V, B, err_every=3),
                        TableDrafter(torch.zeros(V, B - 1, V))):
            spec = speculative_generate(target, drafter, p, **kw)
            assert spec.tokens == base.tokens, (model_type, p, drafter)
            committed += [s.committed for s in spec.steps[:-1]]
    assert {1, 2, 3, B} <= set(committed)  # rejections at the first slots and full blocks

    monkeypatch.setattr(rollback.LinearStates, "restore", lambda self: None)
    monkeypatch.setattr(rollback.MixerReplay, "replay", lambda self, inputs, keep: None)
    differ = sum(speculative_generate(target, OracleDrafter(p + b.tokens, V, B, err_every=3), p, **kw).tokens
                 != b.tokens for p, b in zip(prompts, bases))
    assert differ >= 2


# ---------------------------------------------------------------- the graphed path (static caches)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_graphed_decoding_equals_plain_decoding_and_the_eager_path(kind):
    """Plain and speculative decoding on the static-cache runner and drafter: transformers' greedy output,
    the same rounds as the eager path (same drafts, same acceptances, the drafter's logits equal), full
    blocks for an oracle, and at T > 0 the same tokens as the eager path from the same random stream."""
    model, drafter, B, N = tiny_causal_lm(kind), tiny_drafter([0, 1]), 4, 40
    prompt = [5, 17, 3, 44, 9, 12, 80, 1, 33]
    want = hf_greedy(model, prompt, N)
    kw = dict(max_new_tokens=N, stop_ids=frozenset())
    eager = Target(model, [0, 1])
    steered_ref = Steered(DFlashDraft(drafter, eager), prompt + want)
    ref = speculative_generate(eager, steered_ref, prompt, temperature=0.0, **kw)
    ref_t = speculative_generate(eager, DFlashDraft(drafter, eager), prompt, temperature=0.8,
                                 generator=torch.Generator().manual_seed(3), **kw)
    eager.close()
    assert ref.tokens == want and {s.accepted for s in ref.steps} == {0, 1, 2, 3}

    target = GraphedTarget(model, [0, 1], max_len=len(prompt) + N + B, block_size=B)
    graphed = GraphedDraft(drafter, target, max_len=len(prompt) + N + B)
    assert target_generate(target, prompt, temperature=0.0, **kw).tokens == want
    steered = Steered(graphed, prompt + want)
    spec = speculative_generate(target, steered, prompt, temperature=0.0, **kw)
    assert spec.tokens == want and spec.steps == ref.steps
    torch.testing.assert_close(torch.stack(steered.seen), torch.stack(steered_ref.seen), atol=1e-4, rtol=1e-4)
    oracle = speculative_generate(target, OracleDrafter(prompt + want, 96, B), prompt, temperature=0.0, **kw)
    assert oracle.tokens == want and {s.committed for s in oracle.steps[:-1]} == {B}
    spec_t = speculative_generate(target, graphed, prompt, temperature=0.8, generator=torch.Generator().manual_seed(3),
                                  **kw)
    assert spec_t.tokens == ref_t.tokens and spec_t.steps == ref_t.steps
    target.close()


def test_a_prompt_longer_than_the_block_reaches_the_drafter_whole():
    """The prompt's context is appended eagerly when it exceeds B; the rounds then equal the eager path."""
    model, drafter = tiny_causal_lm("llama", seed=4), tiny_drafter([0, 2], block_size=3, seed=1)
    prompt = list(range(10, 40))
    eager = Target(model, [0, 2])
    ref = speculative_generate(eager, DFlashDraft(drafter, eager), prompt, max_new_tokens=12, temperature=0.0,
                               stop_ids=frozenset())
    eager.close()
    target = GraphedTarget(model, [0, 2], max_len=48, block_size=3)
    spec = speculative_generate(target, GraphedDraft(drafter, target, max_len=48), prompt, max_new_tokens=12,
                                temperature=0.0, stop_ids=frozenset())
    target.close()
    assert spec.tokens == ref.tokens and spec.steps == ref.steps


def test_hybrid_target_decodes_eagerly_and_says_so_in_one_line():
    model = tiny_causal_lm("qwen3")
    model.config.layer_types = ["linear_attention", "full_attention", "full_attention"]
    out = io.StringIO()
    target, drafter = make_participants(model, tiny_drafter([0, 1]), [(0, [1, 2, 3])],
                                        EvalConfig(drafter="unused", max_new_tokens=8), LiveLine(stream=out))
    assert type(target) is Target and type(drafter) is DFlashDraft
    assert out.getvalue().count("\n") == 1 and "eager decoding" in out.getvalue()
    assert "linear_attention" in out.getvalue()
    target.close()


# ---------------------------------------------------------------- the real target


def test_random_drafter_is_lossless_on_real_target(tmp_path, smollm_dir, smollm_tokenizer, smollm_model):
    drafter = export_random(smol_drafter_config(), tmp_path / "drafter")
    cfg = EvalConfig(drafter=drafter, target=str(smollm_dir), prompts=[write_prompts(tmp_path / "p.jsonl")],
                     num_prompts=3, max_new_tokens=24)
    report = run_eval(cfg)
    assert report["lossless"] is True and report["mismatches"] == [] and report["tie_divergences"] == []
    assert report["lossless_rule"].startswith("exact") and report["dtype"] == "float32"
    assert list(report["per_file"]) == cfg.prompts and report["per_file"][cfg.prompts[0]]["tau"] == report["tau"]
    assert report["decoding"] == "graphed" and report["step_ms_clock"] == "host clock" and report["processes"] == 1
    assert report["decode_attention"] == "sdpa"  # `auto` on the CPU; the report names the kernel its numbers came from
    assert all(report["step_ms"][k] > 0 for k in ("target_decode", "target_verify", "drafter"))
    ms = report["step_ms"]
    assert report["speedup_from_step_times"] == pytest.approx(
        report["tau"] * ms["target_decode"] / (ms["target_verify"] + ms["drafter"]))
    assert report["prompts"] == 3 and report["block_size"] == 8
    assert 1.0 <= report["tau"] < 1.5
    assert sum(report["accept_hist"]) == report["steps"] and len(report["accept_hist"]) == 9
    assert report["tok_s_spec"] > 0 and report["tok_s_target"] > 0 and report["speedup"] > 0
    json.dumps(report)  # the CLI's --json prints it as is

    # The reference itself: our plain greedy loop equals transformers' generate on one prompt.
    stops = stop_token_ids(smollm_tokenizer, smollm_model)
    assert smollm_tokenizer.convert_tokens_to_ids("<|im_end|>") in stops
    ids = chat_ids(smollm_tokenizer, "Name three primary colors.")
    with torch.no_grad():
        hf = smollm_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                   eos_token_id=sorted(stops), pad_token_id=sorted(stops)[0])
    for make in (lambda: Target(smollm_model), lambda: GraphedTarget(smollm_model, [], max_len=len(ids) + 40,
                                                                     block_size=8)):
        target = make()  # one at a time: the graphed one owns the model's attention until closed
        ours = target_generate(target, ids, max_new_tokens=24, temperature=0.0, stop_ids=stops)
        target.close()
        assert ours.tokens == hf[0, len(ids):].tolist()


def test_oracle_drafter_on_real_target_commits_full_blocks(smollm_model, smollm_tokenizer):
    target = Target(smollm_model)
    stops = stop_token_ids(smollm_tokenizer, smollm_model)
    results = []
    for sid, text in enumerate(["What is the capital of France?", "Count from one to ten."]):
        ids = chat_ids(smollm_tokenizer, text)
        base = target_generate(target, ids, max_new_tokens=24, temperature=0.0, stop_ids=stops)
        spec = speculative_generate(target, OracleDrafter(ids + base.tokens, 49152, 8), ids, max_new_tokens=24,
                                    temperature=0.0, stop_ids=stops)
        assert spec.tokens == base.tokens
        assert all(s.committed == 8 for s in spec.steps[:-1]) and spec.steps[-1].committed <= 8
        check = check_greedy(sid, spec.tokens, base.tokens, base.top1, base.top2, torch.float32, _no_path_scores)
        results.append(PromptResult(as_prompt((sid, ids)), spec, base, check))
    report = summarize(results, block_size=8, temperature=0.0, dtype=torch.float32)
    assert report["lossless"] is True and report["tau"] > 6
    assert report["accept_rate_per_position"] == [1.0] * 7
    target.close()


# ---------------------------------------------------------------- refusals


def test_mismatched_drafter_is_refused_with_one_line(tmp_path, smollm_dir):
    cfg = smol_drafter_config(hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16)
    drafter = export_random(cfg, tmp_path / "small")
    with pytest.raises(DFlashError) as e:
        run_eval(EvalConfig(drafter=drafter, target=str(smollm_dir)))
    assert "drafter hidden 64 != target hidden 576" in str(e.value) and "\n" not in str(e.value)

    deep = export_random(smol_drafter_config(target_layer_ids=[1, 31], num_target_layers=32), tmp_path / "deep")
    with pytest.raises(DFlashError, match=r"target_layer_ids \[31\] are not layers of the target \(it has 30\)"):
        run_eval(EvalConfig(drafter=deep, target=str(smollm_dir)))
    with pytest.raises(DFlashError, match="no such drafter folder"):
        run_eval(EvalConfig(drafter=str(tmp_path / "missing"), target=str(smollm_dir)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DFlashError, match="not an exported drafter"):
        run_eval(EvalConfig(drafter=str(tmp_path / "empty"), target=str(smollm_dir)))


@pytest.mark.parametrize("bad", [dict(num_prompts=0), dict(max_new_tokens=0), dict(temperature=-1.0),
                                 dict(block_size=1), dict(dtype="int8"), dict(device="tpu9")])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        EvalConfig(drafter="d", **bad)


def test_sliding_window_layers_keep_only_their_window():
    """Past recording (for rollbacks) keeps a sliding layer's past until a crop; plain decoding never
    rolls back, and transformers 5.17 then handed the layer its whole past (a shape error once past the
    window). Every forward first cuts the windows back: a sliding layer holds at most its window."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    W = 4
    cfg = Gemma3TextConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                           sliding_window=W, layer_types=["sliding_attention", "full_attention"],
                           bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    target = Target(Gemma3ForCausalLM(cfg).eval())
    prompt = list(range(3, 13))
    base = target_generate(target, prompt, max_new_tokens=12, temperature=0.0, stop_ids=frozenset())
    cache = target.new_cache()
    logits, _ = target.forward(prompt, 0, cache, last_only=True)
    for i, t in enumerate(base.tokens[:-1]):
        assert int(logits[-1].argmax()) == t
        logits, _ = target.forward([t], len(prompt) + i, cache)
        sliding, full = cache.kv.layers
        assert sliding.keys.shape[-2] <= W and full.keys.shape[-2] == len(prompt) + i + 1
    assert int(logits[-1].argmax()) == base.tokens[-1]
    spec = speculative_generate(target, OracleDrafter(prompt + base.tokens, 32, 5, err_every=3), prompt,
                                max_new_tokens=12, temperature=0.0, stop_ids=frozenset())
    assert spec.tokens == base.tokens
    target.close()
