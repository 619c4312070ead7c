"""Fused q|k|v and gate|up projections (decoding/fused.py) against the unfused model.

On the CPU in fp32: the fused model's logits, the runner's steps and greedy decoding equal the unfused
ones for every family the decoding helpers build; the separate weights are gone (one storage per group,
no byte more than before); the compiled layers trace the fused modules without a graph break; a
projection called out of order fails loudly; `restore()` gives the nn.Linear modules back; and a layer
whose projections are not plain nn.Linear modules is left alone.
"""

from __future__ import annotations

import functools
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from dflash_pipeline.decoding.fused import fuse_projections
from dflash_pipeline.decoding.runner import DecodingRunner
from dflash_pipeline.errors import DFlashError
from dflash_pipeline.extract.target import decoder_layers
from decoding_helpers import hf_greedy, tiny_causal_lm as tiny

sys.path.append(str(Path(__file__).resolve().parent.parent / "bench"))  # bench/gemv.py

KINDS = ["llama", "qwen3", "gemma3", "gemma2"]
PROMPT = [5, 17, 3, 44, 9, 12, 80, 1, 33]
GROUPS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
EXACT = dict(atol=1e-6, rtol=1e-6)  # fp32 on the CPU: the same dot products, so (all but) bit-equal

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models decode faster on one thread


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0]


def storage_bytes(model) -> int:
    """Bytes of the distinct storages the model's parameters live in."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


def step_logits(runner: DecodingRunner, prompt: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """Greedy decoding of n tokens through the runner: (the prefill's logits of every prompt token, then
    each step's, the tokens)."""
    prefill = runner.prefill(0, prompt, all_logits=True)[0]
    out = [int(prefill[-1].argmax())]
    io, seen = runner.inputs(1), [*prefill]
    for _ in range(n - 1):
        io.ids_Rq[0, 0] = out[-1]
        runner.step(1)
        runner.advance(1)
        seen.append(io.logits_RqV[0, 0].clone())
        out.append(int(io.argmax_Rq[0, 0]))
    return torch.stack(seen), out


@pytest.mark.parametrize("kind", KINDS)
def test_fused_model_computes_the_same_with_one_buffer_per_group(kind):
    model = tiny(kind)
    want, want_tokens = logits(model, PROMPT), hf_greedy(model, PROMPT, 16)
    before_bytes, before = storage_bytes(model), {k: v.clone() for k, v in model.state_dict().items()}
    old_k = weakref.ref(decoder_layers(model)[0].self_attn.k_proj.weight)

    fused = fuse_projections(model)
    assert fused.layers == model.config.num_hidden_layers and fused.groups == 2 * fused.layers
    assert old_k() is None                              # the separate tensor is freed, not kept beside the buffer
    assert storage_bytes(model) == before_bytes         # no second copy anywhere
    for layer in decoder_layers(model):
        for part, names in GROUPS.items():
            ptrs = {getattr(getattr(layer, part), n).weight.untyped_storage().data_ptr() for n in names}
            assert len(ptrs) == 1, f"{part}: {names} are not views of one buffer"
    state = model.state_dict()                          # same names, same values: checkpoints are unaffected
    assert state.keys() == before.keys() and all(torch.equal(state[k], v) for k, v in before.items())

    torch.testing.assert_close(logits(model, PROMPT), want, **EXACT)
    assert hf_greedy(model, PROMPT, 16) == want_tokens
    fused.restore()


def test_biased_projections_fuse_their_biases_too():
    """Qwen2's q, k and v carry biases (its MLP does not): the biases become views of one buffer as the
    weights do, and the fused model computes and decodes as before."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = tf.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in decoder_layers(model):
            for n in GROUPS["self_attn"]:
                getattr(layer.self_attn, n).bias.normal_(0, 0.5)   # biases away from 0, so a dropped one shows
    want, want_tokens = logits(model, PROMPT), hf_greedy(model, PROMPT, 12)
    fused = fuse_projections(model)
    assert fused.groups == 2 * cfg.num_hidden_layers
    attn = decoder_layers(model)[0].self_attn
    assert len({getattr(attn, n).bias.untyped_storage().data_ptr() for n in GROUPS["self_attn"]}) == 1
    torch.testing.assert_close(logits(model, PROMPT), want, **EXACT)
    assert hf_greedy(model, PROMPT, 12) == want_tokens
    fused.restore()
    with DecodingRunner(model, max_len=48, graphs=False) as runner:
        assert runner.fused_layers == cfg.num_hidden_layers
        assert step_logits(runner, PROMPT, 12)[1] == want_tokens


@pytest.mark.parametrize("kind", KINDS)
def test_runner_steps_fused_equal_unfused_and_close_restores(kind):
    model = tiny(kind, seed=1)
    want_tokens = hf_greedy(model, PROMPT, 12)
    with DecodingRunner(model, max_len=48, graphs=False, fuse=False) as plain:
        assert plain.fused_layers == 0
        want, tokens = step_logits(plain, PROMPT, 12)
    assert tokens == want_tokens
    runner = DecodingRunner(model, max_len=48, graphs=False)
    assert runner.fused_layers == model.config.num_hidden_layers
    got, tokens = step_logits(runner, PROMPT, 12)
    torch.testing.assert_close(got, want, **EXACT)
    assert tokens == want_tokens

    runner.close()
    for layer in decoder_layers(model):
        for part, names in GROUPS.items():
            for n in names:
                linear = getattr(getattr(layer, part), n)
                assert type(linear) is nn.Linear and linear.weight.requires_grad
    assert hf_greedy(model, PROMPT, 12) == want_tokens


@pytest.mark.parametrize("kind", ["qwen3", "gemma2"])
def test_compiled_fused_layers_equal_eager_without_a_graph_break(kind, monkeypatch):
    """The runner's compiled layers (compile=True) over fused projections, traced whole (fullgraph: a graph
    break would raise). aot_eager keeps the test fast; Inductor is exercised by test_decoding.py's
    compiled-steps test, where fusing is on by default."""
    from dflash_pipeline.decoding import attention

    monkeypatch.setattr(attention, "KERNEL", "math")  # the GPU's kernel; CPU SDPA breaks the graph by itself
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager", fullgraph=True))
    model = tiny(kind, seed=2)
    with DecodingRunner(model, max_len=48, graphs=False, fuse=False) as plain:
        want, want_tokens = step_logits(plain, PROMPT, 8)
    try:
        with DecodingRunner(model, max_len=48, graphs=False, compile=True) as runner:
            assert runner.fused_layers == model.config.num_hidden_layers
            got, tokens = step_logits(runner, PROMPT, 8)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert tokens == want_tokens


def test_a_projection_called_out_of_order_raises():
    model = tiny("llama")
    fuse_projections(model)
    attn, mlp = decoder_layers(model)[1].self_attn, decoder_layers(model)[1].mlp
    x = torch.randn(1, 3, model.config.hidden_size)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match=r"layer 1: self_attn\.k_proj: fused projections are called out of"):
            attn.k_proj(x)                                # before q_proj
        attn.q_proj(x)
        with pytest.raises(RuntimeError, match="out of order"):
            attn.k_proj(x.clone())                        # another input
        attn.q_proj(x)
        attn.k_proj(x)
        attn.v_proj(x)
        with pytest.raises(RuntimeError, match=r"layer 1: mlp\.up_proj"):
            mlp.up_proj(x)                                # the holder let go of everything once taken
        assert attn.q_proj.pending.x is None and not attn.q_proj.pending.slices


def test_layers_that_are_not_plain_linear_modules_are_left_alone():
    class Adapted(nn.Linear):
        """Stands for a quantized or adapter linear module."""

    model = tiny("qwen3", seed=3)
    want = logits(model, PROMPT)
    layers = decoder_layers(model)
    for part, name in (("self_attn", "q_proj"), ("mlp", "up_proj")):
        old = getattr(getattr(layers[1], part), name)
        new = Adapted(old.in_features, old.out_features, bias=old.bias is not None)
        new.load_state_dict(old.state_dict())
        setattr(getattr(layers[1], part), name, new)
    layers[2].self_attn.v_proj.register_forward_hook(lambda *args: None)  # a hook would be silently dropped

    fused = fuse_projections(model)
    assert fused.layers == 2 and fused.groups == 3          # layer 0 whole, layer 2's MLP
    assert type(layers[1].self_attn.k_proj) is nn.Linear and type(layers[1].mlp.gate_proj) is nn.Linear
    assert type(layers[2].self_attn.q_proj) is nn.Linear and type(layers[2].mlp.gate_proj) is not nn.Linear
    torch.testing.assert_close(logits(model, PROMPT), want, **EXACT)


def test_the_environment_turns_fusing_off(monkeypatch):
    model = tiny("llama", seed=4)
    monkeypatch.setenv("DFLASH_FUSE_PROJECTIONS", "0")
    with DecodingRunner(model, max_len=48, graphs=False) as runner:
        assert runner.fused_layers == 0 and type(decoder_layers(model)[0].self_attn.q_proj) is nn.Linear
    monkeypatch.setenv("DFLASH_FUSE_PROJECTIONS", "yes")
    with pytest.raises(DFlashError, match="DFLASH_FUSE_PROJECTIONS='yes': expected 0 or 1"):
        DecodingRunner(model, max_len=48, graphs=False)
    # refused before the model was touched: its own attention, no hooks left behind
    assert type(decoder_layers(model)[0].self_attn.q_proj) is nn.Linear
    assert model.config._attn_implementation != "static_kv"
    assert not any(layer._forward_hooks for layer in decoder_layers(model))


def test_the_products_benchmark_times_the_same_products_over_the_same_memory():
    """bench/gemv.py's two layouts compute the same products, the separate one from row views of the fused
    buffers: its ratio is the fusion's alone, not a different amount of work or memory."""
    import gemv

    layers = gemv.layer_weights(gemv.SMOKE_QWEN, torch.float32)
    head = torch.randn(gemv.SMOKE_QWEN["vocab_size"], gemv.SMOKE_QWEN["hidden_size"])
    x = torch.randn(3, gemv.SMOKE_QWEN["hidden_size"])
    separate, fused = gemv.products(layers, head, x, False)(), gemv.products(layers, head, x, True)()
    assert len(separate) == len(fused) == 7 * len(layers) + 1
    for a, b in zip(separate, fused):
        torch.testing.assert_close(a, b, **EXACT)
    q_w = layers[0]["qkv"].split(list(layers[0]["splits"][:3]))[0]
    assert q_w.untyped_storage().data_ptr() == layers[0]["qkv"].untyped_storage().data_ptr()


def test_the_products_benchmark_reduction_form_computes_the_same_products():
    """bench/gemv.py --compiled's `fused-reduce` layout: each product as a multiply and an fp32 sum is the
    same product (so its time is comparable), in fp32 and, up to one rounding of the output, in bf16."""
    import gemv

    layers = gemv.layer_weights(gemv.SMOKE_QWEN, torch.float32)
    head = torch.randn(gemv.SMOKE_QWEN["vocab_size"], gemv.SMOKE_QWEN["hidden_size"])
    x = torch.randn(1, gemv.SMOKE_QWEN["hidden_size"])
    want = gemv.products(layers, head, x, True)()
    got = gemv.products(layers, head, x, True, linear=gemv.reduce_linear)()
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    w16, x16 = head.to(torch.bfloat16), x.to(torch.bfloat16)
    ref = (x16.float() @ w16.float().T).to(torch.bfloat16)
    torch.testing.assert_close(gemv.reduce_linear(x16, w16), ref, rtol=8e-3, atol=1e-2)
