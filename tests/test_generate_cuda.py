"""`dflash generate`'s engine on CUDA graphs (skipped without CUDA):

- fp32 greedy replies of the graphed engine (steps replayed from graphs captured up front, rows refilled
  by eager multi-row prefills between replays) equal transformers' greedy `generate()` of each prompt
  alone on the same GPU, for a tiny Llama and a tiny Gemma 3 (sliding windows);
- the memory a run takes beyond the weights stays within the plan's KV cache + step + prefill
  workspace (generate/rows.py), with the costliest sampling (top-p over the whole vocabulary) and
  prompts that fill the rows: the plan is checked against the real peak, not trusted.

`DFLASH_TEST_DEVICE=cpu` runs the first test on the CPU (eager, no graphs): a check of the test itself.
"""

from __future__ import annotations

import os

import pytest
import torch

from decoding_helpers import Requests, hf_greedy, tiny_causal_lm
from dflash_pipeline.generate.engine import Engine, Request
from dflash_pipeline.generate.rows import budget_for, make_rows

DEVICE = os.environ.get("DFLASH_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("kind,compile", [("llama", False), ("gemma3", False), ("llama", True)])
def test_graphed_engine_equals_greedy_generate_of_each_prompt(kind, compile):
    model = tiny_causal_lm(kind, seed=4).to(DEVICE)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 40, 17, 3, 60, 9, 28)]
    limits = [20, 6, 14, 30, 9, 25, 12]
    want = {i: hf_greedy(model, p, n) for i, (p, n) in enumerate(zip(prompts, limits))}
    rows = make_rows(model, 3, 128, torch.device(DEVICE), compile=compile)   # compile: `dflash generate --compile`
    assert rows.runner.graphs == (DEVICE == "cuda")
    graphs_before = len(rows.runner._steps)
    source = Requests([Request(i, p, 0, n, "length") for i, (p, n) in enumerate(zip(prompts, limits))])
    Engine(rows, stop_ids=[]).run(source)
    if rows.runner.graphs:
        assert len(rows.runner._steps) == graphs_before   # every graph was captured before the run
    rows.close()
    assert {k: tokens for k, (tokens, _) in source.done.items()} == want


@pytest.mark.skipif(DEVICE != "cuda", reason="measures CUDA memory")
@pytest.mark.parametrize("compile", [False, True])   # compiled: the default on CUDA
def test_peak_memory_stays_within_the_plan(compile):
    import transformers as tf

    cfg = tf.Qwen3Config(vocab_size=49152, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    model = tf.Qwen3ForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    rows_n, capacity = 32, 1024
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    rows = make_rows(model, rows_n, capacity, torch.device("cuda"), compile=compile)
    g = torch.Generator().manual_seed(0)
    # Prompts that nearly fill a row, so that prefills run at their largest and steps attend to every slot.
    reqs = [Request(i, torch.randint(0, 49152, (capacity - 24,), generator=g).tolist(), i, 16, "length")
            for i in range(2 * rows_n)]
    Engine(rows, stop_ids=[], temperature=0.8, top_p=0.9).run(Requests(reqs))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    rows.close()
    plan = budget_for(model.config, torch.bfloat16, capacity, rows_n)
    planned = plan.kv_bytes + plan.step_bytes + plan.prefill_bytes
    print(f"peak {peak / 2**20:.0f} MiB, planned {planned / 2**20:.0f} MiB (KV {plan.kv_bytes / 2**20:.0f})")
    assert plan.kv_bytes < peak <= planned
