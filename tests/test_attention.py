"""Attention masks beyond plain causal: FlexAttention block masks (packed documents, sliding
windows) against the dense boolean mask, and document masking for pretraining."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module

from lmforge.config.model import ModelConfig
from lmforge.data.batch import Batch
from lmforge.models.transformer import Transformer, attention_mask

CFG = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=100, max_seq_len=64)
DOCS = torch.tensor([[0] * 20 + [1] * 30 + [2] * 14, [0] * 64, [0] * 5 + [1] * 59])


def _blocks(model, ids, mask):
    T = ids.shape[1]
    h = model.tok_embeddings(ids)
    for block in model.blocks:
        h, _ = block(h, model.rope_cos[:T], model.rope_sin[:T], attn_mask=mask)
    return h


def _assert_same_blocks(model, ids, dense, flex) -> torch.Tensor:
    """The blocks' outputs and parameter gradients with the boolean mask and with the block mask
    agree; -> the outputs."""
    out = {}
    for name, mask in (("dense", dense), ("flex", flex)):
        model.zero_grad()
        h = _blocks(model, ids, mask)
        (h * torch.linspace(-1, 1, h.numel()).view_as(h)).sum().backward()
        out[name] = (h.detach(), [p.grad.clone() for p in model.blocks.parameters()])
    torch.testing.assert_close(out["flex"][0], out["dense"][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(out["flex"][1], out["dense"][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    return out["dense"][0]


@pytest.mark.e2e
@pytest.mark.parametrize("window,doc_ids", [(None, DOCS), (16, None), (16, DOCS)])
def test_flex_block_mask_equals_the_dense_mask_outputs_and_gradients(monkeypatch, window, doc_ids):
    """The blocks through `flex_attention` with our `BlockMask` (what CUDA runs) and through SDPA
    with the dense boolean mask (the reference) agree, forward and backward. torch refuses a
    FlexAttention backward on the CPU at its entry check only; lifting that check runs torch's
    own reference (unfused) implementation of the same operator, which is what is compared."""
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    torch.manual_seed(0)
    model = Transformer(CFG.model_copy(update={"sliding_window": window}))
    ids = torch.randint(0, CFG.vocab_size, (3, 64))
    dense = attention_mask(64, 0, doc_ids, window, "cpu")
    flex = attention_mask(64, 0, doc_ids, window, "cpu", flex=True)
    assert isinstance(dense, torch.Tensor) and isinstance(flex, flex_module.BlockMask)
    _assert_same_blocks(model, ids, dense, flex)


def test_block_mask_skips_what_no_query_sees():
    """Whole 128×128 blocks of other documents are never computed: with 4 documents of 128
    tokens each, only the 4 diagonal blocks of 16 remain."""
    doc_ids = torch.arange(4).repeat_interleave(128)[None]
    mask = attention_mask(512, 0, doc_ids, None, "cpu", flex=True)
    dense = attention_mask(512, 0, doc_ids, None, "cpu")
    assert torch.equal(mask.to_dense().bool().view(4, 4), torch.eye(4, dtype=torch.bool))
    assert mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum() == 4
    assert dense.shape == (1, 1, 512, 512)


def test_document_ids_come_from_end_of_text_tokens():
    eos = 7
    tokens = torch.tensor([[1, 2, eos, 3, eos, eos, 4, 5], [eos, 1, 2, 3, 4, 5, 6, 8]])
    batch = Batch.from_tokens(tokens, eos_id=eos)
    # each document keeps its own EOS; an empty document is just its EOS
    assert batch.doc_ids.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert batch.targets[0, :-1].tolist() == tokens[0, 1:].tolist()
    assert Batch.from_tokens(tokens).doc_ids is None


def test_a_document_packed_after_another_sees_nothing_of_it():
    """With document masking a packed document's logits are those of the document alone (RoPE
    is relative, so its offset in the row does not matter)."""
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    a, b = torch.randint(1, CFG.vocab_size, (1, 23)), torch.randint(1, CFG.vocab_size, (1, 41))
    packed = torch.cat([a, b], dim=1)
    doc_ids = torch.tensor([[0] * 23 + [1] * 41])
    with torch.no_grad():
        together = model(packed, doc_ids=doc_ids)
        torch.testing.assert_close(together[:, 23:], model(b), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(together[:, :23], model(a), rtol=1e-4, atol=1e-4)
        assert not torch.allclose(model(packed)[:, 23:], model(b), atol=1e-3)  # without: it does see a


def test_pretraining_with_document_masking_trains_on_split_rows(tiny_data, tmp_path):
    """`parameters.document_masking`: the stream's batches carry document ids cut after each
    EOS (training and held-out alike) and the trainer steps on them."""
    from conftest import tiny_run_config
    from lmforge.config.load import build_config
    from lmforge.data.prepare.prepare import prepare
    from lmforge.data.text.tokenizer import load_tokenizer
    from lmforge.distributed.dist import DistInfo
    from lmforge.resolve import resolve
    from lmforge.train.machine import process_machine
    from lmforge.train.build import build_trainer

    docs = tmp_path / "short.jsonl"  # short documents: several per 64-token sample
    docs.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(400)))
    prepare([str(docs)], str(tiny_data.tokenizer), str(tmp_path / "short"), 64, eval_fraction=0.2)
    eos = load_tokenizer(str(tiny_data.tokenizer)).eos_id
    one = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    raw = tiny_run_config(tiny_data, tmp_path / "run", train_data=str(tmp_path / "short"),
                          **{"parameters.document_masking": True, "compute.async_checkpoint": False,
                             "eval.prompts": []})
    trainer = build_trainer(resolve(build_config(raw), process_machine(one), log=lambda *_: None), one, log=lambda *_: None)
    it = iter(trainer.stream)
    batches = [next(it) for _ in range(trainer.plan.grad_accum)]
    for batch in batches + list(trainer.eval_sets[0].batches()):
        assert batch.doc_ids is not None
        ends = batch.input_ids == eos
        assert ends.any()
        # the id goes up right after each EOS, and nowhere else
        steps = batch.doc_ids[:, 1:] - batch.doc_ids[:, :-1]
        assert torch.equal(steps.bool(), ends[:, :-1])
    out = trainer.train_step(batches)
    assert torch.isfinite(out.loss) and trainer.state.step == 1


@pytest.mark.gpu
def test_compiled_flex_attention_on_cuda_matches_the_dense_mask():
    """What packed rows run on a GPU: `training_loss` takes the FlexAttention path (compiled
    flex_attention with our block mask); the reference runs the same blocks with the boolean mask."""
    torch.manual_seed(0)
    model = Transformer(CFG.model_copy(update={"sliding_window": 24})).cuda()
    ids = torch.randint(0, CFG.vocab_size, (3, 64), device="cuda")
    doc_ids = DOCS.cuda()
    targets = ids.roll(-1, 1)
    got = model.training_loss(ids, targets, doc_ids=doc_ids).ce_sum
    got.backward()
    flex_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    h = _blocks(model, ids, attention_mask(64, 0, doc_ids, 24, "cuda"))
    want = model.head_loss(h, targets)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    for a, p in zip(flex_grads, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-3, atol=1e-4)


@pytest.mark.integration
@pytest.mark.parametrize("window,doc_ids", [(None, None), (16, DOCS)])
def test_soft_capped_flex_attention_equals_the_written_out_one(monkeypatch, window, doc_ids):
    """Gemma 2's soft-capped attention: FlexAttention with the cap as its score_mod and a block
    mask, even for plain causal attention (what CUDA runs, fused), against the matmuls the CPU
    runs with the boolean mask; forward and backward (torch's reference FlexAttention on the CPU,
    as above). A small cap, so that it bends these scores."""
    from lmforge.models.transformer import flex_mask

    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    torch.manual_seed(0)
    shape = {"sliding_window": window, "attn_scale_dim": 20, "init_std": 0.1}  # scores of about one
    model = Transformer(CFG.model_copy(update=shape | {"attn_softcap": 1.0}))
    ids = torch.randint(0, CFG.vocab_size, (3, 64))
    dense = attention_mask(64, 0, doc_ids, window, "cpu")
    h = _assert_same_blocks(model, ids, dense, flex_mask(64, doc_ids, window, "cpu"))
    uncapped = Transformer(CFG.model_copy(update=shape))
    uncapped.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (_blocks(uncapped, ids, dense) - h).abs().max() > 1e-3  # the cap matters here


@pytest.mark.gpu
def test_soft_capped_attention_on_cuda_takes_flex_and_matches_the_matmuls():
    """On a GPU `training_loss` runs soft-capped attention through compiled FlexAttention (its
    score_mod), fused; the reference runs the same blocks through the written-out matmuls."""
    torch.manual_seed(0)
    model = Transformer(CFG.model_copy(update={"sliding_window": 24, "attn_softcap": 1.0, "init_std": 0.1})).cuda()
    ids = torch.randint(0, CFG.vocab_size, (3, 64), device="cuda")
    targets = ids.roll(-1, 1)
    got = model.training_loss(ids, targets).ce_sum
    got.backward()
    flex_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want = model.head_loss(_blocks(model, ids, attention_mask(64, 0, None, 24, "cuda")), targets)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    for a, p in zip(flex_grads, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-3, atol=1e-4)
