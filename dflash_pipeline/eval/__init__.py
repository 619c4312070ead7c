"""`dflash eval`: real block speculative decoding of an exported drafter against its target.

speculative.py  acceptance rules and the two decoding loops (with and without the drafter)
models.py       the target (cache, hooks, embedding, LM head) and the DFlash drafter as the loop sees them
graphed.py      the same two on static caches with graphed steps (the decoding package): the default path
report.py       the report dict and its tables
run.py          EvalConfig, pairing checks, run_eval

Nothing is imported here, so that `dflash --help` stays fast.
"""
