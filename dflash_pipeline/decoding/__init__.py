"""Decoding machinery shared by `dflash eval`, `dflash generate` and training's held-out estimates.

A decode step of a Hugging Face causal LM is hundreds of small kernels, and on a host that is slow per
launch the GPU waits for Python. Here every step shape (q new tokens per row) is captured once as a
CUDA graph over static buffers and replayed; the same code runs eagerly on the CPU, where the tests
check it against plain transformers decoding.

attention.py  our transformers attention function: static K/V buffers per layer, masks from slots,
              RoPE positions and an explicit in-block mask (chains, trees), GQA without repeated K/V
sampling.py   the target's decoding rule (argmax, or a draw of softmax(logits / T)), used by every decoder
graphs.py     capture-once/replay steps (eager on the CPU) and per-step timers (CUDA events)
fused.py      q|k|v and gate|up as one matrix product each, over one buffer that the separate weights view
runner.py     DecodingRunner: rows of independent sequences over one target (prefill a row, step all
              rows, commit or roll back a row's length, compact a tree path, layer features)
drafter.py    StaticDrafter: the DFlash drafter's block step over a static context cache
tree.py       DDTree: the draft tree built from one drafter pass, its verification mask and positions, the
              exact acceptance walks (greedy, sampling, reference continuation) and the held-out estimate

Nothing is imported here, so that `dflash --help` stays fast.
"""
