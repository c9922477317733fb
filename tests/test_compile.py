"""Compilation: what `compute.compile` turns on, and that the compiled units trace without graph
breaks (a break silently splits a unit into several graphs and slows the GPU down; here it
fails CI instead). `torch._dynamo.explain` traces with dynamo only — no inductor, no C++ build."""

from __future__ import annotations

import pytest
import torch

from lmforge.config.model import ModelConfig
from lmforge.config.schema import ComputeConfig
from lmforge.distributed.dist import DistInfo
from lmforge.distributed.parallelize import compile_enabled, parallelize
from lmforge.plan.layout import Layout
from lmforge.models.transformer import Transformer, attention_mask

CFG = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=100, max_seq_len=64)


@pytest.fixture
def model():
    torch.manual_seed(0)
    return Transformer(CFG)


def _explain(fn, *args):
    torch._dynamo.reset()
    out = torch._dynamo.explain(fn)(*args)
    return out.graph_count, out.graph_break_count, [r.reason for r in out.break_reasons]


@pytest.mark.integration
def test_a_dense_block_traces_as_one_graph(model):
    ids = torch.randint(0, CFG.vocab_size, (2, 32))
    h = model.tok_embeddings(ids)
    assert _explain(model.blocks[0], h, model.rope_cos[:32], model.rope_sin[:32]) == (1, 0, [])


@pytest.mark.integration  # dynamo traces it: the first trace in a process pays dynamo's start-up
def test_the_norm_head_and_loss_trace_as_one_graph(model):
    """The chunked loss is an autograd.Function with a Python loop over chunks: dynamo unrolls it."""
    ids = torch.randint(0, CFG.vocab_size, (2, 32))
    targets = torch.randint(0, CFG.vocab_size, (2, 32))
    h = model.tok_embeddings(ids)  # requires grad: the training path, gradients computed in forward
    assert _explain(model.head_loss, h, targets) == (1, 0, [])


@pytest.mark.integration  # dynamo traces it: the first trace in a process pays dynamo's start-up
def test_the_per_token_head_of_preference_tuning_traces_as_one_graph(model):
    """Preference losses need each target's log-probability: `head_logprobs` (norm, head, chunked
    log-softmax with its recomputing backward) is one compiled unit too, not an eager tail."""
    ids = torch.randint(0, CFG.vocab_size, (2, 32))
    targets = torch.randint(0, CFG.vocab_size, (2, 32))
    targets[:, :5] = -100  # the prompt: not scored
    h = model.tok_embeddings(ids)
    assert _explain(model.head_logprobs, h, targets) == (1, 0, [])


@pytest.mark.integration  # dynamo traces it: the first trace in a process pays dynamo's start-up
def test_a_block_with_a_document_block_mask_traces_as_one_graph(model):
    """The FlexAttention path (packed documents on CUDA), traced forward-only here: the CPU has
    no FlexAttention backward."""
    ids = torch.randint(0, CFG.vocab_size, (2, 32))
    doc_ids = torch.tensor([[0] * 10 + [1] * 22, [0] * 32])
    mask = attention_mask(32, 0, doc_ids, None, "cpu", flex=True)
    with torch.no_grad():
        h = model.tok_embeddings(ids)
        assert _explain(model.blocks[0], h, model.rope_cos[:32], model.rope_sin[:32], None, 0, mask) == (1, 0, [])


@pytest.mark.integration
def test_compile_auto_means_cuda_and_wraps_blocks_and_the_loss(model):
    assert compile_enabled("auto", torch.device("cuda")) and not compile_enabled("auto", torch.device("cpu"))
    assert compile_enabled(True, torch.device("cpu")) and not compile_enabled(False, torch.device("cuda"))
    assert ComputeConfig().compile == "auto"
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    plain = Transformer(CFG)
    def compiled(forward) -> bool:  # (inside the saved-tensor hooks' wrapper, `distributed.activations`)
        return hasattr(getattr(forward, "__wrapped__", forward), "_torchdynamo_orig_callable")

    parallelize(plain, Layout(), dist)  # auto on the CPU: nothing compiled
    assert "head_loss" not in vars(plain) and not compiled(plain.blocks[0].forward)
    parallelize(model, Layout(), dist, compute=ComputeConfig(compile=True))
    # compiled on the instance (names, and so checkpoints, unchanged)
    assert "head_loss" in vars(model) and "head_logprobs" in vars(model) and all(compiled(b.forward) for b in model.blocks)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
