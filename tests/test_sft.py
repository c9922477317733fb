"""SFT data and attention layout, in-process: masking, packing isolation, chat template, resume."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from lmforge.config.model import ModelConfig
from lmforge.data.batch import IGNORE, Batch, StreamLayout
from lmforge.data.chat import CHAT_TEMPLATE, chat_prompt, render_chat
from lmforge.data.rows.sft import SFTStream, pack, read_examples, tokenize_example
from lmforge.data.text.tokenizer import load_tokenizer
from lmforge.models import build_model
from lmforge.models.io import write_chat_template
from lmforge.plan.layout import Layout

ROWS = [
    {"prompt": "def add(a, b):\n", "response": "    return a + b\n"},
    {"prompt": "class Stack:\n", "response": "    def push(self, x):\n        self.items.append(x)\n"},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "import?"},
                  {"role": "assistant", "content": "import os"}, {"role": "user", "content": "more"},
                  {"role": "assistant", "content": "import sys"}]},
]


@pytest.fixture(scope="module")
def tok(tiny_data):
    return load_tokenizer(tiny_data.tokenizer)


@pytest.fixture(scope="module")
def model(tok):
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=256,
                      vocab_size=512)
    torch.manual_seed(0)
    return build_model(cfg).eval()


def examples(tmp_path, tok, rows=ROWS, task="instruction_finetune"):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [tokenize_example(s, tok) for s in read_examples([str(path)], task)]


def loss_of(model, batch: Batch):
    return model.training_loss(batch.input_ids, batch.targets, doc_ids=batch.doc_ids).ce_sum


@pytest.mark.integration
def test_training_loss_is_cross_entropy_of_the_logits(tmp_path, tok, model):
    """The training forward's loss equals a plain cross-entropy of `forward`'s logits."""
    rows = pack(examples(tmp_path, tok), 256, tok.pad_id, seed=3)
    batch = rows.batch([0])
    logits = model(batch.input_ids, doc_ids=batch.doc_ids)
    expected = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE, reduction="sum")
    torch.testing.assert_close(loss_of(model, batch), expected)


@pytest.mark.e2e
def test_prompt_tokens_are_masked(tmp_path, tok, model):
    ex = examples(tmp_path, tok)
    ids, trained = ex[0]
    prompt_len = len(tok.encode(ROWS[0]["prompt"]))
    assert trained == [False] * prompt_len + [True] * (len(ids) - prompt_len)
    assert ids[-1] == tok.eos_id  # the answer ends with eos, and eos is learned
    rows = pack([ex[0]], 64, tok.pad_id)
    batch = rows.batch([0])
    base = loss_of(model, batch)
    assert int(batch.num_targets()) == len(ids) - prompt_len

    def with_target(pos: int, new: int):
        tokens = batch.input_ids.clone()
        tokens[0, pos] = new  # the *target* stream only: inputs stay as they are
        return Batch(batch.input_ids, Batch.from_masked(tokens, rows.trained[[0]], None).targets, batch.doc_ids)

    # Changing a prompt token's target changes nothing; changing a response token's target does.
    for pos in range(1, prompt_len):
        assert torch.equal(loss_of(model, with_target(pos, (int(ids[pos]) + 7) % 512)), base)
    assert not torch.equal(loss_of(model, with_target(prompt_len + 1, (int(ids[prompt_len + 1]) + 7) % 512)), base)


@pytest.mark.integration
def test_packed_examples_do_not_attend_across(tmp_path, tok, model):
    ex = examples(tmp_path, tok)
    rows = pack(ex, 256, tok.pad_id, seed=3)
    assert len(rows) == 1 and rows.examples == 3  # all three share one row
    batch = rows.batch([0])
    docs = batch.doc_ids[0]
    with torch.no_grad():
        packed = model(batch.input_ids, doc_ids=batch.doc_ids)[0]
        leaky = model(batch.input_ids)[0]  # plain causal attention over the whole row
    for d in range(3):
        where = (docs == d).nonzero().flatten()
        alone = model(batch.input_ids[:, where])[0].detach()
        torch.testing.assert_close(packed[where], alone, atol=2e-5, rtol=1e-4)
        if d > 0:  # the test can fail: without doc ids later examples see earlier ones
            assert not torch.allclose(leaky[where], alone, atol=1e-3)
    # padding is never trained on, and no target crosses into the next example: the last
    # position of each example predicts nothing (targets are shifted: position t predicts t+1)
    targets = batch.targets[0]
    ends = [int((docs == d).nonzero()[-1]) for d in range(3)]
    assert all(targets[e] == IGNORE for e in ends)
    assert (targets[docs == 3] == IGNORE).all()


def test_no_packing_one_example_per_row(tmp_path, tok):
    rows = pack(examples(tmp_path, tok), 128, tok.pad_id, packing=False)
    assert len(rows) == 3 and rows.doc_ids.max() == 1  # each row: the example, then padding


def test_long_examples_are_cut_or_dropped(tmp_path, tok):
    rows = [{"prompt": "x " * 40, "response": "y"}, {"prompt": "a", "response": "b " * 40}]
    packed = pack(examples(tmp_path, tok, rows), 16, tok.pad_id)
    assert (packed.dropped, packed.truncated, packed.examples) == (1, 2, 1)


def test_chat_template_matches_transformers(tmp_path, tok):
    import transformers
    import shutil

    folder = tmp_path / "tok"
    shutil.copytree(tok.path, folder)
    write_chat_template(folder, CHAT_TEMPLATE)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    msgs = ROWS[2]["messages"]
    ours = "".join(text + (tok.eos_token if trained else "") for text, trained in render_chat(msgs))
    assert hf.apply_chat_template(msgs, tokenize=False) == ours
    assert hf.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True) == \
        render_chat(msgs[:1])[0][0] + chat_prompt("import?")
    assert CHAT_TEMPLATE in (folder / "tokenizer_config.json").read_text().replace("\\n", "\n")


def test_chat_completion_wraps_prompt_response(tmp_path, tok):
    (segs,) = read_examples([str(_write(tmp_path, [ROWS[0]]))], "chat_completion")
    assert segs == render_chat([{"role": "user", "content": ROWS[0]["prompt"]},
                                {"role": "assistant", "content": ROWS[0]["response"]}])


def _write(tmp_path, rows):
    p = tmp_path / "rows.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_stream_resumes_exactly_and_partitions_ranks(tmp_path, tok):
    ex = examples(tmp_path, tok, ROWS * 8)
    rows = pack(ex, 32, tok.pad_id)
    def reading(rank: int, ranks: int) -> StreamLayout:
        return StreamLayout(seq_len=rows.tokens.shape[1], layout=Layout(ranks=ranks, global_batch=8, micro_batch=2),
                            rank=rank, seed=5)

    a = SFTStream(rows, reading(0, 1))
    it = iter(a)
    seen = [next(it).input_ids for _ in range(4 * 3)]  # 3 steps of 4 micro-batches
    b = SFTStream(rows, reading(0, 1))
    b.load_state_dict(json.loads(json.dumps(SFTStream(rows, reading(0, 1)).state_dict())))
    state = a.state_dict()
    assert state["steps"] == 3
    b.load_state_dict(state)
    torch.testing.assert_close(next(iter(b)).input_ids, next(it).input_ids)
    # two ranks together see what one rank sees, per step
    r0, r1 = (iter(SFTStream(rows, reading(r, 2))) for r in (0, 1))
    two = [next(r0).input_ids, next(r0).input_ids, next(r1).input_ids, next(r1).input_ids]
    torch.testing.assert_close(torch.cat(two), torch.cat(seen[:4]))


def test_prompt_response_rows_start_with_one_bos(tmp_path, tiny_data):
    """Tokenizers whose post-processor adds BOS — with add_bos_token (Mistral/Gemma style) or without
    (Llama 3 style): a prompt/response row is what transformers makes of its whole text, one BOS
    first, then the eos lmforge appends to the response."""
    import shutil

    import transformers
    from lmforge.data.text.tokenizer import train_tokenizer

    mistral, llama3 = tmp_path / "mistral", tmp_path / "llama3"
    train_tokenizer([str(tiny_data.raw / "textwrap.py.txt")], 300, str(mistral), add_bos=True)
    shutil.copytree(mistral, llama3)
    config = json.loads((llama3 / "tokenizer_config.json").read_text())
    (llama3 / "tokenizer_config.json").write_text(json.dumps(config | {"add_bos_token": False}))
    row = {"prompt": "Question: what does wrap(text) return?", "response": " a list of lines"}
    for folder in (mistral, llama3):
        tok = load_tokenizer(str(folder))
        ((ids, trained),) = examples(tmp_path, tok, rows=[row])
        hf = transformers.AutoTokenizer.from_pretrained(folder)
        whole = hf(row["prompt"] + row["response"])["input_ids"]
        assert whole.count(hf.bos_token_id) == 1, folder
        assert ids == whole + [tok.eos_id], (folder, ids, whole)
        prompt_len = len(hf(row["prompt"])["input_ids"])
        assert trained == [False] * prompt_len + [True] * (len(ids) - prompt_len)
