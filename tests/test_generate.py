"""`dflash generate` without a model: reply slots and replay, per-row sampling, the continuous-batching
loop on a scripted row runner, shards and their counts, the option parser, the run file's refusals."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from dflash_pipeline.generate.conversations import Conversation, NoPrompt, Replay, Reply, reply_slots
from dflash_pipeline.generate.engine import Engine, Finished, Request
from dflash_pipeline.generate.sampling import row_seed, sample_rows, uniform
from dflash_pipeline.schemas.chat_template import parse_chat_template_kwargs, unused_template_kwargs
from dflash_pipeline.schemas.generate import GenerateConfig, expand_generated_inputs, output_diff


def _m(role, content):
    return {"role": role, "content": content}


# ---------------------------------------------------------------- reply slots and replay


def test_reply_slots_cut_a_conversation_at_each_run_of_assistant_turns():
    msgs = [_m("system", "S"), _m("user", "u1"), _m("assistant", "a1"), _m("assistant", "a1b"),
            _m("user", "u2"), _m("tool", "t"), _m("assistant", "a2"), _m("user", "u3")]
    slots = reply_slots(msgs, "all")
    assert slots == [[_m("system", "S"), _m("user", "u1")], [_m("user", "u2"), _m("tool", "t")], [_m("user", "u3")]]
    assert reply_slots(msgs, "first") == slots[:1]
    assert reply_slots([_m("user", "q")], "all") == [[_m("user", "q")]]          # a prompt-only record
    assert reply_slots([_m("user", "q"), _m("assistant", "a"), _m("system", "s")], "all") == [[_m("user", "q")]]
    for bad in ([_m("assistant", "hi"), _m("user", "q")], [_m("system", "s"), _m("assistant", "a")]):
        with pytest.raises(NoPrompt):
            reply_slots(bad, "all")


def _conv(msgs, form="conversations", record_id=None):
    return Conversation("f.jsonl", 3, 41, form, msgs, record_id)


def test_replay_answers_each_slot_given_the_regenerated_replies():
    conv = _conv([_m("user", "u1"), _m("assistant", "ORIGINAL 1"), _m("user", "u2"), _m("assistant", "ORIGINAL 2")])
    r = Replay.start(conv, "all")
    assert r.history() == [_m("user", "u1")]
    r.add(Reply("new 1", 4, "stop"))
    assert r.history() == [_m("user", "u1"), _m("assistant", "new 1"), _m("user", "u2")]
    r.add(Reply("new 2", 3, "stop"))
    assert r.done and r.ended is None
    row = r.output_row()
    assert row["conversations"] == [{"from": "human", "value": "u1"}, {"from": "gpt", "value": "new 1"},
                                    {"from": "human", "value": "u2"}, {"from": "gpt", "value": "new 2"}]
    assert row["dflash"] == {"sample_id": 41, "source": "f.jsonl:3",
                             "replies": [{"tokens": 4, "finish": "stop"}, {"tokens": 3, "finish": "stop"}]}
    assert "ORIGINAL" not in json.dumps(row)


def test_tool_definitions_and_tool_turns_survive_regeneration(tmp_path):
    """A record's `tools` reach every prompt and the output row, a tool turn keeps its call id and name,
    and the row reads back through extraction's readers as the same tools and tool turn."""
    from dflash_pipeline.extract.readers import record_messages, record_tools
    from dflash_pipeline.generate.conversations import conversation_from_json, conversation_to_json, iter_conversations

    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    record = {"id": "r1", "tools": tools, "messages": [
        _m("user", "weather in Oslo?"), {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "-3C", "tool_call_id": "c1", "name": "weather"}]}
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps(record) + "\n")
    conv, = iter_conversations([str(path)])
    assert conv.tools == tools and conversation_from_json(conversation_to_json(conv)) == conv
    seen = []
    r = Replay.start(conv, "all")   # the original call is regenerated; the tool result is answered too
    while not r.done:
        seen.append(r.history())
        r.add(Reply(f"reply {r.turn}", 3, "stop"))
    assert seen[1][-1] == {"role": "tool", "content": "-3C", "tool_call_id": "c1", "name": "weather"}
    row = r.output_row()
    assert row["tools"] == tools and record_tools(row) == tools
    assert [m["role"] for m in record_messages(row)] == ["user", "assistant", "tool", "assistant"]
    assert record_messages(row)[2] == {"role": "tool", "content": "-3C", "tool_call_id": "c1", "name": "weather"}


def test_replay_ends_at_a_truncated_or_empty_reply():
    msgs = [_m("user", "u1"), _m("assistant", "a"), _m("user", "u2"), _m("assistant", "b")]
    r = Replay.start(_conv(msgs, "messages", record_id="x7"), "all")
    r.add(Reply("cut off", 9, "length"))
    assert r.done and r.ended == "length"
    row = r.output_row()
    assert row["messages"] == [_m("user", "u1"), _m("assistant", "cut off")] and row["id"] == "x7"
    r = Replay.start(_conv(msgs), "all")
    r.add(Reply("first", 2, "stop"))
    r.add(Reply(" \n", 1, "stop"))   # empty: dropped with the turn it answered
    assert r.done and r.ended == "empty" and len(r.output_row()["conversations"]) == 2
    r = Replay.start(_conv([_m("user", "q")], "prompt"), "all")
    r.add(Reply("", 1, "stop"))
    assert r.done and r.output_row() is None


# ---------------------------------------------------------------- sampling


def test_sampling_draws_from_softmax_over_the_allowed_tokens():
    V, N = 12, 30000
    logits_V = torch.randn(V, generator=torch.Generator().manual_seed(1)) * 2
    logits_NV = logits_V.expand(N, V)
    seed_N = torch.tensor([row_seed(5, i, 0) for i in range(N)])
    zero_N = torch.zeros(N, dtype=torch.long)
    for T, k, p in ((0.7, 0, 1.0), (1.0, 4, 1.0), (1.3, 0, 0.6), (1.0, 5, 0.5)):
        tokens = sample_rows(logits_NV, seed_N, zero_N, temperature=T, top_k=k, top_p=p)
        # Reference: the allowed set by sorting, then softmax over it.
        order = torch.argsort(logits_V, descending=True)
        allowed = order[:k] if k else order
        probs = torch.softmax(logits_V[allowed] / T, -1)
        keep = (probs.cumsum(0) - probs) < p
        allowed, probs = allowed[keep], probs[keep] / probs[keep].sum()
        counts = torch.bincount(tokens, minlength=V).double()
        assert counts[[t for t in range(V) if t not in allowed.tolist()]].sum() == 0
        expected = torch.zeros(V, dtype=torch.double)
        expected[allowed] = probs.double() * N
        se = (expected * (1 - expected / N)).sqrt().clamp_min(1.0)
        assert torch.all((counts - expected).abs() <= 5 * se), (T, k, p, counts, expected)
    assert torch.equal(sample_rows(logits_NV[:3], seed_N[:3], zero_N[:3], temperature=0.0),
                       logits_V.argmax().expand(3))


def test_a_rows_sample_depends_on_its_seed_and_counter_only():
    V = 1000
    g = torch.Generator().manual_seed(0)
    logits_RV = torch.randn(6, V, generator=g)
    seed_R = torch.tensor([row_seed(0, i, t) for i, t in [(1, 0), (1, 1), (2, 0), (3, 0), (4, 2), (5, 0)]])
    counter_R = torch.tensor([0, 0, 7, 3, 1, 0])
    full = sample_rows(logits_RV, seed_R, counter_R, temperature=1.0, top_k=50)
    for perm in ([5, 4, 3, 2, 1, 0], [2, 3]):
        part = sample_rows(logits_RV[perm], seed_R[perm], counter_R[perm], temperature=1.0, top_k=50)
        assert torch.equal(part, full[perm])
    u = uniform(seed_R, counter_R, torch.arange(V).expand(6, V))
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert len({tuple(x) for x in (u[:, :8] * 1e6).long().tolist()}) == 6   # distinct streams per row


# ---------------------------------------------------------------- the loop on a scripted runner


class ScriptedRows:
    """A row runner whose 'model' continues a prompt with (last token + 1) mod V; checks capacity."""

    def __init__(self, num_rows, capacity, V=16):
        self.num_rows, self.capacity, self.V = num_rows, capacity, V
        self.device = torch.device("cpu")
        self.lengths = [0] * num_rows
        self.max_length_seen = 0

    def _logits(self, last):
        out = torch.full((self.V,), -5.0)
        out[(int(last) + 1) % self.V] = 5.0
        return out

    def reset_row(self, row):
        self.lengths[row] = 0

    def prefill_rows(self, rows, prompts):
        for row, ids_P in zip(rows, prompts):
            self.lengths[row] = len(ids_P)
        return torch.stack([self._logits(ids_P[-1]) for ids_P in prompts])

    def step(self, tokens_R):
        for r in range(self.num_rows):
            assert self.lengths[r] < self.capacity, f"row {r} stepped past its capacity"
            self.lengths[r] += 1
            self.max_length_seen = max(self.max_length_seen, self.lengths[r])
        return torch.stack([self._logits(t) for t in tokens_R])


class ListSource:
    """Requests from a list; a request whose key is ('chain', n) is followed by ('chain', n - 1)."""

    def __init__(self, requests):
        self.todo = list(requests)
        self.done: list[Finished] = []

    def next_request(self):
        return self.todo.pop(0) if self.todo else None

    def finished(self, done):
        self.done.append(done)
        kind, n = done.request.key
        if kind == "chain" and n > 0:
            self.todo.insert(0, Request(("chain", n - 1), done.tokens[-2:], 0, 3, "length"))

    def exhausted(self):
        return not self.todo


def test_engine_refills_rows_and_stops_each_reply_where_plain_decoding_would():
    V, stop = 16, 0
    reqs = [Request(("one", i), [1, 2, p], 0, m, "length" if m < 8 else "context")
            for i, (p, m) in enumerate([(3, 20 - 3), (9, 3), (14, 5), (5, 12), (15, 4), (2, 1)])]
    reqs.append(Request(("chain", 3), [7], 0, 4, "length"))
    rows = ScriptedRows(num_rows=3, capacity=20, V=V)
    source = ListSource(reqs)
    stats = Engine(rows, stop_ids=[stop]).run(source)
    got = {d.request.key: (d.tokens, d.finish) for d in source.done}
    for req in reqs:
        expected, t = [], req.prompt[-1]
        while len(expected) < req.max_tokens:
            t = (t + 1) % V
            expected.append(t)
            if t == stop:
                break
        finish = "stop" if expected[-1] == stop else req.limit_reason
        assert got[req.key] == (expected, finish), req
    assert sum(k[0] == "chain" for k in got) == 4       # follow-ups ran after their predecessor
    assert stats.replies == len(got) and stats.tokens == sum(len(t) for t, _ in got.values())
    assert rows.max_length_seen <= rows.capacity


def test_idle_rows_never_fill_their_capacity():
    rows = ScriptedRows(num_rows=4, capacity=6, V=64)
    source = ListSource([Request(("chain", 12), [1], 0, 5, "length")])   # 13 replies, one after the other
    Engine(rows, stop_ids=[]).run(source)
    assert len(source.done) == 13 and rows.max_length_seen <= 6


def test_sampled_replies_do_not_depend_on_the_number_of_rows():
    class Noisy(ScriptedRows):
        def _logits(self, last):
            return torch.randn(self.V, generator=torch.Generator().manual_seed(int(last)))

    def run(num_rows):
        reqs = [Request(("one", i), [i, i + 1], row_seed(3, i, 0), 8, "length") for i in range(7)]
        source = ListSource(reqs)
        Engine(Noisy(num_rows, 16, V=32), stop_ids=[31], temperature=0.9, top_p=0.95).run(source)
        return {d.request.key: d.tokens for d in source.done}

    one = run(1)
    assert run(3) == one and run(7) == one
    assert len({tuple(t) for t in one.values()}) > 3


def test_a_request_that_does_not_fit_a_row_is_refused():
    source = ListSource([Request(("one", 0), [1] * 8, 0, 3, "length")])
    with pytest.raises(ValueError, match="does not fit"):
        Engine(ScriptedRows(1, 10), stop_ids=[]).run(source)


# ---------------------------------------------------------------- options, run file, provenance


def test_chat_template_kwargs_parser():
    assert parse_chat_template_kwargs(None) == {} and parse_chat_template_kwargs("") == {}
    assert parse_chat_template_kwargs('{"enable_thinking": false}') == {"enable_thinking": False}
    for text, needle in (("[1]", "JSON object"), ("{oops", "JSON object"), ('{"tokenize": true}', "tokenize"),
                         ('{"a b": 1}', "not a template variable")):
        with pytest.raises(ValueError, match=needle):
            parse_chat_template_kwargs(text)

    class Tok:
        chat_template = "{% if enable_thinking %}x{% endif %}{{ messages }}"

    assert unused_template_kwargs(Tok(), {"enable_thinking": True, "enable_thinkin": False}) == ["enable_thinkin"]


def test_generate_config_validation_and_output_diff():
    with pytest.raises(ValueError, match="--top-p"):
        GenerateConfig(out="o", top_p=0.0)
    with pytest.raises(ValueError, match="--turns"):
        GenerateConfig(out="o", turns="last")
    a = GenerateConfig(out="o", temperature=0.7, chat_template_kwargs='{"enable_thinking": false}')
    b = GenerateConfig(out="elsewhere", temperature=0.7, gpus="2", batch_tokens=1000,
                       chat_template_kwargs={"enable_thinking": False})
    assert output_diff(a.output_settings(), b.output_settings()) == []       # runtime settings may change
    c = GenerateConfig(out="o", temperature=0.5)
    diff = output_diff(a.output_settings(), c.output_settings())
    assert any(d.startswith("temperature: the output has 0.7, this run asks for 0.5") for d in diff)
    assert any(d.startswith("chat_template_kwargs") for d in diff)


def planned_output(folder):
    """A generate output folder planned with two shards of one conversation each, none committed yet."""
    from dflash_pipeline.generate.output import OutputFolder

    run = {"target": {"name_or_path": "t", "config_hash": "c" * 64, "tokenizer_hash": "t" * 64,
                      "chat_template_hash": "", "architecture": ""},
           "settings": GenerateConfig(out="o").output_settings(), "shards": [{"shard": 0}, {"shard": 1}]}
    conv = Conversation("f", 1, 0, "prompt", [_m("user", "q")])
    out = OutputFolder(folder)
    out.write_plan([[conv], [conv]], run)
    return out


def test_unfinished_generate_output_is_refused_as_input(tmp_path):
    out = planned_output(tmp_path / "gen")
    out.commit_shard(0, [{"messages": [_m("user", "q"), _m("assistant", "a")]}], {"rows": 1}, "jsonl")
    with pytest.raises(ValueError, match=r"not finished \(1 of 2 shards missing, e.g. shard-00001.jsonl\)"):
        expand_generated_inputs([str(tmp_path / "gen")])
    out.commit_shard(1, [{"messages": [_m("user", "q"), _m("assistant", "b")]}], {"rows": 1}, "jsonl")
    files, prov = expand_generated_inputs([str(tmp_path / "gen"), "other.jsonl"])
    assert [f.rsplit("/", 1)[-1] for f in files] == ["shard-00000.jsonl", "shard-00001.jsonl", "other.jsonl"]
    assert len(prov) == 1 and prov[0]["generated_by"]["config_hash"] == "c" * 64
    files, prov = expand_generated_inputs([str(tmp_path / "gen" / "shard-00001.jsonl")])   # a shard alone
    assert len(prov) == 1 and prov[0]["generation"]["turns"] == "all"


def test_parquet_shards_read_back_as_conversations(tmp_path):
    from dflash_pipeline.generate.conversations import iter_conversations
    from dflash_pipeline.generate.output import OutputFolder

    conv = _conv([_m("user", "u1"), _m("assistant", "x")], "conversations", record_id=12)
    r1 = Replay.start(conv, "all")
    r1.add(Reply("hello", 2, "stop"))
    r2 = Replay.start(_conv([_m("system", "s"), _m("user", "q")], "prompt"), "all")
    r2.add(Reply("there", 3, "length"))
    out = OutputFolder(tmp_path)
    out.commit_shard(0, [r1.output_row(), r2.output_row()], {"rows": 2}, "parquet")
    back = list(iter_conversations([str(tmp_path / "shard-00000.parquet")]))
    assert [c.messages for c in back] == [r1.messages(), r2.messages()]
    assert [c.form for c in back] == ["conversations", "messages"]


@pytest.mark.parametrize("args, needle", [
    (["--top-p", "2"], "--top-p must be in (0, 1]"),
    (["--turns", "last"], "--turns must be 'all' or 'first'"),
    (["--chat-template-kwargs", "[1]"], "--chat-template-kwargs must be a JSON object"),
    (["--format", "csv"], "--format must be one of jsonl, parquet"),
    (["--data", "nowhere.jsonl"], "nowhere.jsonl: no such file"),
])
def test_bad_generate_options_are_one_line(tmp_path, args, needle):
    from typer.testing import CliRunner

    from dflash_pipeline.cli import app

    res = CliRunner().invoke(app, ["generate", "--out", str(tmp_path / "o"), *args])
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and needle in lines[0], res.stderr
    assert not (tmp_path / "o").exists()


def test_rows_are_computed_from_the_shapes_and_free_memory():
    from transformers import Qwen3Config

    from dflash_pipeline.errors import DFlashError
    from dflash_pipeline.generate.rows import GIB, plan_rows

    cfg = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936)
    b = plan_rows(cfg, torch.bfloat16, 4096, 120 * GIB)
    assert b.kv_bytes_per_token == 36 * 2 * 8 * 128 * 2 + 8               # K and V of every layer, the slot's position
    used = lambda r: r * 4096 * b.kv_bytes_per_token + r * (b.step_bytes // b.rows) + b.prefill_bytes + b.margin_bytes  # noqa: E731
    assert used(b.rows) <= 120 * GIB < used(b.rows + 1)          # as many as fit, and no more
    assert 100 < b.rows < 200
    assert plan_rows(cfg, torch.bfloat16, 4096, 120 * GIB, max_rows=64).rows == 64
    assert plan_rows(cfg, torch.bfloat16, 4096, 120 * GIB, batch_tokens=4096 * 10).rows == 10
    with pytest.raises(DFlashError, match=r"--batch-tokens 4096000 \(1000 sequences of 4096 tokens\) needs .* at most"):
        plan_rows(cfg, torch.bfloat16, 4096, 120 * GIB, batch_tokens=4096 * 1000)
    with pytest.raises(DFlashError, match="not even one sequence"):
        plan_rows(cfg, torch.bfloat16, 4096, 2 * GIB)


def test_extract_masks_with_the_template_kwargs_the_replies_were_generated_with():
    """A generate output rendered with thinking off is masked with thinking off unless told otherwise;
    a different value, or inputs generated under different values, are refused in one line."""
    from dflash_pipeline.errors import DFlashError
    from dflash_pipeline.extract.pipeline import _template_kwargs

    class Line:
        said: list[str] = []

        def say(self, text):
            self.said.append(text)

    def prov(folder, kwargs):
        return {"folder": folder, "generation": {"chat_template_kwargs": kwargs}, "generated_by": {}}

    off = {"enable_thinking": False}
    line = Line()
    assert _template_kwargs({}, [], line) == {}
    assert _template_kwargs(off, [], line) == off                    # plain files: the option as given
    assert _template_kwargs({}, [prov("g", off)], line) == off       # adopted from the generate run
    assert "as g was generated" in line.said[-1]
    assert _template_kwargs(off, [prov("g", off)], line) == off
    with pytest.raises(DFlashError, match="differs from the .* that g was generated with"):
        _template_kwargs({"enable_thinking": True}, [prov("g", off)], line)
    with pytest.raises(DFlashError, match="rendered with different --chat-template-kwargs"):
        _template_kwargs({}, [prov("g", off), prov("h", {})], line)


def test_a_target_whose_replies_are_all_empty_stops_generate_and_extract_in_one_line(tmp_path, smollm_dir):
    """A random tiny target that emits only special tokens: every reply decodes to no text. Generate keeps its
    records and says so with a non-zero exit; extract refuses the output in one line (it used to fail on an
    empty shard file as 'not a known data format'). A shard emptied this way next to kept ones is skipped."""
    from typer.testing import CliRunner

    from dflash_pipeline.cli import app
    from helpers import make_tiny_target, write_conversations

    target = make_tiny_target(tmp_path / "target", smollm_dir)
    data = write_conversations(tmp_path / "conv.jsonl", n=6)
    gen = tmp_path / "gen"
    res = CliRunner().invoke(app, ["generate", "--data", str(data), "--target", str(target), "--out", str(gen),
                                   "--max-new-tokens", "4", "--device", "cpu", "--quiet"])
    lines = [l for l in res.stderr.splitlines() if l.strip() and "Loading weights" not in l]  # transformers' bar
    assert res.exit_code != 0 and len(lines) == 1 and "no conversation kept: all 6 were dropped (empty: 6)" in lines[0]
    assert list((gen / "runs").glob("generate-*.json"))  # the run record was written first
    with pytest.raises(ValueError, match="kept no conversation"):
        expand_generated_inputs([str(gen)])
    res = CliRunner().invoke(app, ["extract", "--data", str(gen), "--target", str(target), "--out",
                                   str(tmp_path / "store"), "--device", "cpu", "--quiet"])
    lines = [l for l in res.stderr.splitlines() if l.strip() and "Loading weights" not in l]
    assert res.exit_code != 0 and len(lines) == 1 and "kept no conversation" in lines[0], res.stderr

    out = planned_output(tmp_path / "mixed")
    out.commit_shard(0, [], {"rows": 0}, "jsonl")
    out.commit_shard(1, [{"messages": [_m("user", "q"), _m("assistant", "b")]}], {"rows": 1}, "jsonl")
    files, _ = expand_generated_inputs([str(tmp_path / "mixed")])
    assert [f.rsplit("/", 1)[-1] for f in files] == ["shard-00001.jsonl"]
