"""The static-cache decoding runner and the static drafter, against plain transformers and `draft_step`.

On the CPU the runner runs the very functions that CUDA captures as graphs, so these tests pin the
logic: greedy decoding equals `model.generate` token for token (Llama with GQA; Qwen3 and Gemma 3 with
sliding-window layers; Gemma 2 with attention soft-capping), a verify block equals the chain of decode
steps and rolls back in O(1), a tree of siblings at one position sees only its ancestors and a compacted
path decodes on as if it had been fed alone, rows are independent (reset and refill one while the others
go on), and the static drafter's round equals `DFlashDrafter.draft_step`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dflash_pipeline.decoding.drafter import StaticDrafter
from dflash_pipeline.decoding.runner import DecodingRunner, unsupported_reason
from dflash_pipeline.method import block_input_ids
from dflash_pipeline.train.model import DFlashDrafter, DrafterConfig, init_drafter_weights
from decoding_helpers import hf_greedy, tiny_causal_lm as tiny

V = 96  # the vocabulary of helpers.tiny_causal_lm
sys.path.append(str(Path(__file__).resolve().parent.parent / "bench"))  # bench/decode_attention.py, bench/tie_rule.py


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models decode faster on one thread


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0].float()


def runner_greedy(runner: DecodingRunner, row: int, prompt: list[int], n: int) -> list[int]:
    logits, _ = runner.prefill(row, prompt)
    out = [int(logits[-1].argmax())]
    io = runner.inputs(1)
    for _ in range(n - 1):
        runner.set_length(row, len(prompt) + len(out) - 1)
        io.ids_Rq[row, 0] = out[-1]
        runner.step(1)
        out.append(int(io.argmax_Rq[row, 0]))
    return out


# ---------------------------------------------------------------- the target runner


@pytest.mark.parametrize("kernel", ["sdpa", "math"])
@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3", "gemma2"])
def test_greedy_decoding_equals_transformers_generate(kind, kernel, monkeypatch):
    from dflash_pipeline.decoding import attention

    monkeypatch.setattr(attention, "KERNEL", kernel)  # DFLASH_DECODE_ATTENTION: both kernels decode exactly
    model = tiny(kind)
    prompt = [5, 17, 3, 44, 9, 12, 80, 1, 33]
    want = hf_greedy(model, prompt, 24)  # past every sliding window
    runner = DecodingRunner(model, max_len=64, prefill_chunk=4)  # chunked prefill, crossing windows too
    assert runner_greedy(runner, 0, prompt, 24) == want
    runner.close()
    assert model.config._attn_implementation != "static_kv"  # the model got its own attention back
    assert hf_greedy(model, prompt, 24) == want


def test_verify_block_equals_chain_rolls_back_and_captures_layer_outputs():
    model = tiny("qwen3", seed=1)
    prompt = [7, 1, 4, 2, 8, 5, 7]
    chain = prompt + hf_greedy(model, prompt, 12)
    ref = hf_logits(model, chain)
    with torch.no_grad():
        hs = model(torch.tensor([chain]), output_hidden_states=True, use_cache=False).hidden_states
    runner = DecodingRunner(model, max_len=48, layer_ids=[0, 1])
    _, feats = runner.prefill(0, prompt, features=True)
    B, start = 5, len(prompt)
    io = runner.inputs(B)
    # A block whose drafts are right for 2 slots and wrong after: logits equal the chain's where the
    # block agrees with it, at every slot.
    block = chain[start:start + 3] + [(chain[start + 3] + 1) % V, 0]
    io.ids_Rq[0] = torch.tensor(block)
    runner.step(B)
    torch.testing.assert_close(io.logits_RqV[0, :3], ref[start:start + 3], atol=1e-4, rtol=1e-4)
    assert io.argmax_Rq[0, :3].tolist() == chain[start + 1:start + 4]

    # Features: the hooked layer outputs, as a plain forward's hidden_states[k + 1], prompt and block.
    want = torch.cat([hs[1][0], hs[2][0]], dim=-1)
    torch.testing.assert_close(feats, want[:start], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(io.features_RqF[0, :3], want[start:start + 3], atol=1e-4, rtol=1e-4)

    # Keep the anchor and the 2 accepted drafts; the next block starts at the correction.
    runner.set_length(0, start + 3)
    io.ids_Rq[0] = torch.tensor(chain[start + 3:start + 3 + B])
    runner.step(B)
    torch.testing.assert_close(io.logits_RqV[0], ref[start + 3:start + 3 + B], atol=1e-4, rtol=1e-4)
    runner.close()


def test_tree_siblings_share_a_position_and_a_compacted_path_decodes_on():
    model = tiny("gemma3", seed=2)
    prompt = [3, 9, 27, 81 % V, 50, 60]
    want = {node: hf_logits(model, prompt + path)[-1]
            for node, path in [(1, [11, 22]), (2, [11, 33]), (3, [11, 33, 44]), (4, [11, 33, 44, 55])]}
    runner = DecodingRunner(model, max_len=48)
    runner.prefill(0, prompt)
    n = len(prompt)
    # Tree: node 0 (root, depth 0), nodes 1 and 2 (its children, both depth 1), node 3 (child of 2).
    tree = [11, 22, 33, 44]
    io = runner.inputs(4)
    io.ids_Rq[0] = torch.tensor(tree)
    io.offsets_Rq[0] = torch.tensor([0, 1, 1, 2])
    io.block_mask_Rqq[0] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    runner.step(4)
    for node in (1, 2, 3):
        torch.testing.assert_close(io.logits_RqV[0, node], want[node], atol=1e-4, rtol=1e-4)

    # Accept the path 0 -> 2 -> 3: compact slots n+2, n+3 to n+1, n+2 and commit; decode on.
    runner.compact(0, [n + 2, n + 3], n + 1)
    runner.set_length(0, n + 3)
    io1 = runner.inputs(1)
    io1.ids_Rq[0, 0] = 55
    runner.step(1)
    torch.testing.assert_close(io1.logits_RqV[0, 0], want[4], atol=1e-4, rtol=1e-4)
    # Restore the causal default so later users of inputs(4) get a chain.
    io.block_mask_Rqq[0] = torch.ones(4, 4, dtype=torch.bool).tril()
    io.offsets_Rq[0] = torch.arange(4)
    runner.close()


def test_rows_are_independent_and_a_row_is_refilled_while_others_decode():
    model = tiny("llama", seed=3)
    prompts = [[1, 2, 3], [40, 41, 42, 43, 44, 45, 46], [90, 7]]
    want = {i: hf_greedy(model, p, 10) for i, p in enumerate(prompts)}
    fresh = [60, 61, 62, 63]
    want_fresh = hf_greedy(model, fresh, 6)
    runner = DecodingRunner(model, rows=3, max_len=32)
    out = {}
    for r, p in enumerate(prompts):
        out[r] = [int(runner.prefill(r, p)[0][-1].argmax())]
    io = runner.inputs(1)
    for t in range(9):
        if t == 4:  # row 2 is done with its first prompt: replace it
            want[2] = want[2][:5]
            out[2] = [int(runner.prefill(2, fresh)[0][-1].argmax())]
            base = t
        io.ids_Rq[:, 0] = torch.tensor([out[r][-1] for r in range(3)])
        runner.step(1)
        runner.advance(1)
        for r in range(3):
            out[r].append(int(io.argmax_Rq[r, 0]))
    assert out[0] == want[0] and out[1] == want[1]
    assert out[2] == want_fresh[:len(out[2])] and len(out[2]) == 9 - base + 1
    assert runner.host_lengths == [len(prompts[0]) + 9, len(prompts[1]) + 9, len(fresh) + 9 - base]
    assert runner.lengths_R.tolist() == runner.host_lengths
    runner.set_lengths([3, 0, 5])  # per-row commits in one call
    assert runner.lengths_R.tolist() == runner.host_lengths == [3, 0, 5]
    with pytest.raises(ValueError, match="set_lengths"):
        runner.set_lengths([1, 2])
    runner.close()


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_compiled_steps_write_every_layers_cache_in_place(kind):
    """`compile=True` (eval --compile, generate --compile) on the CPU, fp32, 3 rows of different lengths:
    the same logits and the same cache, layer by layer, as the eager steps; and no compiled code makes a
    buffer of a layer's cache size. Written as a scatter into a view of the cache, the write made Inductor
    copy each layer's K and V at every step (a 128-row Qwen3-8B generation step took 1.8x as long), and a
    mutating op on that view wrote every layer into layer 0's buffer once the layer index was symbolic."""
    from torch._inductor.utils import run_and_get_code

    model = tiny(kind, seed=4)   # both with sliding-window layers beside full ones
    prompts = [[5, 17, 3, 44, 9, 12, 80, 1, 33], [3, 9], [4, 9, 27, 4, 50, 6]]

    def decode(compile: bool):
        runner = DecodingRunner(model, rows=3, max_len=40, compile=compile)
        toks = [int(runner.prefill(r, p)[0][-1].argmax()) for r, p in enumerate(prompts)]
        io, logits, codes = runner.inputs(1), [], []
        for _ in range(6):
            io.ids_Rq[:, 0] = torch.tensor(toks)
            codes += run_and_get_code(runner.step, 1)[1]
            logits.append(io.logits_RqV[:, 0].clone())
            runner.advance(1)
            toks = io.argmax_Rq[:, 0].tolist()
        runner.close()
        return torch.stack(logits), runner.kv, codes, runner.slots

    want, kv_want, _, _ = decode(False)
    got, kv_got, codes, slots = decode(True)
    torch._dynamo.reset()
    assert codes                                                # the layers did compile
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    for layer in range(model.config.num_hidden_layers):        # every layer's own buffer, every slot
        assert torch.allclose(kv_got.keys_L[layer], kv_want.keys_L[layer], atol=1e-5)
        assert torch.allclose(kv_got.values_L[layer], kv_want.values_L[layer], atol=1e-5)
    layer_cache = f"empty_strided_cpu((3, {model.config.num_key_value_heads}, {slots}, {model.config.head_dim})"
    assert not any(layer_cache in code for code in codes)


def test_compile_may_name_torch_compiles_mode(monkeypatch):
    """`compile="max-autotune-no-cudagraphs"` (bench/eval.py --compile-mode) compiles every decoder layer in
    that mode; `compile=True` in torch.compile's default mode; the steps run the compiled layers either way."""
    model = tiny("qwen3", seed=1)
    modes, calls = [], []

    def fake_compile(fn, mode=None, **kw):
        modes.append(mode)

        def wrapped(*a, **k):
            calls.append(mode)
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(torch, "compile", fake_compile)
    for compile, want in (("max-autotune-no-cudagraphs", "max-autotune-no-cudagraphs"), (True, None)):
        modes.clear(), calls.clear()
        with DecodingRunner(model, max_len=32, graphs=False, compile=compile) as runner:
            runner.prefill(0, [5, 17, 3])
            runner.inputs(1).ids_Rq[:, 0] = 4
            runner.step(1)
        assert modes == [want] * model.config.num_hidden_layers
        assert calls and set(calls) == {want}


def test_steps_attend_to_the_bucket_the_longest_row_needs():
    model = tiny("llama", seed=5)
    prompts = [list(range(1, 90)) * 3, [4, 5, 6]]  # 267 and 3 tokens: one row past the first bucket
    want = [hf_greedy(model, p, 8) for p in prompts]
    with DecodingRunner(model, rows=2, max_len=600) as runner:
        assert runner.slots == 640 and runner.attended_slots(1) == 256
        out = [[int(runner.prefill(r, p)[0][-1].argmax())] for r, p in enumerate(prompts)]
        assert runner.attended_slots(1) == 512
        io = runner.inputs(1)
        for _ in range(7):
            io.ids_Rq[:, 0] = torch.tensor([o[-1] for o in out])
            runner.step(1)
            runner.advance(1)
            for r in range(2):
                out[r].append(int(io.argmax_Rq[r, 0]))
        runner.reset(0)
        assert runner.attended_slots(1) == 256
        before = list(runner.host_lengths)
        assert runner.prepare((1, 4)) == 6  # q in (1, 4) x buckets 256, 512, 640 (all slots)
        assert set(runner._steps) == {(q, s) for q in (1, 4) for s in (256, 512, 640)}
        assert runner.host_lengths == before and runner.lengths_R.tolist() == before
    assert out == want


def test_capacity_is_checked_and_unsupported_models_are_named():
    model = tiny("llama")
    runner = DecodingRunner(model, max_len=10)  # rounded up to 64 slots
    assert runner.slots == 64
    runner.prefill(0, list(range(60)))
    with pytest.raises(ValueError, match="exceed the cache's 64 slots"):
        runner.step(5)
    runner.close()

    import transformers as tf

    cfg = tf.Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    hybrid = tf.Qwen3ForCausalLM(cfg)
    hybrid.config.layer_types = ["linear_attention", "full_attention"]
    assert "linear_attention" in unsupported_reason(hybrid)
    with pytest.raises(ValueError, match="linear_attention"):
        DecodingRunner(hybrid, max_len=16)
    dynamic = tiny("llama")
    dynamic.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert "dynamic RoPE scaling" in unsupported_reason(dynamic)
    assert unsupported_reason(tiny("gemma3")) is None  # RoPE parameters per layer type


def test_greedy_decoding_of_the_real_target_equals_generate(smollm_model, smollm_tokenizer):
    text = "Write a short story about a robot who learns to paint."
    ids = smollm_tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = hf_greedy(smollm_model, ids, 40)
    assert len(want) == 40  # no EOS inside: 40 tokens compared
    with DecodingRunner(smollm_model, max_len=len(ids) + 40) as runner:
        got = runner_greedy(runner, 0, ids, 40)
    assert got == want


# ---------------------------------------------------------------- the drafter


@pytest.mark.parametrize("kernel", ["sdpa", "math"])
def test_static_drafter_round_equals_draft_step(kernel, monkeypatch):
    from dflash_pipeline.decoding import attention

    monkeypatch.setattr(attention, "KERNEL", kernel)
    H, B = 32, 4
    cfg = DrafterConfig(hidden_size=H, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                        vocab_size=V, block_size=B, mask_token_id=V - 1, target_layer_ids=[0, 2], num_target_layers=4,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=5)
    drafter = DFlashDrafter(cfg)
    init_drafter_weights(drafter, std=0.2, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    emb, head_w = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g)

    def embed(ids):
        return torch.nn.functional.embedding(ids, emb)

    def head(h):
        return (h @ head_w.T).float()

    static = StaticDrafter(drafter, embed=embed, head=head, vocab_size=V, feature_dtype=torch.float32, rows=2,
                           max_len=40)
    cache = drafter.new_cache()
    io, start = static.io, 0
    for n in [7, 3, 1, 4, 0, 2]:  # a prompt longer than B first (eager append), then padded appends
        feats = torch.randn(1, n, 2 * H, generator=g)
        start += n
        anchor = int(torch.randint(0, V - 1, (), generator=g))
        ids = block_input_ids(torch.tensor([anchor]), B, cfg.mask_token_id)
        with torch.no_grad():
            hidden = drafter.draft_step(feats, torch.arange(start - n, start), embed(ids),
                                        torch.arange(start, start + B), cache)
        if n > B:
            static.extend_context(1, feats[0], start)
            io.n_new_R[1] = 0
        else:
            io.ctx_RBF[1, :n] = feats[0]
            io.n_new_R[1] = n
        io.start_R[1], io.ids_RB[1, 0] = start, anchor
        static.step()
        torch.testing.assert_close(io.logits_RmV[1], head(hidden[0, 1:]), atol=1e-4, rtol=1e-4)
        assert io.argmax_Rm[1].tolist() == head(hidden[0, 1:]).argmax(-1).tolist()


def test_decode_attention_candidates_equal_the_static_attention(request):
    """bench/decode_attention.py's candidates (written-out math, FlexAttention, FlexAttention reading only each
    row's own K/V blocks, and for one-token steps the split Triton kernel, interpreted here) give what
    `folded_attention` gives, on rows that end in different 128-slot blocks, for a decode step and a block
    verify: whichever the GPU measurement picks computes the same attention."""
    import decode_attention as da

    from dflash_pipeline.decoding import split_attention

    for R, hk, g, q, D in ((4, 3, 3, 1, 64), (3, 2, 4, 16, 32)):
        q_, k_, v_, mask = da.inputs(R, hk, g, q, D, 520, torch.float32)
        ref = da.sdpa(q_, k_, v_, mask, D ** -0.5)
        candidates = [da.math, da.math_upcast, da.make_flex(False, False), da.make_flex(False, True)]
        if q == 1 and split_attention.available():
            request.getfixturevalue("interpreter")
            da.SPLIT_LENGTHS[id(mask)] = torch.isfinite(mask[:, 0, 0]).sum(-1)
            candidates.append(da.split)
        for fn in candidates:
            torch.testing.assert_close(fn(q_, k_, v_, mask, D ** -0.5), ref, atol=2e-5, rtol=1e-5)
        # Uncompiled FlexAttention does not skip blocks, so the sparse block mask is checked on its own: a row
        # reads exactly the 128-slot blocks up to the one holding its last visible slot.
        dense = da.row_blocks(mask).to_dense()[:, 0]                        # [R, q blocks, kv blocks]
        seen_RS = torch.isfinite(mask[:, 0]).any(dim=1)
        for r in range(R):
            last = int(seen_RS[r].nonzero().max()) // 128
            assert dense[r].all(dim=0)[: last + 1].all() and not dense[r][:, last + 1:].any()
        assert len({int(x) for x in dense.sum(-1)[:, 0]}) > 1               # the rows end in different blocks


def test_decode_attention_kernel_is_read_from_the_environment(monkeypatch):
    from dflash_pipeline.decoding import attention
    from dflash_pipeline.errors import DFlashError

    monkeypatch.setenv("DFLASH_DECODE_ATTENTION", " Math ")
    assert attention.kernel_from_env() == "math"
    monkeypatch.delenv("DFLASH_DECODE_ATTENTION")
    assert attention.kernel_from_env() == "auto"
    monkeypatch.setenv("DFLASH_DECODE_ATTENTION", "flash")
    with pytest.raises(DFlashError, match="DFLASH_DECODE_ATTENTION='flash': expected one of auto, sdpa, math"):
        attention.kernel_from_env()


def test_auto_kernel_is_math_on_cuda_and_sdpa_elsewhere(monkeypatch):
    """`auto` (the default) picks per device what the H200 and the CPU calibrations chose; a named kernel
    is used everywhere. Checked through `folded_attention`'s dispatch, not only the reported name."""
    from dflash_pipeline.decoding import attention

    monkeypatch.setattr(attention, "KERNEL", "auto")
    assert attention.kernel_for("cuda:1") == "math" and attention.kernel_for("cpu") == "sdpa"
    # a call whose scores would not stay small (a multi-row prefill) runs on SDPA, and plans count only the
    # calls that materialise them
    cap = attention.WRITTEN_OUT_MAX_SCORE_BYTES // 4
    assert attention.kernel_for("cuda", cap) == "math" and attention.kernel_for("cuda", cap + 1) == "sdpa"
    assert attention.written_out_workspace(cap) > 0 and attention.written_out_workspace(cap + 1) == 0
    monkeypatch.setattr(attention, "_BMM_FP32_OUT", False)  # an older torch: only the upcasting form, slower
    assert attention.kernel_for("cuda") == "sdpa" and attention.written_out_workspace(cap) == 0
    monkeypatch.setattr(attention, "_BMM_FP32_OUT", True)
    monkeypatch.setattr(attention, "KERNEL", "math")
    assert attention.kernel_for("cpu") == "math"
    calls = []
    monkeypatch.setattr(attention, "written_out_attention", lambda *a, **k: calls.append(a) or a[0])
    monkeypatch.setattr(attention, "attend", lambda *a, **k: calls.append(None) or a[0])
    q, kv, bias = torch.zeros(1, 4, 1, 8), torch.zeros(1, 2, 5, 8), torch.zeros(1, 1, 2, 5)
    for kernel, want in (("auto", None), ("sdpa", None), ("math", q)):
        calls.clear()
        monkeypatch.setattr(attention, "KERNEL", kernel)
        attention.folded_attention(q, kv, kv, bias, 1.0)
        assert len(calls) == 1 and (calls[0] is None) == (want is None), kernel


def test_decode_attention_fp32_scores_are_closer_in_bf16():
    """In bf16 the written-out math rounds each score to bf16 before the softmax; `math_upcast` keeps them
    in fp32. At scores of realistic size (tens) the upcast one is the closer to an fp32 reference: the
    error the lossless check's tie rule has to absorb is the kernel's, so the candidate must not add to it."""
    import decode_attention as da

    q_, k_, v_, mask = da.inputs(2, 2, 4, 16, 64, 300, torch.bfloat16)
    q_ = q_ * 6                                                              # scores of order 10-40, peaked
    scale = 64 ** -0.5
    ref = da.math(q_.float(), k_.float(), v_.float(), mask.float(), scale)
    err = {fn.__name__: (fn(q_, k_, v_, mask, scale).float() - ref).abs().max().item()
           for fn in (da.math, da.math_upcast)}
    assert err["math_upcast"] < 0.5 * err["math"], err


def test_tie_rule_bench_passes_reproduce_the_reference_logits():
    """bench/tie_rule.py compares the decode step's logits with those of block steps over the same tokens:
    in fp32 the blocks must give the same predictions at the same positions (else the bench would measure
    its own misalignment, not the kernels)."""
    import tie_rule

    model = tiny("qwen3")
    prompt = [5, 17, 3, 44, 9, 12, 80, 1, 33]
    want = hf_greedy(model, prompt, 30)
    with DecodingRunner(model, max_len=96) as runner:
        tokens, top_ids, top_vals = tie_rule.greedy_reference(runner, prompt, 30)
        assert tokens == want
        passes = [tie_rule.blocked_logits(runner, prompt, tokens, q) for q in (4, 16)]
        passes += [tie_rule.tree_logits(runner, prompt, tokens, depth) for depth in (3, 8)]  # with siblings
        for logits in passes:
            assert logits.argmax(-1).tolist() == tokens
            torch.testing.assert_close(logits.gather(1, top_ids), top_vals, atol=1e-4, rtol=1e-5)
        # the chain blocks still run with their own causal mask after the tree steps
        torch.testing.assert_close(tie_rule.blocked_logits(runner, prompt, tokens, 17).gather(1, top_ids), top_vals,
                                   atol=1e-4, rtol=1e-5)
    forward = tie_rule.forward_logits(model, prompt, tokens)
    assert max(tie_rule.margin_gaps(top_ids, top_vals, forward, torch.float32)) < 64  # a few fp32 ulp
