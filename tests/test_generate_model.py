"""`dflash generate` with the real embedded SmolLM2 (fp32, CPU), decoding on the real engine (3 rows on the
static-cache runner, refilled as replies end): every reply equals plain greedy decoding of its prompt
alone (transformers' `generate()`, batch 1), later replies answer the regenerated history, the output round-trips through
extraction with the loss mask on exactly the generated tokens, SIGKILL + re-run equals a clean run,
changed settings are refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_pipeline.errors import ConfigMismatchError, DFlashError
from dflash_pipeline.generate.pipeline import run_generate
from dflash_pipeline.schemas.generate import GenerateConfig

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.slow]

MAX_NEW = 40
MAX_LENGTH = 512

CONVERSATIONS = [
    {"conversations": [{"from": "human", "value": "What is 3 plus 4? Answer with the number only."},
                       {"from": "gpt", "value": "ORIGINAL-A: seven, I believe."},
                       {"from": "human", "value": "Now double it."},
                       {"from": "gpt", "value": "ORIGINAL-B: fourteen."}]},
    {"messages": [{"role": "system", "content": "You answer in one short sentence."},
                  {"role": "user", "content": "Name a fruit."},
                  {"role": "assistant", "content": "ORIGINAL-C: a banana."}], "id": "m1"},
    {"conversations": [{"from": "alien", "value": "hi"}]},
    {"prompt": "Say hello in French."},
    {"conversations": [{"from": "human", "value": "What color is the sky? One word."},
                       {"from": "gpt", "value": "ORIGINAL-D"},
                       {"from": "human", "value": "And grass?"}]},
    {"prompt": "Write a long, detailed essay on the history of the Roman Empire."},   # cut at MAX_NEW
]


def _cfg(out, data, **kw) -> GenerateConfig:
    base = dict(out=str(out), data=[str(data)], max_new_tokens=MAX_NEW, max_length=MAX_LENGTH,
                batch_tokens=3 * MAX_LENGTH, shard_size=2, device="cpu", quiet=True)
    base.update(kw)
    return GenerateConfig(**base)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen-data") / "chats.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in CONVERSATIONS) + "\nnot json\n")
    return path


@pytest.fixture(scope="module")
def generated(tmp_path_factory, data_file):
    out = tmp_path_factory.mktemp("gen") / "out"
    record = run_generate(_cfg(out, data_file))
    rows = [json.loads(line) for p in sorted(out.glob("shard-*.jsonl")) for line in p.read_text().splitlines()]
    return out, record, rows


def _greedy_alone(model, tokenizer, stop_ids, messages) -> list[int]:
    """Plain HF greedy decoding of one rendered prompt, batch 1: the reference."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                             eos_token_id=sorted(stop_ids), pad_token_id=sorted(stop_ids)[0])
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def references(generated, smollm_model, smollm_tokenizer):
    """For every output row and reply: (prompt messages, greedy tokens of that prompt decoded alone)."""
    from dflash_pipeline.eval.models import stop_token_ids

    stop = stop_token_ids(smollm_tokenizer, smollm_model)
    _, _, rows = generated
    refs = []
    for row in rows:
        msgs = row.get("messages") or [{"role": {"human": "user", "gpt": "assistant"}.get(t["from"], t["from"]),
                                        "content": t["value"]} for t in row["conversations"]]
        replies = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        refs.append([(msgs[:i], msgs[i]["content"], _greedy_alone(smollm_model, smollm_tokenizer, stop, msgs[:i]))
                     for i in replies])
    return stop, refs


def test_every_reply_is_plain_greedy_decoding_of_its_prompt_alone(generated, references, smollm_tokenizer):
    out, record, rows = generated
    stop, refs = references
    assert [r["dflash"]["sample_id"] for r in rows] == [0, 1, 3, 4, 5]    # the bad row and 'not json' skipped
    assert record["data_report"]["num_skipped"] == 2
    for row, row_refs in zip(rows, refs):
        for (prompt, text, ref), meta in zip(row_refs, row["dflash"]["replies"]):
            body = ref[:-1] if ref and ref[-1] in stop else ref
            assert text == smollm_tokenizer.decode(body), (prompt, text)
            assert meta["tokens"] == len(ref)
            assert meta["finish"] == ("stop" if ref[-1] in stop else "length")
    t = record["total"]
    assert t["replies"] == sum(len(r) for r in refs) == 7 and t["rows"] == 5
    assert t["finish"]["length"] == t["truncated"] == 1
    assert t["reply_tokens"] == sum(len(ref) for r in refs for _, _, ref in r)
    assert sum(t["finish"].values()) == t["replies"] and t["truncated"] == t["finish"].get("length", 0)
    assert record["shards_committed"] == record["shards_planned"] == 3


def test_multi_turn_replay_answers_the_regenerated_history(generated, references):
    _, _, rows = generated
    _, refs = references
    first = rows[0]["conversations"]
    assert [t["from"] for t in first] == ["human", "gpt", "human", "gpt"]
    assert not any("ORIGINAL" in t["value"] for t in first)
    prompt_of_second, _, _ = refs[0][1]
    assert prompt_of_second[1] == {"role": "assistant", "content": first[1]["value"]}   # the target's own reply
    last = rows[3]["conversations"]                                  # ended on a question: answered too
    assert [t["from"] for t in last] == ["human", "gpt", "human", "gpt"] and "ORIGINAL" not in json.dumps(last)
    assert rows[1]["id"] == "m1" and rows[1]["messages"][0]["role"] == "system"
    assert rows[2]["messages"][0] == {"role": "user", "content": "Say hello in French."}


def test_output_round_trips_through_extract(generated, references, tmp_path):
    """`dflash extract --data OUT`: the loss mask covers exactly the tokens the target generated (each
    reply and its stop token; a reply cut at --max-new-tokens has none, and the end of turn the template
    closes it with is not supervised), and the store says which target wrote them."""
    from dflash_pipeline.extract.pipeline import run_extract
    from dflash_pipeline.schemas.config import ExtractConfig
    from dflash_pipeline.store.reader import StoreReader
    from dflash_pipeline.store.stats import compute_stats

    out, _, rows = generated
    _, refs = references
    cfg = ExtractConfig(out=str(tmp_path / "store"), data=[str(out)], max_length=512, layers=[1, 5], topk=4,
                        tokens_per_batch=1024, tokenize_workers=1, quiet=True, device="cpu")
    run_extract(cfg)
    store = StoreReader(cfg.out)
    assert store.num_samples == len(rows)
    for i, row_refs in enumerate(refs):
        s = store.read_sample(i)
        mask = np.asarray(s.loss_mask_T, bool)
        runs = np.split(np.arange(len(mask)), np.flatnonzero(np.diff(mask.astype(int))) + 1)
        supervised = [s.tokens_T[r].tolist() for r in runs if mask[r[0]]]
        assert len(supervised) == len(row_refs)
        finishes = {meta["finish"] for meta in rows[i]["dflash"]["replies"]}
        assert finishes <= {"stop", "length"}
        for got, (_, _, ref) in zip(supervised, row_refs):
            assert got == ref   # what the target wrote: its reply and stop token, or the reply alone where cut
    finishes = [meta["finish"] for row in rows for meta in row["dflash"]["replies"]]
    assert "length" in finishes and "stop" in finishes   # both kinds of reply end were checked
    prov = store.meta.data_provenance
    assert len(prov) == 1 and prov[0]["same_target"] and prov[0]["generation"]["max_new_tokens"] == MAX_NEW
    assert "generated by this target" in __import__("dflash_pipeline.store.stats", fromlist=["x"]).provenance_text(
        compute_stats(cfg.out)["data_provenance"])


def test_rerun_completes_nothing_and_refuses_other_settings(generated, data_file):
    out, record, _ = generated
    # the record names the attention kernels that wrote the replies (the CPU's SDPA here) and --compile
    assert [(w["decode_attention"], w["compile"]) for w in record["workers"]] == [("sdpa", False)]
    again = run_generate(_cfg(out, data_file))
    assert again["shards_this_run"] == 0 and again["total"]["rows"] == 5
    with pytest.raises(ConfigMismatchError, match="temperature: the output has 0.0, this run asks for 0.5"):
        run_generate(_cfg(out, data_file, temperature=0.5))
    with pytest.raises(ConfigMismatchError, match="turns: the output has 'all', this run asks for 'first'"):
        run_generate(_cfg(out, data_file, turns="first"))


def test_two_processes_write_the_same_rows(generated, data_file, tmp_path):
    _, _, rows = generated
    out = tmp_path / "two"
    record = run_generate(_cfg(out, data_file, num_procs=2, shard_size=1, limit=2))
    assert record["processes"] == 2 and [w["shards"] for w in record["workers"]] == [1, 1]
    got = [json.loads(line) for p in sorted(out.glob("shard-*.jsonl")) for line in p.read_text().splitlines()]
    assert got == rows[:2]


def test_missing_input_fails_before_any_work(tmp_path):
    with pytest.raises(DFlashError, match="nope.jsonl"):
        run_generate(_cfg(tmp_path / "out", tmp_path / "nope.jsonl"))
    assert not (tmp_path / "out").exists()


_KILLABLE = """
import sys
from dflash_pipeline.generate.pipeline import run_generate
from dflash_pipeline.schemas.generate import GenerateConfig
run_generate(GenerateConfig(out=sys.argv[2], data=[sys.argv[3]], max_new_tokens=int(sys.argv[4]), shard_size=2,
                            max_length=int(sys.argv[5]), batch_tokens=3 * int(sys.argv[5]), device="cpu", quiet=True))
"""


def test_sigkill_then_rerun_equals_a_clean_run(generated, data_file, tmp_path):
    clean, _, _ = generated
    out = tmp_path / "killed"
    cmd = [sys.executable, "-c", _KILLABLE, str(Path(__file__).parent), str(out), str(data_file), str(MAX_NEW),
           str(MAX_LENGTH)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if list(out.glob("shard-*.jsonl")):
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    committed = len(list(out.glob("shard-*.jsonl")))
    assert 1 <= committed < 3                                        # the shards in flight are lost
    done = subprocess.run(cmd, capture_output=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    for name in ("shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"):
        assert (out / name).read_bytes() == (clean / name).read_bytes()
    assert not list(out.rglob("*.tmp"))                              # a killed write's leftovers are gone
    records = sorted((out / "runs").glob("generate-*.json"))
    assert len(records) == 1 and json.loads(records[0].read_text())["shards_this_run"] == 3 - committed
