"""`dflash eval`: real block speculative decoding of an exported drafter against its target.

speculative.py  acceptance rules and the two decoding loops (with and without the drafter)
tree_decoding.py  tree speculative decoding (DDTree, --tree-budget N) on the graphed target
models.py       the target (cache, hooks, embedding, LM head) and the DFlash drafter as the loop sees them
graphed.py      the same two on static caches with graphed steps (the decoding package): the default path
lossless.py     the greedy lossless rule per dtype (exact in fp32, counted ties in bf16/fp16) and teacher forcing
prompts.py      the prompts: several files, first turns or every turn
report.py       the report dict (pooled, per prompt file, per tree budget) and its tables
run.py          EvalConfig, pairing checks, one prompt's decoding and check, the processes, run_eval
rollback.py     rolling back the linear-attention states of hybrid targets after a rejected draft

Nothing is imported here, so that `dflash --help` stays fast.
"""
