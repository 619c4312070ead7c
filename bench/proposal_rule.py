"""`dflash eval` with the chain's other exact proposal rule at T > 0, for comparing the two on one drafter.

At T > 0 the chain drafts each block slot by sampling the drafter's distribution q and accepts it with
probability min(1, p / q) (rejection sampling; `eval/speculative.py`). The other exact rule drafts the
drafter's argmax, i.e. q a point mass: a draft x is then accepted with probability p(x), and a rejection
commits a sample of p without x, which is the target's own sample given that it is not x. Both commit
exactly the target's samples; which accepts more depends on the drafter. A block-parallel drafter's
slots are marginals drawn independently, which speaks for argmax drafts; q close to p speaks for sampling.

    python bench/proposal_rule.py argmax eval --drafter D --target T --prompts P --temperature 1 --json
    python bench/proposal_rule.py sample eval ...   (the rule `dflash eval` uses: the same command)

Measured 2026-12-06 (H100, the 3,000-step 64-anchor SmolLM2 drafter, 24 chat prompts x 192 tokens, T = 1):
sampling 1.51, argmax 1.25. `dflash eval` keeps sampling; BENCHMARKS.md has the numbers.
"""

from __future__ import annotations

import sys

import torch

import dflash_pipeline.eval.speculative as speculative


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("argmax", "sample"):
        sys.exit("usage: bench/proposal_rule.py argmax|sample eval [dflash eval options]")
    rule = sys.argv.pop(1)
    if rule == "argmax":
        sampled = speculative._propose

        def argmax_drafts(logits_mV: torch.Tensor, temperature: float, generator):
            if temperature == 0:
                return sampled(logits_mV, temperature, generator)
            draft = logits_mV.argmax(-1)
            # q a point mass on each draft: rejection_accept then accepts x with probability p(x)
            return draft, torch.nn.functional.one_hot(draft, logits_mV.shape[-1]).float()

        speculative._propose = argmax_drafts
    from dflash_pipeline.cli import app

    app(sys.argv[1:])


if __name__ == "__main__":
    main()
