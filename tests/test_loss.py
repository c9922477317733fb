"""The next-token loss: lmforge's chunked head + cross-entropy against the plain one (loss and
gradients), the memory the planner gives it, and liger-kernel's fused loss on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmforge.config.model import get_preset
from lmforge.data.batch import IGNORE
from lmforge.plan import memory
from lmforge.plan.flops import param_counts
from lmforge.plan.hardware import GPU_TYPES
from lmforge.models import loss as loss_module
from lmforge.models.loss import CHUNK_ELEMENTS, next_token_loss


def _inputs(B=3, T=20, d=16, V=37, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, d, generator=g).to(device).requires_grad_()
    w = (torch.randn(V, d, generator=g) * 0.5).to(device).requires_grad_()
    t = torch.randint(0, V, (B, T), generator=g)
    t[0, 3] = t[1, -1] = t[2, :5] = IGNORE  # prompts / row ends are skipped
    return h, w, t.to(device)


def _plain(h, w, t, softcap=None):
    logits = F.linear(h, w).flatten(0, 1).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, t.flatten(), ignore_index=IGNORE, reduction="sum")


# many chunks, a ragged last one, one chunk; and a logit soft-cap (Gemma 2) small enough to bend these logits
@pytest.mark.parametrize("rows_per_chunk,softcap", [(1, None), (7, None), (60, None), (1000, None), (7, 1.5)])
def test_chunked_loss_and_gradients_equal_plain_cross_entropy(monkeypatch, rows_per_chunk, softcap):
    h, w, t = _inputs()
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", rows_per_chunk * w.shape[0])
    ours, ref = next_token_loss(h, w, t, kernel="chunked", softcap=softcap), _plain(h, w, t, softcap)
    if softcap is not None:
        assert abs(ref.item() - _plain(h, w, t).item()) > 1.0  # the cap changes this loss
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-4)
    scale = 0.37  # backward scales the gradients computed in forward by the incoming gradient
    got = torch.autograd.grad(ours * scale, (h, w))
    want = torch.autograd.grad(ref * scale, (h, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_frozen_head_tied_weights_and_no_grad():
    h, w, t = _inputs(seed=1)
    # A frozen head (LoRA): only the hidden states get a gradient.
    frozen = w.detach()
    (gh,) = torch.autograd.grad(next_token_loss(h, frozen, t, kernel="chunked"), (h,))
    torch.testing.assert_close(gh, torch.autograd.grad(_plain(h, frozen, t), (h,))[0], rtol=1e-5, atol=1e-6)
    # Evaluation: no gradients computed or kept, the same value.
    with torch.no_grad():
        value = next_token_loss(h, w, t, kernel="chunked")
    assert value.grad_fn is None
    torch.testing.assert_close(value, _plain(h, w, t).detach(), rtol=1e-6, atol=1e-4)
    # Everything ignored: zero, not NaN.
    assert next_token_loss(h, w, torch.full_like(t, IGNORE)).item() == 0.0


def test_chunked_loss_under_bf16_autocast_computes_in_bf16_and_keeps_fp32_gradients():
    """As F.linear would under autocast: bf16 matmuls, fp32 softmax; an fp32 master weight still
    gets an fp32 gradient (the plain path rounds it through bf16)."""
    h, w, t = _inputs(seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = next_token_loss(h, w, t, kernel="chunked")
        ref = _plain(h, w, t)
    torch.testing.assert_close(ours, ref, rtol=2e-2, atol=0.5)
    gw = torch.autograd.grad(ours, w)[0]
    assert gw.dtype == torch.float32
    torch.testing.assert_close(gw, torch.autograd.grad(_plain(h, w, t), w)[0], rtol=0.05, atol=0.05)


def test_the_planner_uses_the_loss_chunk_and_fits_a_128k_vocabulary_at_micro_batch_8():
    assert memory.LOSS_CHUNK_ELEMENTS == CHUNK_ELEMENTS
    for vocab in (32000, 128256):
        cfg = get_preset("llama-1b").model_copy(update={"vocab_size": vocab})
        plan = memory.memory_plan(param_counts(cfg)["total"], cfg, 2048, memory.Sharding("fsdp", 1),
                                  GPU_TYPES["h100-sxm"].memory_bytes,
                                  micro_batch=8, activation_checkpointing=False)
        assert plan["fits"] and plan["max_micro_batch"]["no_ac"] >= 8, (vocab, plan["max_micro_batch"])
        # nothing per token scales with the vocabulary any more: only the fixed workspace does
        assert plan["loss_workspace_bytes"] < 3e9
    assert memory.activation_bytes(cfg, 2048, False) == memory.activation_bytes(
        cfg.model_copy(update={"vocab_size": 32000}), 2048, False)


@pytest.mark.gpu
def test_liger_and_chunked_kernels_match_plain_cross_entropy_on_cuda():
    pytest.importorskip("liger_kernel")
    h, w, t = _inputs(B=4, T=256, d=128, V=1000, device="cuda")
    ref = _plain(h.double(), w.double(), t)
    want = torch.autograd.grad(ref, (h, w))
    for kernel in ("chunked", "liger"):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ours = next_token_loss(h, w, t, kernel=kernel)
        assert abs(ours.item() - ref.item()) / ref.item() < 1e-2, kernel
        for a, b in zip(torch.autograd.grad(ours, (h, w)), want):
            assert ((a.double() - b).norm() / b.norm()).item() < 2e-2, kernel
