"""The method's rules (dflash_pipeline.method) beyond what test_model checks against the reference:
the mask token's last fallback on a real tokenizer, the gamma table as users read it, and the label /
teacher alignment as the training step applies it."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from dflash_pipeline.method import (
    GAMMA_BY_BLOCK_SIZE, choose_mask_token_id, gamma_table_text, label_index, position_decay, teacher_index,
)


class _Tok:
    """A tokenizer whose vocabulary fills the embedding table, with added special tokens."""

    def __init__(self, n, added, template="", eos=None):
        self.n, self.mask_token_id, self.chat_template = n, None, template
        self.bos_token_id = self.pad_token_id = self.unk_token_id = None
        self.eos_token_id = eos
        self.added_tokens_decoder = {tid: SimpleNamespace(content=c, special=s) for tid, (c, s) in added.items()}

    def __len__(self):
        return self.n


def test_full_vocabulary_falls_back_to_an_unused_special_token():
    tok = _Tok(100, {90: ("<a>", True), 95: ("<im_start>", True), 97: ("<eos>", True), 98: ("word", False)},
               template="{{ '<im_start>' }}", eos=97)
    # 98 is not special, 97 is eos, 95 is written by the chat template: 90 is the last one left
    assert choose_mask_token_id(None, tok, 100) == 90
    assert choose_mask_token_id(42, tok, 100) == 42


def test_configured_mask_token_outside_the_table_is_refused_even_with_a_fallback():
    """A user's explicit id is never silently replaced by the fallback."""
    tok = _Tok(100, {90: ("<a>", True)})
    with pytest.raises(ValueError, match="mask_token_id 100 is outside"):
        choose_mask_token_id(100, tok, 100)


def test_smollm2_mask_token_is_a_special_token_its_template_never_writes(smollm_tokenizer):
    tok = smollm_tokenizer
    mask = choose_mask_token_id(None, tok, len(tok))
    added = tok.added_tokens_decoder[mask]
    assert mask == 16 and added.special and added.content not in str(tok.chat_template)
    assert mask not in (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id)


def test_gamma_table_text_is_what_users_read():
    assert gamma_table_text() == "7 for 16, 5 for 10, 4 for 8"
    assert GAMMA_BY_BLOCK_SIZE[16] == 7.0
    from dflash_pipeline.schemas.config import TrainConfig

    with pytest.raises(ValueError, match=r"\(7 for 16, 5 for 10, 4 for 8\); pass --gamma"):
        TrainConfig(store="s", out="o", block_size=12)


def test_label_and_teacher_rows_and_decay():
    anchor, slots = torch.tensor([[5]]), torch.arange(4)
    assert label_index(anchor, slots).tolist() == [[5, 6, 7, 8]]          # slot k predicts anchor + k
    assert teacher_index(label_index(anchor, slots)).tolist() == [[4, 5, 6, 7]]  # computed one before
    assert position_decay(slots, 7.0).tolist() == pytest.approx([math.exp(1 / 7), 1.0, math.exp(-1 / 7),
                                                                 math.exp(-2 / 7)])


def test_step_teacher_rows_follow_the_rule():
    """stage_blocks' teacher row of every labelled slot is its label's row minus one (flat over rows)."""
    from dflash_pipeline.train.blocks import build_blocks
    from dflash_pipeline.train.batch import Batch
    from dflash_pipeline.train.step import stage_blocks

    R, S, B = 2, 24, 4
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50, (R, S), generator=g)
    pos = torch.arange(S).expand(R, S).clone()
    doc = torch.zeros(R, S, dtype=torch.long)
    mask = torch.ones(R, S, dtype=torch.bool)
    batch = Batch(tokens, mask, pos, doc, torch.zeros(R, S, 3), torch.zeros(R, S, 2, dtype=torch.long),
                  torch.zeros(R, S, 2), R * S)
    anchors = torch.tensor([[0, 7, 21], [3, 9, -1]])
    st = stage_blocks(batch, anchors, block_size=B, mask_token_id=60, gamma=4.0, layer_kinds=[(False, None)],
                      device=torch.device("cpu"))
    blocks = build_blocks(tokens, pos, doc, mask, anchors, block_size=B, mask_token_id=60, gamma=4.0)
    flat_label = (torch.arange(R)[:, None] * S + blocks.label_index_RQ).reshape(-1)[st.sel_N]
    assert torch.equal(st.teacher_N, flat_label - 1)
    assert torch.equal(st.labels_N, tokens.reshape(-1)[flat_label])
