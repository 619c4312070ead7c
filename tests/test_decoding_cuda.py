"""CUDA graphs of the decoding runner and the static drafter (skipped without CUDA).

- graph replay == the same runner run eagerly, on the same inputs: logits, argmax and features of the
  decode and verify steps after prefills of several lengths and rollbacks (fp32 and bf16), and the
  drafter's round;
- fp32 greedy speculative decoding on graphs == transformers' greedy generate on the GPU, for tiny
  Llama / Qwen3 (sliding) / Gemma 3 and a random SmolLM2-135M-shaped target, with acceptances of
  every length; once more with the steps compiled (`compile=True`);
- the round's tree builder as one captured graph == the same builder run eagerly, call after call with
  new logits, anchors and depth bounds (its outputs live in the graph's pool and must be refreshed);
- fp32 greedy tree decoding (`--tree-budget`) on graphs == transformers' greedy generate: a captured
  verify step of q = N + 1 with the tree's depths as positions and its ancestor mask, the walk and the
  path's compaction on the device, paths of every length, second guesses included.

`DFLASH_TEST_DEVICE=cpu` runs these tests on the CPU (eager, no graphs): a check of the tests
themselves before GPU time is spent.
"""

from __future__ import annotations

import os

import pytest
import torch

from dflash_pipeline.decoding.drafter import StaticDrafter
from dflash_pipeline.decoding.runner import DecodingRunner
from dflash_pipeline.eval.graphed import GraphedDraft, GraphedTarget
from dflash_pipeline.eval.speculative import speculative_generate, target_generate
from dflash_pipeline.eval.tree_decoding import tree_generate
from decoding_helpers import Steered, hf_greedy, tiny_causal_lm, tiny_drafter

DEVICE = os.environ.get("DFLASH_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs CUDA")


def on_device(model, dtype=torch.float32):
    return model.to(device=DEVICE, dtype=dtype)


def drive(runner: DecodingRunner, prompts: list[list[int]], B: int) -> list[torch.Tensor]:
    """A fixed script of prefills, decode and verify steps with rollbacks; every output it saw."""
    g = torch.Generator().manual_seed(0)
    V = runner.inputs(1).logits_RqV.shape[-1]
    seen = []
    for prompt in prompts:
        logits, feats = runner.prefill(0, prompt, features=True)
        seen += [logits, feats]
        for q, keep in [(1, 1), (B, 3), (1, 1), (B, 0), (B, B), (1, 1)]:
            io = runner.inputs(q)
            io.ids_Rq.copy_(torch.randint(0, V, (1, q), generator=g))
            runner.step(q)
            seen += [io.logits_RqV.clone(), io.features_RqF.clone()]
            runner.set_length(0, runner.length(0) + keep)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_graph_replay_equals_eager_runner(kind, dtype):
    model = on_device(tiny_causal_lm(kind), dtype)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], list(range(1, 40)), [7]]
    outs = {}
    for graphs in (False, True):
        with DecodingRunner(model, max_len=96, layer_ids=[0, 1], graphs=graphs and DEVICE == "cuda") as runner:
            outs[graphs] = drive(runner, prompts, B=5)
    # fp32: equal up to rounding; bf16: up to a few units in the last place (the replayed kernels may
    # be other algorithms of the same math than the eager calls chose).
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=3e-2)
    for eager, graphed in zip(outs[False], outs[True]):
        torch.testing.assert_close(graphed.float(), eager.float(), **tol)


def test_drafter_graph_equals_eager_round():
    model = on_device(tiny_causal_lm("qwen3"))
    drafter = tiny_drafter([0, 1]).to(DEVICE)
    emb = model.get_input_embeddings().weight
    seen = {}
    for graphs in (False, True):
        static = StaticDrafter(drafter, embed=lambda ids: torch.nn.functional.embedding(ids, emb),
                               head=lambda h: model.get_output_embeddings()(h).float(), vocab_size=96,
                               feature_dtype=torch.float32, max_len=64, graphs=graphs and DEVICE == "cuda")
        g = torch.Generator().manual_seed(1)
        out, start = [], 0
        for n in [3, 1, 4, 2, 4]:
            start += n
            static.io.ctx_RBF[0, :n].copy_(torch.randn(n, 128, generator=g))
            static.io.n_new_R.fill_(n)
            static.io.start_R.fill_(start)
            static.io.ids_RB[0, 0] = int(torch.randint(0, 95, (), generator=g))
            static.step()
            out.append(static.io.logits_RmV.clone())
        seen[graphs] = torch.stack(out)
    torch.testing.assert_close(seen[True], seen[False], atol=1e-5, rtol=1e-4)


def smollm_shaped():
    """A random Llama of SmolLM2-135M's shape (30 layers, hidden 576, 9 heads / 3 KV heads, vocab 49152)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3", "smollm"])
def test_fp32_graphed_speculative_decoding_equals_generate(kind):
    speculative_equals_generate(kind, compile=False)


@pytest.mark.parametrize("kind", ["qwen3", "smollm"])
def test_fp32_graphed_speculative_decoding_with_the_written_out_attention(kind, monkeypatch):
    """DFLASH_DECODE_ATTENTION=math (Q K^T in fp32, softmax, P V as GEMMs) in the captured steps: still
    exactly `generate()`."""
    from dflash_pipeline.decoding import attention

    monkeypatch.setattr(attention, "KERNEL", "math")
    speculative_equals_generate(kind, compile=False)


@pytest.mark.parametrize("compile", [False, True])
def test_written_out_attention_in_bf16_takes_fp32_scores_from_the_gemm(compile):
    """On CUDA the default kernel's scores come out of the bf16 GEMM in fp32, K read in place from a cache
    cut to the attended slots (no copy): as close to an fp64 reference as the upcast form and SDPA, and
    the same under torch.compile (the runner's `compile=True`)."""
    from dflash_pipeline.decoding import attention
    from dflash_pipeline.train.masks import attend

    if DEVICE != "cuda" or not attention._BMM_FP32_OUT:
        pytest.skip("the fp32-out GEMM is a CUDA path")
    g = torch.Generator(device="cpu").manual_seed(0)
    R, hk, G, D, S = 3, 2, 8, 64, 300
    cache = torch.randn(R, hk, 512, D, generator=g).to(DEVICE, torch.bfloat16)
    key = cache[:, :, :S]                                              # the runner's attended view of its buffer
    assert key.reshape(R * hk, S, D).data_ptr() == key.data_ptr()       # merged without a copy
    value = torch.randn(R, hk, S, D, generator=g).to(DEVICE, torch.bfloat16)
    q = (6 * torch.randn(R, hk, G, D, generator=g)).to(DEVICE, torch.bfloat16)  # peaked scores of order 10-40
    visible = torch.rand(R, 1, G, S, generator=g).to(DEVICE) < 0.8
    visible[..., 0] = True
    bias = torch.zeros(visible.shape, device=DEVICE, dtype=torch.bfloat16).masked_fill_(~visible, float("-inf"))
    scale = D ** -0.5
    fn = torch.compile(attention.written_out_attention, dynamic=False) if compile else attention.written_out_attention
    out = fn(q, key, value, bias, scale)
    probs = torch.softmax(q.double() @ key.double().transpose(2, 3) * scale + bias.double(), dim=-1)
    ref = probs @ value.double()
    err = (out.double() - ref).abs().max().item()
    upcast = torch.softmax(q.float() @ key.float().transpose(2, 3) * scale + bias.float(), dim=-1)
    err_upcast = ((upcast.to(torch.bfloat16) @ value).double() - ref).abs().max().item()
    err_sdpa = (attend(q, key, value, bias, scale).double() - ref).abs().max().item()
    assert out.dtype == torch.bfloat16 and out.shape == (R, hk, G, D)
    assert err <= 1.5 * max(err_upcast, err_sdpa), (err, err_upcast, err_sdpa)


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("R,hk,G,D", [(1, 8, 4, 128), (128, 8, 4, 128), (1, 3, 3, 64), (64, 3, 3, 64)])
def test_split_decode_kernel_on_the_gpu_is_as_close_as_the_written_out_one(R, hk, G, D, compile):
    """The split-KV Triton kernel (one-token steps on CUDA) with the real tensor-core dot: Qwen3-8B and
    SmolLM2 head layouts at batch 1 (many chunks merged) and at generation's rows (one chunk each), K/V
    read in place from a cache view, rows of different lengths whose slots past their end hold NaN; as
    close to fp64 as the written-out kernel, and the same under torch.compile (an opaque custom op)."""
    from dflash_pipeline.decoding import attention, split_attention

    if DEVICE != "cuda" or not split_attention.available():
        pytest.skip("a CUDA kernel")
    g = torch.Generator(device="cpu").manual_seed(R + D)
    S = 1088
    cache_k = torch.randn(R, hk, 1280, D, generator=g).to(DEVICE, torch.bfloat16)
    cache_v = torch.randn(R, hk, 1280, D, generator=g).to(DEVICE, torch.bfloat16)
    key, value = cache_k[:, :, :S], cache_v[:, :, :S]
    q = (6 * torch.randn(R, hk, G, D, generator=g)).to(DEVICE, torch.bfloat16)   # peaked scores
    n = torch.linspace(1, S, R).long().to(DEVICE) if R > 1 else torch.tensor([S - 37], device=DEVICE)
    visible = torch.arange(S, device=DEVICE)[None] < n[:, None]
    bias = torch.zeros(R, 1, G, S, device=DEVICE, dtype=torch.bfloat16).masked_fill_(~visible[:, None, None], float("-inf"))
    scale = D ** -0.5
    ref = split_attention.reference(q, key, value, n, scale)
    err_written = (attention.written_out_attention(q, key, value, bias, scale).double() - ref).abs().max().item()
    for r in range(R):
        cache_k[r, :, int(n[r]):] = float("nan")
        cache_v[r, :, int(n[r]):] = float("nan")
    fn = split_attention.split_decode_attention
    if compile:
        torch._dynamo.reset()   # one compiled code per shape of this test's cases: a fresh cache for each
        fn = torch.compile(fn, dynamic=False)
    out = fn(q, key, value, n, scale)
    assert out.dtype == torch.bfloat16 and out.shape == (R, hk, G, D) and torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item()
    assert err <= 2 * max(err_written, 2 ** -9), (err, err_written)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_graphed_bf16_rows_decode_alike_with_the_split_and_the_written_out_kernels(kind, monkeypatch):
    """Three rows of different lengths in captured (and compiled) one-token steps, bf16, the same tokens
    fed to both: the split kernel (`split_decode`, as `dflash generate` runs it) gives the written-out
    kernel's logits within bf16 noise and its tokens wherever the margin is clear of that noise; sliding
    windows (qwen3, gemma3) included."""
    from dflash_pipeline.decoding import attention, split_attention
    from test_split_attention import PROMPTS, assert_same_decoding, decode_rows

    if DEVICE != "cuda" or not split_attention.available():
        pytest.skip("a CUDA kernel")
    model = on_device(tiny_causal_lm(kind), torch.bfloat16)
    monkeypatch.setattr(attention, "KERNEL", "math")
    want_toks, want = decode_rows(model, PROMPTS, 30, split_decode=True)
    monkeypatch.setattr(attention, "KERNEL", "auto")
    for compile in (False, True):
        _, got = decode_rows(model, PROMPTS, 30, split_decode=True, forced=want_toks, compile=compile)
        assert_same_decoding(want, got)


def test_compiled_graphed_speculative_decoding_equals_generate():
    """The same with the steps' forward and the drafter's elementwise chains through torch.compile."""
    speculative_equals_generate("qwen3", compile=True)


def speculative_equals_generate(kind: str, compile: bool) -> None:
    from dflash_pipeline.train.model import DFlashDrafter, DrafterConfig, init_drafter_weights

    if kind == "smollm":
        model = smollm_shaped()
        cfg = DrafterConfig(hidden_size=576, intermediate_size=1536, num_layers=1, num_heads=9, num_kv_heads=3,
                            head_dim=64, vocab_size=49152, block_size=8, mask_token_id=16,
                            target_layer_ids=[1, 8, 14, 20, 27], num_target_layers=30)
        drafter = DFlashDrafter(cfg)
        init_drafter_weights(drafter, generator=torch.Generator().manual_seed(0))
        drafter, layers, B = drafter.to(DEVICE).eval(), cfg.target_layer_ids, 8
    else:
        model, drafter, layers, B = on_device(tiny_causal_lm(kind)), tiny_drafter([0, 1]).to(DEVICE), [0, 1], 4
    prompt = [5, 17, 3, 44, 9, 12, 80, 1, 33]
    N = 48
    want = hf_greedy(model, prompt, N)
    target = GraphedTarget(model, layers, max_len=len(prompt) + N + B, block_size=B, compile=compile)
    try:
        kw = dict(max_new_tokens=N, temperature=0.0, stop_ids=frozenset())
        assert target_generate(target, prompt, **kw).tokens == want
        steered = Steered(GraphedDraft(drafter, target, max_len=len(prompt) + N + B, compile=compile), prompt + want)
        spec = speculative_generate(target, steered, prompt, **kw)
        assert spec.tokens == want
        assert {s.accepted for s in spec.steps} >= set(range(B - 1))  # acceptances of every length
    finally:
        target.close()


class SecondGuess(Steered):
    """Steered (the first j slots forced to the target's continuation, j = round mod B), and on odd rounds
    a wrong token forced just above the right one at slot 1: the right path is then a second guess, which a
    chain rejects and a tree follows."""

    def draft(self, context, anchor, start):
        logits = super().draft(context, anchor, start)
        if len(self.seen) % 2 and len(self.seen) % self.block_size:  # odd round, slot 1 forced
            right = int(logits[0].argmax())
            logits[0, (right + 1) % logits.shape[-1]] = logits[0, right] + 1.0
        return logits


@pytest.mark.parametrize("kind,budget", [("llama", 8), ("qwen3", 8), ("gemma3", 8), ("llama", 256)])
def test_fp32_graphed_tree_decoding_equals_generate(kind, budget):
    model, drafter, layers, B = on_device(tiny_causal_lm(kind)), tiny_drafter([0, 1]).to(DEVICE), [0, 1], 4
    prompt = [5, 17, 3, 44, 9, 12, 80, 1, 33]
    N = 48
    want = hf_greedy(model, prompt, N)
    max_len = len(prompt) + N + budget + 1
    target = GraphedTarget(model, layers, max_len=max_len, block_size=B)
    try:
        target.runner.prepare((1, B, budget + 1))  # the tree's verify graph too, before decoding
        draft = SecondGuess(GraphedDraft(drafter, target, max_len=max_len), prompt + want)
        out = tree_generate(target, draft, prompt, budget=budget, max_new_tokens=N, temperature=0.0,
                            stop_ids=frozenset())
        assert out.tokens == want
        assert {s.accepted for s in out.steps} >= set(range(B))  # paths of every length, to the leaves
        chain = speculative_generate(target, SecondGuess(GraphedDraft(drafter, target, max_len=max_len),
                                                         prompt + want),
                                     prompt, max_new_tokens=N, temperature=0.0, stop_ids=frozenset())
        assert chain.tokens == want  # a chain block after tree blocks: offsets and mask back to the chain's
        assert len(out.steps) < len(chain.steps)  # the second guesses took the tree further
    finally:
        target.close()


def test_step_timer_keeps_every_time_and_drains_finished_events():
    from dflash_pipeline.decoding.graphs import StepTimer

    x = torch.randn(256, 256, device=DEVICE)
    timer = StepTimer(torch.device(DEVICE))
    for _ in range(300):
        with timer("matmul"):
            x = torch.tanh(x @ x)
    if DEVICE == "cuda":
        assert len(timer._events["matmul"]) <= 257  # drained as they finish, not all kept
    times = timer.times("matmul")
    assert len(times) == 300 and min(times) > 0
    assert timer.summary()["matmul"] == sorted(times)[150]


def test_a_compiled_step_whose_guards_fail_at_capture_compiles_outside_it():
    """The capture's call meets an input the compiled code has no guard for: GraphedStep compiles it in
    one more warm-up, captures again, replays the right numbers, and the process's random numbers still
    work afterwards (a compile inside a capture would leave the CUDA generator mid-capture: "Offset
    increment outside graph capture")."""
    from dflash_pipeline.decoding.graphs import GraphedStep

    if DEVICE != "cuda":
        pytest.skip("CUDA graphs")
    torch._dynamo.reset()
    try:
        f = torch.compile(lambda x: (x.float().sin() + 1).sum(), dynamic=False)
        small, large = torch.rand(100, device=DEVICE), torch.rand(3000, device=DEVICE)
        out, calls = torch.zeros((), device=DEVICE), []

        def step():
            x = small if len(calls) < 2 else large   # warm-ups on one shape, the capture on another
            calls.append(x.numel())
            out.copy_(f(x))

        g = GraphedStep(step, torch.device(DEVICE), warmup=2)
        g()
        assert g.graph is not None and calls[:3] == [100, 100, 3000] and len(calls) == 5
        large.copy_(torch.rand(3000, device=DEVICE))
        g()
        torch.testing.assert_close(out, (large.sin() + 1).sum())
        torch.randn(8, device=DEVICE)   # the generator is not left mid-capture
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("budget", [4, 64, 256])
def test_graphed_tree_builder_equals_eager(budget):
    from dflash_pipeline.decoding.tree import TreeBuilder

    D, V = 15, 49152
    g = torch.Generator().manual_seed(budget)
    graphed = TreeBuilder(D, V, budget, torch.device(DEVICE))
    eager = TreeBuilder(D, V, budget, torch.device(DEVICE), graphs=False)
    for depth in [D, D, 7, D, 1, D]:
        logits = (torch.randn(D, V, generator=g) * 3).to(DEVICE)
        anchor = torch.randint(0, V, (1,), generator=g).to(DEVICE)
        got = [t.clone() for t in graphed(logits, anchor, depth)[1:]]
        want = eager(logits, anchor, depth)
        for a, b in zip(got, want[1:]):
            assert torch.equal(a, b)
        trees = graphed.out[0]
        for name in ("tokens_AN", "parents_AN", "depths_AN", "scores_AN", "num_nodes_A"):
            assert torch.equal(getattr(trees, name), getattr(want[0], name)), name
