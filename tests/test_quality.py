"""bench/quality.py's pieces on the CPU: packed rows back to samples, the online loop's target features
against the store's, the job runner (dependencies, exclusive jobs, deadline, resume by skipping), the
data selection, and the SpecForge adaptor (skipped without the `specforge` wheel): its converted drafter
drafts what SpecForge's own model drafts, and its trainer runs on our store."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.append(str(Path(__file__).resolve().parent.parent / "bench"))  # the benchmark modules under test

from dflash_pipeline.store.reader import StoreReader  # noqa: E402
from dflash_pipeline.train.batch import Batch  # noqa: E402
from dflash_pipeline.train.loader import StreamingLoader  # noqa: E402
from dflash_pipeline.train.model import DrafterConfig  # noqa: E402
from helpers import extract_tiny_store  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

try:
    import specforge  # noqa: F401
    HAVE_SPECFORGE = True
except ImportError:
    HAVE_SPECFORGE = False
needs_specforge = pytest.mark.skipif(not HAVE_SPECFORGE, reason="the specforge wheel is not installed "
                                     "(pip install --no-deps 'specforge==0.2.*')")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm_dir):
    target, store = extract_tiny_store(tmp_path_factory.mktemp("quality"), smollm_dir)
    return {"target": target, "store": store}


def _packed_batch() -> Batch:
    # row 0: samples of 3 and 2 tokens then padding; row 1: one sample of 4 tokens
    doc = torch.tensor([[0, 0, 0, 1, 1, -1], [0, 0, 0, 0, -1, -1]])
    R, S, F, K = 2, 6, 5, 2
    tokens = torch.arange(R * S).view(R, S) + 100
    feats = torch.randn(R, S, F)
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [0, 0, 1, 1, 0, 0]], dtype=torch.bool)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]])
    return Batch(tokens, mask, pos, doc, feats, torch.zeros(R, S, K, dtype=torch.long), torch.zeros(R, S, K),
                 int((doc >= 0).sum()))


def test_packed_rows_unpack_into_their_samples():
    from packed import sample_spans
    from specforge_dflash import unpack_rows

    b = _packed_batch()
    assert sample_spans(b.doc) == [(0, 0, 3), (0, 3, 2), (1, 0, 4)]
    ids, hidden, mask = unpack_rows(b)
    assert ids.shape == (3, 4) and hidden.shape == (3, 4, 5) and mask.dtype == torch.float32
    for i, (r, a, n) in enumerate([(0, 0, 3), (0, 3, 2), (1, 0, 4)]):
        assert torch.equal(ids[i, :n], b.tokens[r, a:a + n])
        assert torch.equal(hidden[i, :n], b.features[r, a:a + n])
        assert torch.equal(mask[i, :n].bool(), b.loss_mask[r, a:a + n])
        assert not ids[i, n:].any() and not hidden[i, n:].any() and not mask[i, n:].any()


def test_online_features_equal_the_stores(tiny):
    """The online loop's target pass over a loader batch gives the features and top-k the store holds."""
    from quality_online import target_features

    from dflash_pipeline.extract.target import TargetRunner, load_target

    reader = StoreReader(tiny["store"])
    layers = reader.meta.layer_ids
    loader = StreamingLoader(reader, layers=layers, rank=0, world=1, seed=0, row_len=128, rows_per_batch=2,
                             num_workers=0)
    batch = next(iter(loader.iter_epoch(0)))
    runner = TargetRunner(load_target(tiny["target"], torch.float32, "cpu"), layers, topk=reader.meta.topk)
    try:
        online = target_features(runner, batch, reader.meta.topk)
    finally:
        runner.close()
    real = batch.doc >= 0
    assert online.features.dtype == batch.features.dtype and online.features.shape == batch.features.shape
    torch.testing.assert_close(online.features[real].float(), batch.features[real].float(), atol=2e-2, rtol=1e-2)
    assert not online.features[~real].any()
    agree = (online.topk_ids[real] == batch.topk_ids[real]).float().mean()
    assert agree > 0.98  # ranks may swap only at bf16-level ties
    torch.testing.assert_close(online.topk_logprobs[real][:, 0], batch.topk_logprobs[real][:, 0], atol=2e-2, rtol=0)
    assert online.features.requires_grad is False and not online.features.is_inference()


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_job_runner_order_dependencies_deadline_and_resume(tmp_path):
    from quality_jobs import BLOCKED, FAILED, NOT_STARTED, OK, SKIPPED, STOPPED, UNFINISHED, Job, run_jobs

    trace = tmp_path / "trace"

    def stamp(name: str, sleep: float = 0.0, rc: int = 0) -> list[str]:
        return _py(f"import time, sys; open({str(trace)!r}, 'a').write('{name}+\\n'); time.sleep({sleep}); "
                   f"open({str(trace)!r}, 'a').write('{name}-\\n'); sys.exit({rc})")

    jobs = [Job("a", stamp("a", 0.3)), Job("b", stamp("b", 0.6)), Job("c", stamp("c"), after=("a",)),
            Job("bad", stamp("bad", rc=3)), Job("after-bad", stamp("x"), after=("bad",)),
            Job("solo", stamp("solo"), exclusive=True, wait_for=("a", "b", "c", "bad")),
            Job("skip", stamp("skip"), done=lambda: True)]
    st = run_jobs(jobs, {"train": 2}, say=lambda m: None, poll=0.05)
    assert st["a"]["status"] == OK and st["c"]["status"] == OK and st["bad"]["status"] == FAILED
    assert st["bad"]["rc"] == 3 and st["after-bad"]["status"] == BLOCKED and st["skip"]["status"] == SKIPPED
    lines = trace.read_text().split()
    assert sorted(x for x in lines if x.endswith("+")) == ["a+", "b+", "bad+", "c+", "solo+"]  # each once
    assert lines.index("c+") > lines.index("a-")                         # dependency
    assert sorted(lines[0:2]) == ["a+", "b+"]   # two at a time (which process writes first is the OS's choice)
    assert lines[-2:] == ["solo+", "solo-"] and "skip+" not in lines     # alone, last; done jobs skipped

    # At the deadline a running job is stopped (SIGTERM) and what has not started is reported.
    t = time.time()
    st = run_jobs([Job("slow", _py("import time; time.sleep(30)"), min_time_left=0),
                   Job("late", _py("pass"), after=("slow",), min_time_left=0)],
                  {"train": 1}, deadline=time.time() + 1.0, say=lambda m: None, grace=5, poll=0.05)
    assert st["slow"]["status"] == STOPPED and st["late"]["status"] in (NOT_STARTED, BLOCKED)
    assert time.time() - t < 10

    # A job that exits 0 without its `done` check passing (a training signalled from outside checkpoints and
    # exits 0) ended unfinished: what needs it does not start; the same exit with `done` passing is ok.
    finished = tmp_path / "finished"
    st = run_jobs([Job("train", _py("pass"), done=finished.exists),
                   Job("eval", stamp("eval"), after=("train",)),
                   Job("train2", _py(f"open({str(finished)!r}, 'w')"), done=finished.exists),
                   Job("eval2", stamp("eval2"), after=("train2",))],
                  {"train": 1}, say=lambda m: None, poll=0.05)
    assert st["train"]["status"] == UNFINISHED and st["train"]["rc"] == 0 and st["eval"]["status"] == BLOCKED
    assert st["train2"]["status"] == OK and st["eval2"]["status"] == OK


def test_first_exchange_selection():
    from quality_data import first_exchange

    conv, _ = first_exchange({"conversations": [
        {"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
        {"from": "human", "value": "more"}, {"from": "gpt", "value": "no"}]})
    assert conv == [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
                    {"from": "gpt", "value": "hello"}]
    assert first_exchange({"conversations": [{"from": "gpt", "value": "x"}]})[0] is None
    assert first_exchange({"conversations": [{"from": "human", "value": "q"}, {"from": "human", "value": "q2"}]})[0] is None
    assert first_exchange({"conversations": [{"from": "robot", "value": "q"}]})[1] == "unknown role"
    h, g = ({"from": "human", "value": "hi"}, {"from": "human", "value": "more"}), \
        ({"from": "gpt", "value": "hello"}, {"from": "gpt", "value": "no"})
    # turns "all": every exchange up to the first that breaks the alternation or is empty
    assert first_exchange({"conversations": [h[0], g[0], h[1], g[1], h[0]]}, "all")[0] == [h[0], g[0], h[1], g[1]]
    assert first_exchange({"conversations": [h[0], g[0], h[1], {"from": "gpt", "value": " "}, h[0], g[0]]},
                          "all")[0] == [h[0], g[0]]
    assert first_exchange({"conversations": [h[0], g[0], g[1], h[1], g[1]]}, "all")[0] == [h[0], g[0]]


def test_each_exchange_is_a_conversation_of_its_own():
    from quality_data import each_exchange

    sys_m = {"from": "system", "value": "be brief"}
    h = [{"from": "human", "value": f"q{i}"} for i in range(3)]
    g = [{"from": "gpt", "value": f"a{i}"} for i in range(3)]
    convs, _ = each_exchange({"conversations": [sys_m, h[0], g[0], h[1], g[1], h[2], g[2]]})
    assert convs == [[sys_m, h[0], g[0]], [sys_m, h[1], g[1]], [sys_m, h[2], g[2]]]
    # the same exchanges turns "all" keeps: up to the first pair that breaks the alternation
    assert each_exchange({"conversations": [h[0], g[0], g[1], h[1], g[1]]})[0] == [[h[0], g[0]]]
    assert each_exchange({"conversations": [g[0]]}) == ([], "no user turn")


def test_turns_each_writes_every_question_once(monkeypatch, tmp_path):
    import json

    import quality_data

    class Tok:   # one token per character: the prompt cap counts characters here
        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [list(t) for t in texts]}

    rows = [(0, {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"},
                                   {"from": "human", "value": "continue"}, {"from": "gpt", "value": "more"}]}),
            (1, {"conversations": [{"from": "human", "value": "continue "}, {"from": "gpt", "value": "x"},
                                   {"from": "human", "value": "a question far too long"}, {"from": "gpt", "value": "y"},
                                   {"from": "human", "value": "why"}, {"from": "gpt", "value": "z"}]})]
    monkeypatch.setattr(quality_data, "iter_embedded_rows", lambda split: iter(rows))
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: Tok())
    monkeypatch.setattr("dflash_pipeline.extract.target.resolve_target", lambda t: "tok")
    out = tmp_path / "orig.jsonl"
    rec = quality_data.write_first_exchanges(out, None, 10, 12, "each")
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in written] == ["sharegpt-train-0-0", "sharegpt-train-0-1", "sharegpt-train-1-2"]
    assert [[m["value"] for m in r["conversations"]] for r in written] == [["hello", "hi"], ["continue", "more"],
                                                                           ["why", "z"]]
    assert rec["conversations"] == 3 and rec["skipped"] == {"a user turn already written": 1,
                                                             "first user turn longer than the cap": 1}


def test_unseen_exchanges_are_the_ones_after_a_trained_set(monkeypatch, tmp_path):
    """bench/heldout_judge.py unseen-exchanges SKIP N: exchanges SKIP.. of the same writer, in its order and filters
    (so the first SKIP are exactly `--n SKIP`'s training conversations), and no scratch file left behind."""
    import json

    import heldout_judge
    import quality_data

    class Tok:
        def __call__(self, texts, add_special_tokens=False):
            return {"input_ids": [list(t) for t in texts]}

    rows = [(i, {"conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": "a\u2028b"}]})
            for i in range(6)]   # a line separator inside a reply is not a row boundary
    monkeypatch.setattr(quality_data, "iter_embedded_rows", lambda split: iter(rows))
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: Tok())
    monkeypatch.setattr("dflash_pipeline.extract.target.resolve_target", lambda t: "tok")
    out = tmp_path / "unseen.jsonl"
    assert heldout_judge.unseen_exchanges(4, 3, str(out), max_prompt_tokens=64) == 2   # only 6 exist
    written = [json.loads(line) for line in out.read_text(encoding="utf-8").split("\n") if line]
    assert [r["id"] for r in written] == ["sharegpt-train-4-0", "sharegpt-train-5-0"]
    assert written[0]["conversations"][1]["value"] == "a\u2028b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unseen.jsonl"]
    with pytest.raises(SystemExit, match="'4k' is not a count"):
        heldout_judge.main(["unseen-exchanges", "4k", "3", str(out)])


def _tiny_dcfg(layer_types, window=None) -> DrafterConfig:
    return DrafterConfig(hidden_size=64, intermediate_size=128, num_layers=len(layer_types), num_heads=4,
                         num_kv_heads=2, head_dim=16, vocab_size=100, block_size=8, mask_token_id=99,
                         target_layer_ids=[1, 3, 5], num_target_layers=8, rope_theta=10000.0,
                         layer_types=layer_types, sliding_window=window)


@needs_specforge
@pytest.mark.parametrize("layer_types,window", [(["full_attention"] * 2, None),
                                                 (["sliding_attention", "full_attention"], 8)])
def test_converted_specforge_drafter_drafts_the_same_tokens(tmp_path, layer_types, window):
    from specforge.algorithms.common.dflash_family_model import create_dflash_sdpa_mask
    from specforge_dflash import build_draft, export_specforge, export_state

    from dflash_pipeline.train.export import export_drafter, load_exported

    dcfg = _tiny_dcfg(layer_types, window)
    draft = build_draft(dcfg, "eager").float().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norms away from 1, so that a swapped or dropped weight shows
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    export_drafter(export_state(draft, dcfg), dcfg, tmp_path / "fp32", dtype=torch.float32)
    ours, cfg = load_exported(tmp_path / "fp32")
    assert cfg == dcfg
    # Context beyond the anchor must stay invisible; a window of 8 hides context positions 0-1 from slot 0
    # and more from later slots (SpecForge's window does not reach inside the block: equal when W >= B).
    S, p, B = 12, 9, dcfg.block_size
    feats, emb = torch.randn(1, S, 3 * 64, generator=g), torch.randn(1, B, 64, generator=g)
    mask_args = dict(anchor_positions=torch.tensor([[p]]), block_keep_mask=torch.tensor([[True]]), S=S,
                     block_size=B, device="cpu")
    mask = create_dflash_sdpa_mask(**mask_args)
    if window:
        mask = {"full_attention": mask, "sliding_attention": create_dflash_sdpa_mask(**mask_args, sliding_window=window)}
    pos = torch.cat([torch.arange(S), p + torch.arange(B)])[None]
    head = torch.randn(100, 64, generator=g)
    with torch.no_grad():
        want = draft(position_ids=pos, noise_embedding=emb, target_hidden=feats, attention_mask=mask)
        got = ours.draft_step(feats[:, :p], torch.arange(p), emb, p + torch.arange(B), ours.new_cache())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal((got @ head.T).argmax(-1), (want @ head.T).argmax(-1))
    # The export format itself (bf16) loads and drafts the same blocks up to bf16 rounding.
    bf16, _ = load_exported(export_specforge(draft, dcfg, tmp_path / "bf16"))
    with torch.no_grad():
        got16 = bf16.draft_step(feats[:, :p], torch.arange(p), emb, p + torch.arange(B), bf16.new_cache())
    torch.testing.assert_close(got16, want, atol=0.1, rtol=0.05)


def test_specforge_loss_chunks_fit_the_logits_budget():
    """The default recipe's batch on SmolLM2 (~140 samples of 64 anchors x 16, vocab 49,152) in one chunk of
    SpecForge's loss is ~14 GB of bf16 logits; under a 2 GiB budget it is 9 anchors a chunk."""
    from specforge_dflash import objective_chunk_blocks

    V, B = 49152, 16
    assert objective_chunk_blocks(140, B, V, 2 * 2**30) == 9
    assert 140 * 9 * B * V * 2 <= 2 * 2**30 < 140 * 10 * B * V * 2
    assert objective_chunk_blocks(1, 4, 100, 2 * 2**30) == 128      # never above SpecForge's own default
    assert objective_chunk_blocks(10_000, B, V, 2 * 2**30) == 1     # at least one anchor
    assert objective_chunk_blocks(0, B, V, 1e9) >= 1


@needs_specforge
def test_specforge_loss_and_gradients_do_not_depend_on_the_chunking():
    """Setting `objective_chunk_blocks` on the built model per batch (what the adaptor does) reaches SpecForge's
    loss, and its chunked, checkpointed loss gives the unchunked loss and gradients with the same anchors."""
    import specforge.algorithms.common.dflash_family_model as dfm
    from specforge_dflash import build_draft, import_specforge

    _, OnlineDFlashModel, _ = import_specforge()
    dcfg = _tiny_dcfg(["full_attention"] * 2, None)
    g = torch.Generator().manual_seed(0)
    V, H = dcfg.vocab_size, dcfg.hidden_size
    embed = torch.nn.Embedding(V, H, _weight=torch.randn(V, H, generator=g), _freeze=True)
    head = torch.nn.Linear(H, V, bias=False)
    head.weight = torch.nn.Parameter(torch.randn(V, H, generator=g), requires_grad=False)
    model = OnlineDFlashModel(build_draft(dcfg, "eager").float(), head, embed, dcfg.mask_token_id,
                              block_size=dcfg.block_size, attention_backend="sdpa", num_anchors=6,
                              loss_decay_gamma=3.0).float()
    n, T = 3, 24
    ids = torch.randint(0, V, (n, T), generator=g)
    hidden = torch.randn(n, T, len(dcfg.target_layer_ids) * H, generator=g)
    mask = (torch.rand(n, T, generator=g) > 0.2).float()
    seen, real = [], dfm.checkpointed_chunk_reduce

    def spy(*a, chunk_size, **kw):
        seen.append(chunk_size)
        return real(*a, chunk_size=chunk_size, **kw)

    dfm.checkpointed_chunk_reduce = spy
    try:
        results = []
        for chunk in (0, 1, 4):
            model.objective_chunk_blocks = chunk
            model.zero_grad()
            torch.manual_seed(7)  # the same anchors each time
            loss, acc, _ = model(input_ids=ids, hidden_states=hidden, loss_mask=mask)
            loss.backward()
            results.append((loss.detach(), acc.detach(), [p.grad.clone() for p in model.draft_model.parameters()
                                                           if p.grad is not None]))
    finally:
        dfm.checkpointed_chunk_reduce = real
    assert seen == [0, 1, 4]
    loss0, acc0, grads0 = results[0]
    assert grads0
    for loss, acc, grads in results[1:]:
        torch.testing.assert_close(loss, loss0, atol=1e-5, rtol=1e-5)
        assert torch.equal(acc, acc0)
        for a, b in zip(grads, grads0):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@needs_specforge
def test_specforge_memory_bench_measures_each_chunk_and_the_budgets(tmp_path):
    import specforge_memory

    specforge_memory.main(["--smoke", "--json", str(tmp_path / "m.json")])
    out = json.loads((tmp_path / "m.json").read_text())
    assert [r["chunk"] for r in out["results"]] == [128, 2, out["budget_chunk"]] and out["budget_chunk"] == 3
    assert out["longest"] == 48 and out["samples"] == 4
    assert all(not r["oom"] and math.isfinite(r["loss"]) and r["step_s"] > 0 for r in out["results"])
    assert all("step_vs_one_chunk" in r for r in out["results"][1:])


@needs_specforge
def test_specforge_trains_on_our_store_and_exports(tiny, tmp_path):
    from specforge_dflash import train_specforge

    from dflash_pipeline.eval.run import load_drafter, read_drafter_config
    from dflash_pipeline.progress import LiveLine

    out = tmp_path / "sf"
    s = train_specforge(store=tiny["store"], out=out, steps=4, num_layers=1, block_size=4, gamma=3.0, max_anchors=8,
                        tokens_per_batch=256, max_length=128, eval_fraction=0.1, num_workers=0, device="cpu",
                        log_every=2, lr=3e-3, logits_budget_gib=1e-6, progress=LiveLine(enabled=False))
    assert s["finished"] and s["step"] == 4
    assert s["objective_chunk_blocks"]["max"] == 1  # a budget below one anchor's logits: one anchor a chunk
    logs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in logs if r["type"] == "train")
    assert 1.0 <= s["eval"]["tau_chain"] <= 4.0 and s["eval"]["samples"] > 0
    dcfg = read_drafter_config(str(out / "final"))  # what `dflash eval` reads and loads
    assert dcfg.block_size == 4 and dcfg.target_layer_ids == StoreReader(tiny["store"]).meta.layer_ids
    load_drafter(str(out / "final"), torch.float32, torch.device("cpu"))


def test_summary_tables_and_goals_from_result_files(tmp_path):
    """The summary reads what the parts wrote and judges the goals from it (nothing measured here)."""
    import quality
    from quality_summary import build_summary

    b = quality.Bench(str(tmp_path), None, quality.SMOKE, smoke=True)

    def run(name: str, store: str, est: float, taus: dict[str, float], block: int = 16):
        d = b.run_dir(name)
        (d / "final").mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"step": 4, "finished": True, "seconds": 9.0, "eval": {
            "tau_chain": est, "acc_per_pos": [0.8, 0.6], "acc": 0.7}}))
        (d / "config.json").write_text(json.dumps({"train": {"block_size": block, "tokens_per_batch": 1024},
                                                   "store": {"url": str(b.store(store))}, "steps_per_epoch": 2}))
        for key, tau in taus.items():
            prompt_set, t = key.split("@")
            b.eval_file(name, prompt_set, float(t)).write_text(json.dumps({"tau": tau, "lossless": True,
                                                                            "speedup": 1.2}))

    run("ce", "regen-bf16", 3.6, {"chat@0": 3.0, "chat@1": 2.5, "code@0": 2.25, "math@0": 2.75})
    run("kl15", "regen-bf16", 2.2, {"chat@0": 2.0})
    run("ce@orig", "orig-bf16", 1.5, {"chat@0": 1.5})
    run("ce@fp8", "regen-fp8", 3.5, {"chat@0": 2.97})
    b.eval_file("ce", "chat", 0.0, alone=True).write_text(json.dumps({"tau": 3.0, "speedup": 1.8}))
    # what the parts ran with, as their records say, not this (later) invocation's plan
    b.write("recipes", {"best": quality.best_run(b, fresh=True), "plan": {"steps": 2000}})
    b.write("inputs", {"orig": {"conversations": 6000, "turns": "all", "mean_exchanges": 3.66}})
    b.write("data", {"plan": {"max_new_tokens": 384, "turns": "all"}})
    md, rec = build_summary(b)
    assert "## Recipes on the regenerated bf16 store, 2000 steps each" in md
    assert "6000 conversations of the embedded ShareGPT train split, every exchange (mean 3.66" in md
    assert "up to 384 new tokens" in md
    assert rec["best"] == "ce"   # the highest real tau, not the highest estimate
    goals = {g["goal"]: g for g in rec["goals"]}
    assert goals["real tau (T=0, block 16, chat) >= 3.0"]["met"]
    assert goals["real speedup > 1 (best, alone)"]["value"] == 1.8
    assert goals["regenerated / original tau >= 1.5"]["value"] == pytest.approx(2.0)
    assert goals["fp8 within 2% of bf16 tau"]["met"] and goals["fp8 within 2% of bf16 tau"]["value"] == pytest.approx(0.01)
    est = goals["held-out estimate within 10% of real tau (recipes, worst)"]
    assert est["value"] == pytest.approx(1.2) and not est["met"]
    assert "| ce | CE, gamma 7 | 0.800 | 3.60 | 3.00 | 1.20 | 2.50 | 2.25 | 2.75 |" in md   # ... code, math
    assert "| ce@orig | store orig-bf16 |" in md
    # a recipe store in fp8: the ratio takes the original replies' fp8 run where there is one (like for like)
    run("ce@orig8", "orig-fp8", 1.2, {"chat@0": 1.25})
    (b.run_dir("ce") / "config.json").write_text(json.dumps({"train": {"block_size": 16, "tokens_per_batch": 1024},
                                                             "store": {"url": str(b.store("regen-fp8"))}}))
    goals = {g["goal"]: g for g in build_summary(b)[1]["goals"]}
    assert goals["regenerated / original tau >= 1.5"]["value"] == pytest.approx(2.4)
    assert goals["regenerated / original tau >= 1.5"]["note"] == "against ce@orig8"
    # --turns each: every user turn asked afresh; the summary must not call them first exchanges
    b.write("inputs", {"orig": {"conversations": 40000, "turns": "each"}})
    md, _ = build_summary(b)
    assert "40000 user turns of the embedded ShareGPT train split, each asked afresh" in md
    assert "first exchanges" not in md


def test_math_prompts_come_from_the_champ_package_and_get_their_evals(tmp_path, monkeypatch):
    """Part `inputs` writes CHAMP's problems (read from the installed package's data file, in identifier
    order) as `dflash eval` prompts; the eval jobs then measure each drafter on them at T=0, as on code."""
    import quality
    from quality_data import MATH_INSTRUCTION, write_math_prompts

    pkg = tmp_path / "site" / "champ_dataset"
    (pkg / "dataset_files").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "dataset_files" / "v0.json").write_text(json.dumps({"problems": {
        "P_Sequence_2": {"_text": "Find a_5.", "category": "Sequence"},
        "P_Combinatorics_10": {"_text": "How many more?", "category": "Combinatorics"},
        "P_Combinatorics_2": {"_text": "How many pairs?", "category": "Combinatorics"},
        "P_Combinatorics_1": {"_text": "How many strings?", "category": "Combinatorics"}}, "concepts": {}}))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    import importlib

    importlib.invalidate_caches()
    out = tmp_path / "prompts-math.jsonl"
    rec = write_math_prompts(out)
    assert rec["prompts"] == 4 and rec["categories"] == {"Combinatorics": 3, "Sequence": 1} and "CHAMP" in rec["source"]
    rows = [json.loads(line) for line in out.read_text().splitlines()]   # categories in turn, numbers in order
    assert [r["id"] for r in rows] == ["P_Combinatorics_1", "P_Sequence_2", "P_Combinatorics_2", "P_Combinatorics_10"]
    assert rows[0]["prompt"] == MATH_INSTRUCTION + "How many strings?"

    b = quality.Bench(str(tmp_path / "q"), None, quality.SMOKE, smoke=True)
    assert not any("math" in j.name for j in b.eval_jobs("ce"))        # no math prompts, no math evals
    b.data("prompts-math.jsonl").write_text(out.read_text())
    (math,) = [j for j in b.eval_jobs("ce") if "math" in j.name]
    assert math.name == "ce__math__T0"
    assert math.cmd[math.cmd.index("--prompts") + 1] == str(b.data("prompts-math.jsonl"))
    assert math.cmd[math.cmd.index("--num-prompts") + 1] == str(quality.SMOKE.math_prompts)


def test_summary_says_unmeasured_goals_are_unmeasured(tmp_path):
    """A root that holds only a variant run (its base trained in another root): the goals it cannot judge
    read "not measured", not "missed", and no cell reads None."""
    import quality
    from quality_summary import build_summary

    b = quality.Bench(str(tmp_path), None, quality.SMOKE, smoke=True)
    d = b.run_dir("ce@fp8")
    (d / "final").mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"step": 4, "finished": True, "seconds": 9.0,
                                                "eval": {"tau_chain": 1.4, "acc_per_pos": [0.4], "acc": 0.4}}))
    md, rec = build_summary(b)
    goals = md[md.index("## Goals"):]
    assert "| real tau (T=0, block 16, chat) >= 3.0 | - | not measured |" in goals
    assert "None" not in goals and "**missed**" not in goals.split("held-out estimate")[0]


def _opt(cmd: list[str], flag: str) -> list[str]:
    """Every value a command gives `flag`."""
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == flag]


def test_sampled_regeneration_and_the_mixed_store_are_planned(tmp_path, monkeypatch):
    """--stores regen-t1-bf16,mix-bf16: part `data` regenerates a second set at T=1 (only then), the mixed
    store is extracted from both sets of replies, and their variants train under their own names."""
    import quality

    ran: list = []
    monkeypatch.setattr(quality, "run_jobs", lambda jobs, *a, **k: ran.extend(jobs) or {})
    monkeypatch.setattr(quality, "generate_command_exists", lambda b: True)
    b = quality.Bench(str(tmp_path), None, quality.SMOKE, smoke=True)
    b.write("inputs", {"complete": True})
    b.data("orig.jsonl").write_text("{}\n")

    def cmds(part, *args):
        ran.clear()
        part(b, *args)
        return {j.name: (j.cmd() if callable(j.cmd) else j.cmd) for j in ran}

    b.stores = ["regen-bf16"]
    assert list(cmds(quality.part_data, None, "cli")) == ["generate"]    # the default run: greedy only
    # data generated with other settings (e.g. carried from an earlier session) is refused, not reused
    other = quality.Bench(str(tmp_path), None, quality.dataclasses.replace(quality.SMOKE, max_new_tokens=99), smoke=True)
    with pytest.raises(SystemExit, match=r"generated with max_new_tokens 16 \(now 99\)"):
        quality.part_data(other, None, "cli")
    b.stores = ["regen-bf16", "regen-t1-bf16", "mix-bf16", "all-fp8"]
    gen = cmds(quality.part_data, None, "cli")
    assert _opt(gen["generate"], "--temperature") == ["0"] and _opt(gen["generate-regen-t1"], "--temperature") == ["1"]
    assert _opt(gen["generate-regen-t1"], "--out") == [str(b.data("regen-t1"))]
    b.write("data", {**b.read("data"), "complete": True})
    stores = cmds(quality.part_stores, None)
    assert set(stores) == {"extract-regen-bf16", "extract-regen-t1-bf16", "extract-mix-bf16", "extract-all-fp8"}
    assert _opt(stores["extract-mix-bf16"], "--data") == [str(b.data("orig.jsonl")), str(b.data("regen"))]
    assert _opt(stores["extract-all-fp8"], "--data") == [str(b.data(d)) for d in ("orig.jsonl", "regen", "regen-t1")]
    assert _opt(stores["extract-all-fp8"], "--codec") == ["fp8"]
    assert _opt(stores["extract-regen-t1-bf16"], "--data") == [str(b.data("regen-t1"))]
    for name in ("regen-t1-bf16", "mix-bf16"):
        (b.root / "stores" / f"{name}.json").write_text("{}")
    b.best_override, b.variant_stores = "ce", ["regen-t1-bf16", "mix-bf16"]
    runs = cmds(quality.part_variants, None)
    assert _opt(runs["ce@t1"], "--store") == [str(b.store("regen-t1-bf16"))]
    assert _opt(runs["ce@mix"], "--store") == [str(b.store("mix-bf16"))]


def test_recipes_train_on_the_store_asked_for(tmp_path, monkeypatch):
    """--recipe-store regen-fp8: every recipe run of part `recipes` reads that store, the summary says so,
    and the deeper, sparser and faster recipes reach `dflash train` as 8 layers / 128 anchors over twice the
    tokens / 64 over four times / a 3x learning rate (the others keep the default)."""
    import quality
    from quality_summary import build_summary

    ran: list = []
    monkeypatch.setattr(quality, "run_jobs", lambda jobs, *a, **k: ran.extend(jobs) or {})
    b = quality.Bench(str(tmp_path), None, quality.SMOKE, smoke=False)   # smoke=True keeps one step's tokens
    (b.root / "stores" / "regen-fp8.json").write_text("{}")
    b.recipes = ["kl15-cap-noise", "kl15-cap-noise-l8", "kl15-cap-noise-a128x2", "kl15-cap-noise-a64x4",
                 "kl15-cap-noise-lr3x"]
    b.recipe_store = "regen-fp8"
    quality.part_recipes(b, None)
    train = {j.name: (j.cmd() if callable(j.cmd) else j.cmd) for j in ran if j.kind == "train"}

    assert set(train) == set(b.recipes)
    assert all(_opt(cmd, "--store") == [str(b.store("regen-fp8"))] for cmd in train.values())
    assert _opt(train["kl15-cap-noise-l8"], "--num-layers") == ["8"]
    assert _opt(train["kl15-cap-noise"], "--num-layers") == [str(quality.SMOKE.num_layers)]
    sparse = train["kl15-cap-noise-a128x2"]
    assert _opt(sparse, "--max-anchors") == ["128"]
    assert _opt(sparse, "--tokens-per-batch") == [str(2 * quality.SMOKE.tokens_per_batch)]
    sparser = train["kl15-cap-noise-a64x4"]
    assert _opt(sparser, "--max-anchors") == ["64"]
    assert _opt(sparser, "--tokens-per-batch") == [str(4 * quality.SMOKE.tokens_per_batch)]
    assert _opt(train["kl15-cap-noise-lr3x"], "--lr") == ["0.0018"] and not _opt(train["kl15-cap-noise"], "--lr")
    md, _ = build_summary(b)
    assert "## Recipes on store regen-fp8, " in md


def test_summary_names_the_runs_store_while_part_recipes_still_runs(tmp_path):
    """A summary packed while part `recipes` still runs (no part record yet: its evals are going) names the
    store each run recorded at its start, not the bf16 default (an fp8 run read "bf16 store" on 2026-12-07)."""
    import quality
    from quality_summary import build_summary

    b = quality.Bench(str(tmp_path), None, quality.SMOKE, smoke=False)
    run = b.run_dir("kl15-cap-noise-a64x4")
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"finished": True}))
    (run / "quality-run.json").write_text(json.dumps({"recipe": "kl15-cap-noise-a64x4", "store": "regen-fp8",
                                                      "steps": 750, "part": "recipes", "init_from": None}))
    md, _ = build_summary(b)
    assert "## Recipes on store regen-fp8, " in md and "regenerated bf16 store" not in md


def test_curve_trains_the_best_recipe_on_the_recipe_store_at_the_lengths_asked_for(tmp_path, monkeypatch):
    """--curve 0.25,0.5 --best kl15-cap-noise-a64x4 --recipe-store regen-fp8: part `curve` trains that recipe at a
    quarter and half of --steps, each its own schedule, on the store the recipes' run read, and evaluates both;
    the summary's learning curve lists them with the recipes' run."""
    import quality
    from quality_summary import build_summary

    ran: list = []
    monkeypatch.setattr(quality, "run_jobs", lambda jobs, *a, **k: ran.extend(jobs) or {})
    parsed: dict = {}
    monkeypatch.setattr(quality, "part_curve", lambda b, deadline: parsed.update(plan=b.plan))
    quality.main(["curve", "--root", str(tmp_path / "parsed"), "--steps", "3000", "--curve", "0.25,0.5"])
    assert parsed["plan"].curve == (0.25, 0.5) and parsed["plan"].steps == 3000
    with pytest.raises(SystemExit):
        quality.main(["curve", "--root", str(tmp_path / "parsed"), "--curve", "0,half"])
    monkeypatch.undo()
    monkeypatch.setattr(quality, "run_jobs", lambda jobs, *a, **k: ran.extend(jobs) or {})

    best = "kl15-cap-noise-a64x4"
    b = quality.Bench(str(tmp_path), None, quality.dataclasses.replace(quality.SMOKE, steps=400, curve=(0.25, 0.5)),
                      smoke=False)
    (b.root / "stores" / "regen-fp8.json").write_text("{}")
    b.best_override, b.recipe_store = best, "regen-fp8"
    quality.part_curve(b, None)
    train = {j.name: (j.cmd() if callable(j.cmd) else j.cmd) for j in ran if j.kind == "train"}
    assert set(train) == {f"{best}@steps100", f"{best}@steps200"}
    assert all(_opt(c, "--store") == [str(b.store("regen-fp8"))] for c in train.values())
    assert _opt(train[f"{best}@steps100"], "--steps") == ["100"] and _opt(train[f"{best}@steps100"], "--max-anchors") == ["64"]
    assert {j.name.split("__")[0] for j in ran if j.kind == "eval"} == set(train)

    for name, steps, tau in ((best, 400, 3.1), (f"{best}@steps100", 100, 2.2), (f"{best}@steps200", 200, 2.7)):
        d = b.run_dir(name)
        (d / "final").mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"step": steps, "finished": True, "seconds": 9.0,
                                                    "eval": {"tau_chain": tau - 0.1, "acc_per_pos": [0.8], "acc": 0.8}}))
        (d / "config.json").write_text(json.dumps({"train": {"block_size": 16}, "store": {"url": str(b.store("regen-fp8"))}}))
        b.eval_file(name, "chat", 0.0).write_text(json.dumps({"tau": tau, "lossless": True}))
    md, rec = build_summary(b)
    assert "## Learning curve" in md
    assert set(rec["curve"]) == {best, f"{best}@steps100", f"{best}@steps200"}


def test_specforge_side_by_side_against_a_recipe_on_the_recipe_store(tmp_path, monkeypatch):
    """--specforge-against kl15-cap-noise-a64x4 --recipe-store regen-fp8: SpecForge trains on that store at the
    recipe's 64 anchors over 4x the tokens, our speed run is that recipe on that store, the evals measure
    SpecForge's drafter, and the summary sets it beside the recipe's own run (the default stays ce)."""
    import quality
    from quality_summary import build_summary

    ran: list = []
    monkeypatch.setattr(quality, "run_jobs", lambda jobs, *a, **k: ran.extend(jobs) or {})
    b = quality.Bench(str(tmp_path), None, quality.SMOKE, smoke=False)
    (b.root / "stores" / "regen-fp8.json").write_text("{}")
    b.recipe_store, b.specforge_against = "regen-fp8", "kl15-cap-noise-a64x4"
    quality.part_specforge(b, None)
    cmds = {j.name: (j.cmd() if callable(j.cmd) else j.cmd) for j in ran}
    sf, speed = cmds["specforge-kl15-cap-noise-a64x4"], cmds["speed-kl15-cap-noise-a64x4"]
    assert _opt(sf, "--store") == [str(b.store("regen-fp8"))] == _opt(speed, "--store")
    assert _opt(sf, "--max-anchors") == ["64"] == _opt(speed, "--max-anchors")
    assert _opt(sf, "--tokens-per-batch") == [str(4 * quality.SMOKE.tokens_per_batch)] == _opt(speed, "--tokens-per-batch")
    assert _opt(speed, "--kl-weight") == ["0.15"]
    evals = [c for n, c in cmds.items() if "__chat__" in n]
    assert evals and all(_opt(c, "--drafter")[0].endswith("specforge-kl15-cap-noise-a64x4/final") for c in evals)
    assert _opt(cmds["specforge-kl15-cap-noise-a64x4__chat__T0"], "--records") == [
        str(quality.records_file(b.eval_file("specforge-kl15-cap-noise-a64x4", "chat", 0.0)))]
    assert b.read("specforge")["compared_with"] == "kl15-cap-noise-a64x4"

    for name, est, tau in (("kl15-cap-noise-a64x4", 2.9, 3.1), ("specforge-kl15-cap-noise-a64x4", 2.5, 2.7)):
        d = b.run_dir(name)
        (d / "final").mkdir(parents=True)
        extra = {"peak_mem_gb": 48.0, "objective_chunk_blocks": {"min": 7, "max": 9, "logits_budget_gib": 2.0},
                 "steady": {"input_tok_s": 150000.0}} if name.startswith("specforge") else {}
        (d / "summary.json").write_text(json.dumps({"step": 4, "finished": True, "seconds": 9.0, **extra,
                                                    "eval": {"tau_chain": est, "acc_per_pos": [0.8], "acc": 0.8}}))
        (d / "config.json").write_text(json.dumps({"train": {"block_size": 16}, "store": {"url": str(b.store("regen-fp8"))}}))
        b.eval_file(name, "chat", 0.0).write_text(json.dumps({"tau": tau, "lossless": True}))
        # per-prompt records (`dflash eval --records`): ours commits one token more in every fourth step
        steps = [3, 3, 3, 4] if name.startswith("kl15") else [3, 3, 3, 3]
        quality.records_file(b.eval_file(name, "chat", 0.0)).write_text("".join(json.dumps(
            {"file": "/x/prompts-chat.jsonl", "sample_id": i, "turn": 0, "tree_budget": 0,
             "committed_per_step": steps * (1 + i % 3), "target_tokens": [i] * 5}) + "\n" for i in range(12)))
    speed_dir = b.run_dir("speed-kl15-cap-noise-a64x4")
    speed_dir.mkdir(parents=True, exist_ok=True)
    (speed_dir / "metrics.jsonl").write_text("\n".join(json.dumps({"type": "train", "input_tok_s": t, "peak_mem_gb": m})
                                                       for t, m in ((9e3, 20.1), (195e3, 26.7), (190e3, 26.5))))
    md, rec = build_summary(b)
    assert "## Side by side with SpecForge (store regen-fp8, same batches, steps, lr schedule, block 16, 64 anchors" in md
    assert "| ours (`dflash train`, recipe kl15-cap-noise-a64x4) |" in md
    assert rec["specforge"]["peak_mem_gb"] == {"ours": 26.7, "specforge": 48.0}
    assert rec["specforge"]["speed_ratio"] == pytest.approx(195e3 / 150e3)  # the upper median after the first interval
    assert "| 26.7 |" in md and "| 48.0 |" in md and "chunks of 7-9 anchors (a 2.0 GiB logits budget" in md
    paired = rec["specforge"]["paired_chat_T0"]
    assert paired["ratio"] == pytest.approx(13 / 12) and paired["separated"] and paired["per_prompt"]["b_wins"] == 12
    assert "Paired by prompt (chat T=0, 12 prompts): ours / SpecForge's tau 1.083" in md
    goals = {g["goal"]: g for g in rec["goals"]}
    assert goals["ours (kl15-cap-noise-a64x4) tau >= SpecForge's (T=0 chat)"]["met"]
    assert "paired 95%" in goals["ours (kl15-cap-noise-a64x4) tau >= SpecForge's (T=0 chat)"]["note"]


def test_init_from_reaches_every_training_and_the_summary(tmp_path, monkeypatch):
    """--init-from: a drafter returned by an earlier session trains on; every training of the call starts from
    it (`dflash train --init-from`), its run records say so, and the summary's recipes heading too."""
    import quality
    from quality_summary import build_summary

    ran: list = []
    monkeypatch.setattr(quality, "run_jobs", lambda jobs, *a, **k: ran.extend(jobs) or {})
    b = quality.Bench(str(tmp_path), None, quality.SMOKE, smoke=True)
    (b.root / "stores" / "regen-bf16.json").write_text("{}")
    b.recipes, b.init_from = ["ce", "kl15-cap-noise"], str(tmp_path / "drafter-kl15-cap-noise")
    quality.part_recipes(b, None)
    train = [j for j in ran if j.kind == "train"]
    assert [_opt(j.cmd(), "--init-from") for j in train] == [[b.init_from]] * 2
    run = b.run_dir("ce")
    run.mkdir(parents=True)
    train[0].finish(0)
    assert json.loads((run / "quality-run.json").read_text())["init_from"] == b.init_from
    (run / "summary.json").write_text("{}")
    md, _ = build_summary(b)
    assert "each continued from drafter-kl15-cap-noise (`--init-from`)" in md


def test_only_the_alone_eval_compiles_when_asked(tmp_path):
    """--eval-compile 1 times the speedup with compiled kernels; the shared evals stay as they were."""
    import dataclasses

    import quality

    for flag in (0, 1):
        b = quality.Bench(str(tmp_path), None, dataclasses.replace(quality.SMOKE, eval_compile=flag), smoke=True)
        shared = b.eval_jobs("ce", sets=("chat",))
        alone = b.eval_jobs("ce", alone=True, sets=("chat",), temps=(0.0,))
        assert all("--compile" not in j.cmd for j in shared)
        assert ("--compile" in alone[0].cmd) == bool(flag)


def test_tree_evals_reach_eval_train_and_the_summary(tmp_path):
    """--eval-trees: the chat T=0 evals verify the chain and the trees, the training's estimate walks the same
    budgets, and the summary sets real tree tau and speedup next to the estimate, with issue 18's goals."""
    import dataclasses

    import quality
    from quality_summary import build_summary

    plan = dataclasses.replace(quality.SMOKE, eval_trees="16,64")
    b = quality.Bench(str(tmp_path), None, plan, smoke=True)
    jobs = {j.name: j.cmd for j in b.eval_jobs("ce")}
    t0 = next(c for n, c in jobs.items() if "chat" in n and "T0" in n)
    assert t0[t0.index("--tree-budget") + 1] == "0,16,64"
    assert all("--tree-budget" not in c for n, c in jobs.items() if not ("chat" in n and "T0" in n))
    alone = b.eval_jobs("ce", alone=True, sets=("chat",), temps=(0.0,))[0].cmd
    assert alone[alone.index("--tree-budget") + 1] == "0,16,64"
    train = b.train_args("ce", 4)
    assert train[train.index("--eval-tree-budget") + 1] == "16,64"
    # every recipe names each loss term, so `ce` stays CE alone whatever `dflash train`'s defaults are
    assert [train[train.index(f"--{k}") + 1] for k in ("kl-weight", "cap-weight", "feature-noise")] == ["0.0"] * 3
    best = b.train_args("kl15-cap-noise", 4)
    assert [best[best.index(f"--{k}") + 1] for k in ("kl-weight", "cap-weight", "feature-noise")] == ["0.15", "0.1", "0.2"]
    assert "--tree-budget" not in quality.Bench(str(tmp_path / "x"), None, quality.SMOKE, smoke=True).eval_jobs("ce")[0].cmd

    d = b.run_dir("ce")
    (d / "final").mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"step": 4, "eval": {
        "tau_chain": 2.0, "tau_tree_16": 2.6, "tau_tree_64": 3.45, "acc_per_pos": [0.7]}}))
    (d / "config.json").write_text(json.dumps({"train": {"block_size": 16, "tokens_per_batch": 1024},
                                               "store": {"url": str(b.store("regen-bf16"))}, "steps_per_epoch": 2}))
    budgets = {"0": 1.9, "16": 2.5, "64": 3.0}
    b.eval_file("ce", "chat", 0.0).write_text(json.dumps({"tau": 1.9, "lossless": True, "per_budget": {
        k: {"tau": v, "speedup": 0.5} for k, v in budgets.items()}}))
    b.eval_file("ce", "chat", 0.0, alone=True).write_text(json.dumps({"tau": 1.9, "speedup": 1.13, "per_budget": {
        "0": {"tau": 1.9, "speedup": 1.13}, "16": {"tau": 2.5, "speedup": 1.24}, "64": {"tau": 3.0, "speedup": 1.31}}}))
    b.write("recipes", {"best": "ce", "plan": {"steps": 4}})
    md, rec = build_summary(b)
    assert "## Chain and trees (chat T=0)" in md
    assert "| ce | 64 | 3.45 | 3.00 | 1.15 | 1.58 | 1.31 |" in md   # est, real (shared eval), ratios, speedup alone
    assert "| ce | chain | 2.00 | 1.90 | 1.05 | 1.00 | 1.13 |" in md
    goals = {g["goal"]: g for g in rec["goals"]}
    assert goals["tree (budget 64) tau >= 1.3x the chain's"]["met"]
    assert goals["tree (budget 64) speedup >= the chain's (alone)"]["met"]
    assert goals["held-out tau_tree_64 within 10% of real"]["value"] == pytest.approx(1.15)
    assert not goals["held-out tau_tree_64 within 10% of real"]["met"]


def test_eval_trees_option_is_checked():
    import quality

    with pytest.raises(SystemExit):
        quality.main(["plan", "--root", "/nonexistent", "--eval-trees", "0,64"])


def test_store_dir_puts_the_stores_arrays_elsewhere_and_training_reads_them_there(tmp_path, monkeypatch):
    """--store-dir (another file system, where the root's has no room for a store): extraction writes there,
    training reads there, and the stores' records stay under the root."""
    import quality

    ran: list = []
    monkeypatch.setattr(quality, "run_jobs", lambda jobs, *a, **k: ran.extend(jobs) or {})
    b = quality.Bench(str(tmp_path / "root"), None, quality.SMOKE, smoke=True)
    b.store_root = tmp_path / "shm"   # what main() sets from --store-dir (and creates)
    b.store_root.mkdir()
    b.stores = ["regen-bf16"]
    monkeypatch.setattr(quality.Bench, "source", lambda self, d: tmp_path / f"{d}.jsonl")
    quality.part_stores(b, None)
    extract = next(j for j in ran if j.name == "extract-regen-bf16")
    cmd = extract.cmd() if callable(extract.cmd) else extract.cmd
    assert _opt(cmd, "--out") == [str(tmp_path / "shm" / "regen-bf16")]
    (b.root / "stores" / "regen-bf16.json").write_text("{}")   # the record stays under the root
    b.recipes = ["ce"]
    quality.part_recipes(b, None)
    train = next(j for j in ran if j.kind == "train")
    assert _opt(train.cmd(), "--store") == [str(tmp_path / "shm" / "regen-bf16")]


def test_heldout_judge_matches_eval_records_to_their_budgets(tmp_path):
    """bench/heldout_judge.py --real: a chain record (budget 0), a one-budget tree record and a sweep's per-budget
    records each give the real tau of their own budget, so a tree estimate is never set against a chain's tau."""
    from heldout_judge import real_taus

    chain = tmp_path / "chain.json"
    chain.write_text(json.dumps({"tau": 2.05, "tree_budget": 0, "accept_rate_per_position": [0.6]}))
    tree = tmp_path / "tree64.json"
    tree.write_text(json.dumps({"tau": 3.12, "tree_budget": 64, "accept_rate_per_position": [0.7]}))
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"tau": 2.0, "tree_budget": 0, "per_budget": {
        "0": {"tau": 2.0, "accept_rate_per_position": [0.5]}, "16": {"tau": 2.6}}}))
    assert real_taus([str(chain), str(tree)]) == {0: (2.05, [0.6]), 64: (3.12, [0.7])}
    assert real_taus([str(sweep)]) == {0: (2.0, [0.5]), 16: (2.6, None)}
    assert real_taus([str(tree), str(sweep)])[64] == (3.12, [0.7])


def test_every_recipe_is_a_train_command_line_dflash_accepts(tmp_path, monkeypatch):
    """Each recipe's options parse as `dflash train`'s own (a recipe naming an option the command lacks would
    fail only on the GPU); SpecForge's differences come one at a time: its loss (ce-a64x4) and its beta2."""
    import quality
    from typer.testing import CliRunner

    from dflash_pipeline import cli

    seen = {}
    monkeypatch.setattr("dflash_pipeline.train.trainer.run_train", lambda cfg: seen.__setitem__("cfg", cfg))
    b = quality.Bench(str(tmp_path), None, quality.SMOKE, smoke=False)
    for recipe in quality.RECIPES:
        res = CliRunner().invoke(cli.app, ["train", "--store", str(tmp_path / "s"), "--out", str(tmp_path / recipe),
                                           "--device", "cpu", *b.train_args(recipe, 10)])
        assert res.exit_code == 0, (recipe, res.output)
        cfg = seen.pop("cfg")
        assert cfg.optim.steps == 10
        if recipe in ("kl15-cap-noise-a64x4-b999", "kl15-cap-noise-a64x4"):   # 0.999: the default since 2026-12-07
            assert cfg.optim.betas == (0.9, 0.999) and cfg.loss.kl_weight == 0.15
        if recipe == "kl15-cap-noise-a64x4-b95":
            assert cfg.optim.betas == (0.9, 0.95) and cfg.to_dict()["max_anchors"] == 64
        if recipe == "ce-a64x4":
            assert (cfg.loss.kl_weight, cfg.loss.cap_weight, cfg.loss.feature_noise) == (0.0, 0.0, 0.0)
            assert cfg.to_dict()["max_anchors"] == 64 and cfg.optim.betas == (0.9, 0.999)
