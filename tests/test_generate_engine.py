"""`dflash generate`'s engine on the real decoding runner (CPU, fp32, tiny random models with peaked logits):

- several rows prefilled in one forward (generate/prefill.py: any set of rows, chunks, groups under a
  token budget) leave the runner exactly as one-row prefills do: the same last-token logits, and the
  same logits at every later decode step (K/V, positions and sliding-window positions in place);
- the continuous-batching engine on `RunnerRows` (rows refilled as replies end, stale rows reset)
  produces, for every request, what transformers' greedy `generate()` produces for that prompt alone,
  cut at the first stop token and at the request's limit;
- a target the runner cannot run is refused in one line before anything is planned.
"""

from __future__ import annotations

import pytest
import torch

from decoding_helpers import Requests, hf_greedy, tiny_causal_lm
from dflash_pipeline.decoding.runner import DecodingRunner
from dflash_pipeline.errors import DFlashError
from dflash_pipeline.eval.models import Target
from dflash_pipeline.generate.engine import Engine, Request
from dflash_pipeline.generate.prefill import prefill_rows
from dflash_pipeline.generate.rows import check_target, make_rows

KINDS = ["llama", "qwen3", "gemma3", "gemma2"]   # GQA; sliding windows 5 and 4; soft-capping


def _prompts(lengths, seed=0, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_of_many_rows_equals_one_row_prefills(kind):
    model = tiny_causal_lm(kind, seed=1)
    head = Target(model).logits
    prompts = _prompts([7, 30, 12, 1])
    rows = [2, 0, 3, 1]
    with DecodingRunner(model, rows=4, max_len=64) as many, DecodingRunner(model, rows=4, max_len=64) as one:
        many.prefill(0, list(range(20)))   # stale contents, which the prefill must forget
        got = prefill_rows(many, rows, prompts, head=head, chunk=8, max_tokens=24)   # chunks and groups
        want = torch.stack([one.prefill(r, p)[0][-1] for r, p in zip(rows, prompts)])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert many.host_lengths == one.host_lengths == [30, 1, 7, 12]
        for runner in (many, one):
            assert runner.lengths_R.tolist() == runner.host_lengths
        seen = {}
        for name, runner in (("many", many), ("one", one)):
            io, out = runner.inputs(1), []
            for t in range(10):   # past every sliding window
                io.ids_Rq[:, 0] = torch.tensor([5 + t, 40 - t, 7, 90])
                runner.step(1)
                runner.advance(1)
                out.append(io.logits_RqV[:, 0].clone())
            seen[name] = torch.stack(out)
        torch.testing.assert_close(seen["many"], seen["one"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_engine_on_the_runner_equals_plain_greedy_decoding_of_each_prompt(kind):
    model = tiny_causal_lm(kind, seed=2)
    capacity = 64   # = the runner's slots: the last request fills its row exactly
    prompts = [p.tolist() for p in _prompts([9, 3, 26, 14, 6, 21, 11, 52], seed=3)]
    limits = [12, 5, 9, 16, 3, 10, 7, capacity - 52]
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, limits)]
    # A token some replies produce (they end on it) and others do not (they end at their limit).
    stop = next(t for ref in refs[:-1] for t in ref
                if t not in refs[-1] and any(t not in other for other in refs[:-1]))
    want = {}
    for i, ref in enumerate(refs):
        cut = ref[:ref.index(stop) + 1] if stop in ref else ref
        want[i] = (cut, "stop" if stop in ref else "length")
    want[len(refs) - 1] = (refs[-1], "context")
    assert {f for _, f in want.values()} == {"stop", "length", "context"}
    rows = make_rows(model, 3, capacity, torch.device("cpu"))
    assert rows.runner.slots == capacity
    source = Requests([Request(i, p, 0, n, "context" if i == len(refs) - 1 else "length")
                        for i, (p, n) in enumerate(zip(prompts, limits))])
    stats = Engine(rows, stop_ids=[stop]).run(source)
    rows.close()
    assert source.done == want
    assert stats.replies == len(prompts) and stats.prefills >= 3   # rows were refilled as replies ended


def test_generate_runner_reads_its_own_slots_and_compiles_on_request():
    """`dflash generate`'s runner asks for the split decode kernel (each row reads only its own K/V on CUDA)
    and, with --compile, runs its steps' layers through torch.compile (checked for equality with greedy
    generate on the GPU: tests/test_generate_cuda.py)."""
    from types import SimpleNamespace

    from dflash_pipeline.generate.rows import open_rows
    from dflash_pipeline.progress import LiveLine
    from dflash_pipeline.schemas.generate import GenerateConfig

    model = tiny_causal_lm("llama")
    for compile, want in ((None, False), (False, False), (True, True)):   # None: the default, off on CPUs
        cfg = SimpleNamespace(max_length=64, batch_tokens=None, compile=compile)
        rows = open_rows(model, cfg, torch.device("cpu"), LiveLine(enabled=False), conversations=2)
        assert rows.runner._split and (rows.runner._compiled is not None) == want == rows.compiled
        rows.close()
    assert GenerateConfig(out="x").compile is None and "compile" not in GenerateConfig(out="x").output_settings()


def test_a_compiler_failure_falls_back_to_eager_steps_unless_compiling_was_asked_for(monkeypatch):
    """Compiling is the default on CUDA: a layer torch.compile cannot trace must not stop a generation
    run; it goes on with eager steps and says why. With an explicit --compile the failure is one clear
    line (DFlashError), and either way the model has its own attention back."""
    import dflash_pipeline.generate.rows as rows_mod
    from dflash_pipeline.progress import LiveLine

    model = tiny_causal_lm("llama")
    attn = model.config._attn_implementation
    real = rows_mod.make_rows

    def failing(model, num_rows, capacity, device, compile=False):
        if compile:
            raise RuntimeError("backend compiler failed\nlong inner traceback text")
        return real(model, num_rows, capacity, device)

    monkeypatch.setattr(rows_mod, "make_rows", failing)
    said = []
    line = LiveLine(enabled=False)
    monkeypatch.setattr(line, "say", said.append)
    rows = rows_mod.build_rows(model, 2, 64, torch.device("cpu"), compile=True, asked=False, line=line)
    assert not rows.compiled and rows.runner._compiled is None
    assert any("RuntimeError: backend compiler failed" in s and "eager" in s for s in said)
    rows.close()
    assert model.config._attn_implementation == attn
    with pytest.raises(DFlashError, match="--compile: compiling the decode step failed .*--no-compile"):
        rows_mod.build_rows(model, 2, 64, torch.device("cpu"), compile=True, asked=True, line=line)


def test_rows_whose_graph_capture_fails_give_the_model_its_attention_back(monkeypatch):
    model = tiny_causal_lm("llama")
    attn = model.config._attn_implementation

    def boom(self, n):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(DecodingRunner, "inputs", boom)
    with pytest.raises(RuntimeError, match="capture failed"):
        make_rows(model, 2, 64, torch.device("cpu"))
    assert model.config._attn_implementation == attn


def test_a_target_the_runner_cannot_run_is_refused_before_planning(tmp_path):
    import transformers as tf

    cfg = tf.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         layer_types=["linear_attention", "full_attention"])
    cfg.save_pretrained(tmp_path)
    with pytest.raises(DFlashError, match="linear_attention layers .* no eager fallback"):
        check_target(tmp_path)
    tiny_causal_lm("gemma3").config.save_pretrained(tmp_path / "ok")
    check_target(tmp_path / "ok")
