"""`dflash eval` as a run: what plain decoding records for the lossless rule, the prompts (several files,
every turn), the report per file and pooled, the multi-process path (two CPU processes give the same
tokens as one, in one merged report), and tree verification (--tree-budget): the graphed loop against
test_tree's reference loop, the drafter's context after a tree round, the real target in fp32, a budget
sweep in one run, and the targets where trees are refused."""

from __future__ import annotations

import copy
import io
import json

import pytest
import torch
from rich.console import Console

from dflash_pipeline.errors import DFlashError
from dflash_pipeline.eval.graphed import GraphedDraft, GraphedTarget
from dflash_pipeline.eval.lossless import check_greedy, teacher_forcing
from dflash_pipeline.eval.models import DFlashDraft, Target, stop_token_ids
from dflash_pipeline.eval.prompts import EMBEDDED, Prompt, load_prompts
from dflash_pipeline.eval.report import PromptResult, acceptance, render_report, summarize
from dflash_pipeline.eval.run import EvalConfig, evaluate, make_participants, run_eval
from dflash_pipeline.eval.speculative import Generation, Step, speculative_generate, target_generate
from dflash_pipeline.eval.tree_decoding import tree_generate
from dflash_pipeline.extract import readers
from dflash_pipeline.train.export import export_drafter
from dflash_pipeline.train.model import DFlashDrafter, DrafterConfig, init_drafter_weights
from dflash_pipeline.progress import LiveLine
from decoding_helpers import Steered, hf_greedy, tiny_causal_lm, tiny_drafter
from helpers import make_tiny_target


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models decode faster on one thread


# ---------------------------------------------------------------- what plain decoding records


@pytest.mark.parametrize("graphed", [False, True])
def test_plain_decoding_keeps_the_top_two_logits_and_teacher_forcing_agrees(graphed):
    """The top-1/top-2 logits plain decoding keeps (in a device buffer, read once) are the target's own at
    every position (a plain forward over the output says so), and teacher forcing along the output, in
    chunks of any size, gives back the same tokens and logits."""
    model, N = tiny_causal_lm("llama"), 24
    prompt = [5, 17, 3, 44, 9, 12, 80, 1, 33]
    want = hf_greedy(model, prompt, N)
    with torch.no_grad():  # before the graphed target takes the model's attention over
        logits = model(torch.tensor([prompt + want[:-1]])).logits[0, len(prompt) - 1:].float()
    top = logits.topk(2).values
    target = GraphedTarget(model, [], max_len=len(prompt) + N + 4, block_size=4) if graphed else Target(model)
    base = target_generate(target, prompt, max_new_tokens=N, temperature=0.0, stop_ids=frozenset())
    assert base.tokens == want
    assert len(base.tokens) == len(base.top1) == len(base.top2) == N
    torch.testing.assert_close(torch.tensor([base.top1, base.top2]).T, top, atol=1e-4, rtol=1e-4)
    for chunk in (512, 5):  # 5: the prompt itself spans two chunks
        argmax, top1, top2 = teacher_forcing(target, prompt, base.tokens, chunk=chunk)
        assert argmax == base.tokens == logits.argmax(-1).tolist()
        torch.testing.assert_close(torch.tensor([top1, top2]).T, top, atol=1e-4, rtol=1e-4)
    sampled = target_generate(target, prompt, max_new_tokens=4, temperature=0.8, stop_ids=frozenset(),
                              generator=torch.Generator().manual_seed(0))
    assert sampled.top1 == sampled.top2 == []  # nothing to check at T > 0
    target.close()


# ---------------------------------------------------------------- prompts


def test_every_reply_of_a_conversation_is_a_turn_prompt():
    s, u1, a1, u2, a2, u3 = ({"role": r, "content": c} for r, c in [
        ("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("user", "how?"), ("assistant", "so"),
        ("user", "and?")])
    assert readers.turn_prompts({"messages": [s, u1, a1, u2, a2, u3]}) == [[s, u1], [s, u1, a1, u2],
                                                                          [s, u1, a1, u2, a2, u3]]
    assert readers.turn_prompts({"messages": [u1, a1, a2]}) == [[u1]]  # a reply after a reply asks nothing new
    assert readers.turn_prompts({"prompt": "hi"}) == [[u1]]
    assert readers.prompt_messages({"messages": [s, u1, a1, u2, a2]}) == [s, u1]
    for bad in ({"text": "plain"}, {"messages": [a1, u1]}):
        with pytest.raises(readers.BadRowError, match=readers.NO_PROMPT):
            readers.turn_prompts(bad)


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


CHATS = [
    {"messages": [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Red."},
                  {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Blue."}]},
    {"prompt": "Count to three."},
    {"conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi."}]},
]
CODE = [{"prompt": "def add(a, b):"}, {"prompt": "Write a loop in C."}, {"prompt": "Sort a list in Python."}]


def test_prompts_from_several_files_each_with_its_limit_and_every_turn(tmp_path, smollm_tokenizer):
    tok = smollm_tokenizer
    chat, code = _write(tmp_path / "chat.jsonl", CHATS), _write(tmp_path / "code.jsonl", CODE)
    got = load_prompts([chat, code], tok, limit=2)
    assert [(p.file, p.sample_id, p.turn) for p in got] == [(chat, 0, 0), (chat, 1, 0), (code, 0, 0), (code, 1, 0)]
    turns = load_prompts([chat], tok, limit=10, all_turns=True)
    assert [(p.sample_id, p.turn) for p in turns] == [(0, 0), (0, 1), (1, 0), (2, 0)]
    want = tok.apply_chat_template(CHATS[0]["messages"][:3], tokenize=False, add_generation_prompt=True)
    assert turns[1].ids == tok(want, add_special_tokens=False)["input_ids"]
    assert turns[0].ids == got[0].ids
    assert [p.file for p in load_prompts(None, tok, limit=2)] == [EMBEDDED] * 2

    empty = _write(tmp_path / "none.jsonl", [{"text": "no prompt here"}])
    with pytest.raises(DFlashError, match="none.jsonl: no usable prompts") as err:
        load_prompts([chat, empty], tok, limit=2)
    assert "of 1 row(s) read: 1 row(s)" in str(err.value) and "first at row 1" in str(err.value)
    # A tokenizer without a chat template: the error says so, not that the records lack user turns.
    bare = copy.copy(tok)
    bare.chat_template = None
    with pytest.raises(DFlashError, match=r"chat\.jsonl: no usable prompts of \d+ row\(s\) read: \d+ row\(s\) "
                                          r"chat template error, first at row 1: .*chat_template is not set"):
        load_prompts([chat], bare, limit=2)
    with pytest.raises(DFlashError, match="missing.jsonl"):
        load_prompts([chat, str(tmp_path / "missing.jsonl")], tok, limit=2)
    with pytest.raises(ValueError, match="prompt file given twice: a.jsonl"):
        EvalConfig(drafter="d", prompts=["a.jsonl", "b.jsonl", "a.jsonl"])
    assert EvalConfig(drafter="d").max_new_tokens == 2048 and not EvalConfig(drafter="d").all_turns


# ---------------------------------------------------------------- the report per file and pooled


def _result(file: str, sid: int, committed: list[int], seconds: float, base_seconds: float) -> PromptResult:
    tokens = list(range(1 + sum(committed)))
    spec = Generation(tokens, seconds, [Step(3, c - 1, c) for c in committed])
    base = Generation(tokens, base_seconds, top1=[2.0] * len(tokens), top2=[1.0] * len(tokens))
    check = check_greedy(sid, tokens, tokens, base.top1, base.top2, torch.float32, lambda: None)
    return PromptResult(Prompt(file, sid, 0, [1, 2]), spec, base, check)


def test_report_per_file_and_pooled():
    results = [_result("chat.jsonl", 0, [4, 4, 2], 1.0, 4.0), _result("code.jsonl", 0, [1, 1], 1.0, 1.0),
               _result("chat.jsonl", 1, [4, 1], 0.5, 2.0)]
    rep = summarize(results, block_size=4, temperature=0.0, dtype=torch.float32)
    assert list(rep["per_file"]) == ["chat.jsonl", "code.jsonl"]
    chat, code = rep["per_file"]["chat.jsonl"], rep["per_file"]["code.jsonl"]
    assert chat["tau"] == 15 / 5 and code["tau"] == 1.0 and rep["tau"] == 17 / 7
    assert chat["speedup"] == pytest.approx((15 / 1.5) / (15 / 6.0)) and code["speedup"] == pytest.approx(1.0)
    assert chat == {**acceptance(results[::2], 4), "lossless": True, "num_mismatches": 0, "num_tie_divergences": 0}
    assert rep["prompts"] == 3 and rep["lossless"] is True
    out = io.StringIO()
    render_report(rep, Console(file=out, width=150))
    table = out.getvalue()[out.getvalue().index("per prompt file"):]
    assert "chat.jsonl" in table and "code.jsonl" in table and "pooled" in table and "3.00" in table


# ---------------------------------------------------------------- processes


def _drafter(out, layers: int) -> str:
    cfg = DrafterConfig(hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                        vocab_size=49152, block_size=4, mask_token_id=0, target_layer_ids=[1, layers - 2],
                        num_target_layers=layers)
    model = DFlashDrafter(cfg)
    init_drafter_weights(model, std=0.3, generator=torch.Generator().manual_seed(0))
    export_drafter(model, cfg, out, dtype=torch.float32)
    return str(out)


def _under_a_launcher(proc, cfg: EvalConfig) -> dict:
    return run_eval(cfg)  # RANK / WORLD_SIZE are in the environment, as torchrun sets them


def test_two_processes_decode_the_same_tokens_as_one(tmp_path, smollm_dir):
    """Prompts of two files divided over two CPU processes, spawned here or started by a launcher: one
    merged report, per file and pooled, and the same tokens, step counts and checks as one process."""
    from dflash_pipeline.launch import launch

    target = make_tiny_target(tmp_path / "target", smollm_dir, layers=4)
    drafter = _drafter(tmp_path / "drafter", 4)
    files = [_write(tmp_path / "chat.jsonl", CHATS), _write(tmp_path / "code.jsonl", CODE)]
    reports, records = [], []
    for procs in (1, 2, "launcher"):
        rec = tmp_path / f"records-{procs}.jsonl"
        cfg = EvalConfig(drafter=drafter, target=str(target), prompts=files, num_prompts=2, all_turns=True,
                         max_new_tokens=12, device="cpu", num_procs=procs if procs != "launcher" else None,
                         records=str(rec))
        if procs == "launcher":
            rank0, rank1 = launch(_under_a_launcher, (cfg,), nprocs=2, kind="cpu")
            assert rank1 == {}  # rank 0 reports
            reports.append(rank0)
        else:
            reports.append(run_eval(cfg))
        records.append([json.loads(line) for line in rec.read_text().splitlines()])
    one, two, launched = reports
    assert (one["processes"], two["processes"], two["devices"], launched["processes"]) == (1, 2, ["cpu", "cpu"], 2)
    assert [(r["file"], r["sample_id"], r["turn"]) for r in records[1]] == [
        (files[0], 0, 0), (files[0], 0, 1), (files[1], 0, 0), (files[1], 1, 0)]
    for a, b, c in zip(*records):
        assert a["tokens"] == b["tokens"] == c["tokens"] and a["target_tokens"] == b["target_tokens"]
        assert len(a["tokens"]) == 12 and a["committed_per_step"] == b["committed_per_step"] == c["committed_per_step"]
        assert a["failure"] is b["failure"] is None
    for key in ("tau", "prompts", "generated_tokens", "steps", "accept_hist", "lossless", "mismatches"):
        assert one[key] == two[key] == launched[key], key
    assert two["lossless"] is True and two["prompts"] == 4 and list(two["per_file"]) == files
    assert [two["per_file"][f]["prompts"] for f in files] == [2, 2]
    assert all(two["step_ms"][k] > 0 for k in ("target_decode", "target_verify", "drafter"))


def test_a_user_error_in_a_process_is_one_line(tmp_path, smollm_dir):
    """Drafter weights that do not load are found inside the processes: the error comes back as one line."""
    target = make_tiny_target(tmp_path / "target", smollm_dir, layers=4)
    drafter = _drafter(tmp_path / "drafter", 4)
    (tmp_path / "drafter" / "model.safetensors").write_bytes(b"not weights")
    cfg = EvalConfig(drafter=drafter, target=str(target), num_prompts=1, max_new_tokens=4, device="cpu",
                     records=str(tmp_path / "no-such-dir" / "r.jsonl"))
    with pytest.raises(DFlashError, match="no-such-dir/r.jsonl: its folder does not exist"):
        run_eval(cfg)
    cfg.records = None
    with pytest.raises(DFlashError, match="cannot load the drafter weights"):
        run_eval(cfg)


def test_command_line_takes_several_prompt_files_and_the_new_options(monkeypatch):
    from typer.testing import CliRunner

    from dflash_pipeline.cli import app
    from dflash_pipeline.eval import run

    seen = []
    monkeypatch.setattr(run, "run_eval", lambda cfg, progress=None: seen.append(cfg) or {})
    res = CliRunner().invoke(app, ["eval", "--drafter", "d", "--prompts", "chat.jsonl", "code.jsonl", "math.jsonl",
                                   "--all-turns", "--gpus", "2", "--records", "r.jsonl"])
    assert res.exit_code == 0, res.output
    cfg = seen[-1]
    assert cfg.prompts == ["chat.jsonl", "code.jsonl", "math.jsonl"] and cfg.all_turns and cfg.gpus == "2"
    assert cfg.records == "r.jsonl" and cfg.max_new_tokens == 2048 and cfg.num_prompts == 32
    assert CliRunner().invoke(app, ["eval", "--drafter", "d"]).exit_code == 0 and seen[-1].prompts is None
    res = CliRunner().invoke(app, ["eval", "--drafter", "d", "--gpus", "two"])
    assert res.exit_code == 2 and "--gpus must be 'all' or a positive number" in res.stderr


def test_json_output_keeps_the_progress_on_stderr_and_stdout_one_json_object(monkeypatch):
    from typer.testing import CliRunner

    from dflash_pipeline.cli import app
    from dflash_pipeline.eval import run

    def fake(cfg, progress=None):
        progress.say("decoding 24 prompts")  # what a long run prints while the JSON is not yet there
        return {"tau": 2.0, "lossless": True}

    monkeypatch.setattr(run, "run_eval", fake)
    res = CliRunner().invoke(app, ["eval", "--drafter", "d", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == {"tau": 2.0, "lossless": True}
    assert "decoding 24 prompts" in res.stderr


# ---------------------------------------------------------------- tree verification (--tree-budget)


class CallableDraft:
    """A test_tree drafter ((anchor, start) -> slot logits) behind the decoding loop's Drafter protocol."""

    def __init__(self, fn, block_size: int):
        self.fn, self.block_size = fn, block_size

    def reset(self) -> None:
        pass

    def draft(self, context, anchor, start):
        return self.fn(anchor, start)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_graphed_tree_decoding_equals_the_reference_loop(temperature):
    """The production loop (static cache, one verify step of q = N + 1 per round; walk, compaction and the
    next context on the device; one transfer) commits exactly the tokens of test_tree's reference loop
    (DynamicCache, 4D ancestor mask, `walk`; checked there against plain greedy decoding and, at T > 0,
    against the target's own distribution), round for round, from the same random stream. Budgets below,
    at and above the vocabulary; drafters that a tree helps and one unrelated to the target."""
    from test_eval import tiny_llama
    from test_tree import SecondGuessDrafter, TableDraft
    from test_tree import tree_generate as reference_loop

    V, D, L = 32, 4, 40
    model = tiny_llama(vocab=V, seed=3, head_std=1.0)
    model.set_attn_implementation("eager")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    base = target_generate(Target(model), prompt, max_new_tokens=L, temperature=0.0, stop_ids=frozenset()).tokens
    drafters = [lambda: SecondGuessDrafter(prompt + base, V, D),
                lambda: TableDraft(torch.randn(V, D, V, generator=torch.Generator().manual_seed(1)))]
    taus = []
    for make in drafters:
        for budget in (3, 16, 40):
            want, accepted = reference_loop(model, make(), prompt, depth=D, budget=budget, max_new_tokens=L,
                                            temperature=temperature, generator=torch.Generator().manual_seed(5))
            target = GraphedTarget(model, [], max_len=len(prompt) + L + budget + 1, block_size=D + 1)
            out = tree_generate(target, CallableDraft(make(), D + 1), prompt, budget=budget, max_new_tokens=L,
                                temperature=temperature, stop_ids=frozenset(),
                                generator=torch.Generator().manual_seed(5))
            target.close()
            assert out.tokens == want and [s.accepted for s in out.steps] == accepted, budget
            assert sum(s.committed for s in out.steps) == L - 1 and all(s.drafted <= D for s in out.steps)
            if temperature == 0:
                assert out.tokens == base
            taus.append(sum(s.committed for s in out.steps) / len(out.steps))
    assert max(taus) > (3 if temperature == 0 else 1.5)  # deep paths were accepted


class Recording(Steered):
    """Steered (forced prefixes of varied length, so the tree accepts paths of every length) that also
    keeps each round's (start, anchor)."""

    def __init__(self, inner, sequence):
        super().__init__(inner, sequence)
        self.calls: list[tuple[int, int]] = []

    def draft(self, context, anchor, start):
        self.calls.append((start, anchor))
        return super().draft(context, anchor, start)


def test_tree_rounds_give_the_drafter_the_features_of_the_committed_path():
    """After each tree round the drafter's context is the target features of the anchor and the accepted
    nodes, taken from the tree's verify step at the nodes' slots: every round's drafter logits equal the
    eager drafter's on the features of one plain forward over the committed tokens."""
    model, layers, B, N = tiny_causal_lm("llama"), [0, 2], 4, 24
    drafter_model = tiny_drafter(layers, block_size=B)
    prompt = [5, 17, 3, 44, 9, 12, 80, 1, 33]
    want = hf_greedy(model, prompt, N)
    target = GraphedTarget(model, layers, max_len=len(prompt) + N + 8, block_size=B)
    draft = Recording(GraphedDraft(drafter_model, target, max_len=len(prompt) + N + 8), prompt + want)
    out = tree_generate(target, draft, prompt, budget=6, max_new_tokens=N, temperature=0.0, stop_ids=frozenset())
    target.close()
    assert out.tokens == want
    assert {s.accepted for s in out.steps} >= {0, 1, 2, 3}  # paths of every length were committed
    eager = Target(model, layers)
    _, feats = eager.forward(prompt + want[:-1], 0, eager.new_cache(), features=True)
    ref = DFlashDraft(drafter_model, eager)
    assert len(draft.calls) == len(draft.seen) >= 8
    for (start, anchor), seen in zip(draft.calls, draft.seen):
        ref.reset()
        torch.testing.assert_close(seen, ref.draft(feats[:, :start], anchor, start), atol=1e-4, rtol=1e-4)
    eager.close()


class SecondGuessOracle:
    """Drafts `sequence` (prompt + the target's continuation) sharply, except that at slot 1 the right token
    is only the second guess: a chain never gets past slot 1, a tree of a few nodes holds the right path."""

    def __init__(self, sequence: list[int], vocab: int, block_size: int):
        self.sequence, self.vocab, self.block_size = list(sequence), vocab, block_size

    def reset(self) -> None:
        pass

    def draft(self, context, anchor, start):
        logits = torch.zeros(self.block_size - 1, self.vocab)
        for k, right in enumerate(self.sequence[start + 1:start + self.block_size]):
            logits[k, right] = 20.0
            if k == 0:
                logits[0, (right + 1) % self.vocab] = 21.0
        return logits


class SharpOracle(SecondGuessOracle):
    """Drafts `sequence` sharply over noise: the right token of a slot is the first guess, or (30% of the
    slots) the second behind a wrong one, so a large budget holds paths down to the block's last slot."""

    def __init__(self, sequence: list[int], vocab: int, block_size: int, seed: int = 0):
        super().__init__(sequence, vocab, block_size)
        self.g = torch.Generator().manual_seed(seed)

    def draft(self, context, anchor, start):
        logits = torch.randn(self.block_size - 1, self.vocab, generator=self.g)
        for k, right in enumerate(self.sequence[start + 1:start + self.block_size]):
            logits[k, right] = 16.0
            if float(torch.rand(1, generator=self.g)) < 0.3:
                logits[k, (right + 7) % self.vocab] = 16.5
        return logits


def test_budget_256_trees_of_full_depth_are_exact_on_the_real_target(smollm_model, smollm_tokenizer):
    """Block 16, budget 256 (a verify step of 257 slots, second guesses at every depth) on the real
    SmolLM2-135M in fp32: paths reach the block's last slot and the output is plain greedy decoding."""
    from test_eval import chat_ids

    V, D, L = smollm_model.config.vocab_size, 15, 40
    ids = chat_ids(smollm_tokenizer, "Write a python function that sorts a list.")
    target = GraphedTarget(smollm_model, [], max_len=len(ids) + L + 260, block_size=D + 1)
    try:
        base = target_generate(target, ids, max_new_tokens=L, temperature=0.0, stop_ids=frozenset())
        tree = tree_generate(target, SharpOracle(ids + base.tokens, V, D + 1), ids, budget=256, max_new_tokens=L,
                             temperature=0.0, stop_ids=frozenset())
    finally:
        target.close()
    assert tree.tokens == base.tokens
    assert max(s.accepted for s in tree.steps) == D


def test_tree_budgets_on_the_real_target_in_fp32(tmp_path, smollm_dir, smollm_model, smollm_tokenizer):
    """The real SmolLM2-135M in fp32: tree decoding is plain greedy decoding token for token; a drafter
    whose right token is its second guess at slot 1 never gets past it as a chain and commits long paths
    as a tree; `dflash eval --tree-budget 0,4,32` measures three budgets in one run, each lossless, with
    per-budget numbers, step times, the table and one record per prompt and budget."""
    from test_eval import chat_ids, export_random, smol_drafter_config, write_prompts

    V, D, L = smollm_model.config.vocab_size, 7, 24
    ids = chat_ids(smollm_tokenizer, "Describe the water cycle in detail.")
    stops = stop_token_ids(smollm_tokenizer, smollm_model)
    target = GraphedTarget(smollm_model, [], max_len=len(ids) + L + 33, block_size=D + 1)
    base = target_generate(target, ids, max_new_tokens=L, temperature=0.0, stop_ids=stops)
    kw = dict(max_new_tokens=L, temperature=0.0, stop_ids=stops)
    oracle = SecondGuessOracle(ids + base.tokens, V, D + 1)
    chain = speculative_generate(target, oracle, ids, **kw)
    tree = tree_generate(target, oracle, ids, budget=32, **kw)
    target.close()
    assert tree.tokens == chain.tokens == base.tokens and len(base.tokens) == L
    assert {s.accepted for s in chain.steps} == {0}
    assert sum(s.committed for s in tree.steps) / len(tree.steps) > 4  # 8 per round but the last

    rec = tmp_path / "records.jsonl"
    cfg = EvalConfig(drafter=export_random(smol_drafter_config(), tmp_path / "drafter"), target=str(smollm_dir),
                     prompts=[write_prompts(tmp_path / "p.jsonl")], num_prompts=2, max_new_tokens=8,
                     tree_budget=[0, 4, 32], records=str(rec))
    report = run_eval(cfg)
    assert report["lossless"] is True and report["tie_divergences"] == [] and report["tree_budget"] == 0
    assert list(report["per_budget"]) == ["0", "4", "32"] and report["per_budget"]["0"]["tau"] == report["tau"]
    for b, r in report["per_budget"].items():
        assert r["lossless"] is True and r["num_mismatches"] == 0 and r["tau"] >= 1 and r["speedup"] > 0
        assert r["step_ms"]["target_verify"] > 0 and r["step_ms"]["target_decode"] > 0
        assert (r["step_ms"]["tree_build"] is None) == (b == "0") and r["speedup_from_step_times"] > 0
    lines = [json.loads(line) for line in rec.read_text().splitlines()]
    assert [(x["sample_id"], x["tree_budget"]) for x in lines] == [(0, 0), (0, 4), (0, 32), (1, 0), (1, 4), (1, 32)]
    assert all(x["tokens"] == x["target_tokens"] for x in lines)
    out = io.StringIO()
    render_report(report, Console(file=out, width=160))
    assert "per tree budget" in out.getvalue() and "lossless" in out.getvalue()
    json.dumps(report)


def test_trees_are_refused_in_one_line_where_they_cannot_run(monkeypatch):
    """Hybrid (linear-attention) targets and targets without the static-cache path refuse a tree budget
    before decoding, in one line; the chain still runs there. The option's mistakes are one line too."""
    from typer.testing import CliRunner

    from dflash_pipeline.cli import app
    from dflash_pipeline.eval import run

    quiet = LiveLine(enabled=False)
    hybrid = tiny_causal_lm("qwen3")
    hybrid.config.layer_types = ["linear_attention", "full_attention", "full_attention"]
    cfg = EvalConfig(drafter="unused", max_new_tokens=8, tree_budget=[0, 8])
    with pytest.raises(DFlashError, match=r"layer 0 \('linear_attention'\) is linear attention.*tree budget 0"):
        make_participants(hybrid, tiny_drafter([0, 1]), [(0, [1, 2, 3])], cfg, quiet)
    dynamic = tiny_causal_lm("llama")
    dynamic.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(DFlashError, match="--tree-budget 8: .*dynamic RoPE scaling.*--tree-budget 0") as e:
        make_participants(dynamic, tiny_drafter([0, 1]), [(0, [1, 2, 3])], cfg, quiet)
    assert "\n" not in str(e.value)
    target, _ = make_participants(dynamic, tiny_drafter([0, 1]), [(0, [1, 2, 3])],
                                  EvalConfig(drafter="unused", max_new_tokens=8), quiet)
    assert type(target) is Target
    with pytest.raises(DFlashError, match="static-cache decoding path only"):
        evaluate(target, CallableDraft(lambda a, s: torch.zeros(3, 96), 4), [(0, [1, 2, 3])], max_new_tokens=6,
                 temperature=0.0, stop_ids=frozenset(), budgets=(0, 4))
    target.close()

    seen = []
    monkeypatch.setattr(run, "run_eval", lambda cfg, progress=None: seen.append(cfg) or {})
    res = CliRunner().invoke(app, ["eval", "--drafter", "d", "--tree-budget", "0,16,64"])
    assert res.exit_code == 0 and seen[-1].tree_budget == [0, 16, 64]
    assert CliRunner().invoke(app, ["eval", "--drafter", "d"]).exit_code == 0 and seen[-1].tree_budget == [0]
    for bad, why in (("16,16", "distinct budgets >= 0"), ("-4", "distinct budgets >= 0"), ("x", "comma-separated")):
        res = CliRunner().invoke(app, ["eval", "--drafter", "d", "--tree-budget", bad])
        assert res.exit_code == 2 and why in res.stderr and res.stderr.count("\n") == 1, bad


def test_compile_mode_reaches_the_config_and_unknown_modes_are_refused(monkeypatch):
    """`--compile-mode max-autotune-no-cudagraphs` implies --compile and keeps the mode for the target's steps;
    `default` is plain --compile; modes that capture CUDA graphs of their own (inside the steps' graphs) or
    misspelt ones are one line and exit 2, before anything loads."""
    from typer.testing import CliRunner

    from dflash_pipeline.cli import app
    from dflash_pipeline.eval import run

    seen = []
    monkeypatch.setattr(run, "run_eval", lambda cfg, progress=None: seen.append(cfg) or {})
    for args, want in (([], False), (["--compile"], True), (["--compile-mode", "default"], True),
                       (["--compile-mode", "max-autotune-no-cudagraphs"], "max-autotune-no-cudagraphs")):
        res = CliRunner().invoke(app, ["eval", "--drafter", "d", *args])
        assert res.exit_code == 0, res.output
        assert seen[-1].compile == want and seen[-1].to_dict()["compile"] == want
    for bad in ("reduce-overhead", "max-autotune", "fast"):
        res = CliRunner().invoke(app, ["eval", "--drafter", "d", "--compile-mode", bad])
        assert res.exit_code == 2 and "--compile-mode must be one of default, max-autotune-no-cudagraphs" in res.stderr
        assert "Traceback" not in res.output


def test_a_compile_mode_goes_to_the_target_runner_and_the_drafter_compiles_plainly(monkeypatch):
    """The mode is torch.compile's for the target's decoder layers (their matrix products); the drafter's
    steps take the fused elementwise kernels only (a bool); the target's tie tolerance is the compiled one."""
    import types

    from dflash_pipeline.decoding import runner as runner_mod
    from dflash_pipeline.eval import graphed
    from dflash_pipeline.eval import run as run_mod

    made = {}

    class FakeRunner:
        graphs = False

        def __init__(self, model, **kw):
            made["target"] = kw["compile"]

        def prepare(self, qs):
            return 0

    class FakeDraft:
        def __init__(self, model, target, **kw):
            made["drafter"] = kw["compile"]

    monkeypatch.setattr(graphed, "DecodingRunner", FakeRunner)
    monkeypatch.setattr(run_mod, "GraphedDraft", FakeDraft)
    monkeypatch.setattr(runner_mod, "unsupported_reason", lambda model: None)
    drafter = types.SimpleNamespace(config=types.SimpleNamespace(target_layer_ids=[0], block_size=4))
    said = io.StringIO()
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    for mode, want_drafter in (("max-autotune-no-cudagraphs", True), ("default", True)):
        cfg = run_mod.EvalConfig(drafter="d", compile=mode, max_new_tokens=8)
        target, _ = run_mod.make_participants(model, drafter, [(0, [1, 2, 3])], cfg,
                                              LiveLine(stream=said))
        assert made["target"] == cfg.compile and made["drafter"] is want_drafter and target.tie_ulps == 16
    assert "in mode max-autotune-no-cudagraphs, its matrix products autotuned" in said.getvalue()
