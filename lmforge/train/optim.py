"""The optimizer (AdamW, or Muon for the hidden matrices: `train.muon`) and the learning rate a
resumed run blends in with (the schedule itself is `plan.schedule`).
"""

from __future__ import annotations

import torch

from lmforge.config.schema import Parameters
from lmforge.models.lora import LoRALinear
from lmforge.models.moe import GroupedExperts, MoE
from lmforge.plan.schedule import Schedule
from lmforge.train.muon import Muon

_DEFAULTS = Parameters.model_fields  # the config is where defaults live


class Optimizers(list):
    """Several optimizers stepped as one (Muon for hidden matrices + AdamW for the rest).

    A list, so `torch.distributed.checkpoint`'s state-dict helpers take it as they are (they
    accept one optimizer or an iterable of them); `param_groups`, `step` and `zero_grad` act on all.
    """

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self for g in opt.param_groups]

    def step(self) -> None:
        for opt in self:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self:
            opt.zero_grad(set_to_none=set_to_none)


def _adamw(groups: list[dict], *, lr: float, betas, eps: float, device_type: str) -> torch.optim.AdamW:
    kwargs = dict(lr=lr, betas=betas, eps=eps)
    try:  # the fused kernel: numerically the same update, one kernel (CUDA, and CPU in recent torch)
        return torch.optim.AdamW(groups, fused=device_type in ("cuda", "cpu"), **kwargs)
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, foreach=device_type == "cuda", **kwargs)


def muon_matrices(model: torch.nn.Module) -> list[tuple[torch.nn.Parameter, int]]:
    """The parameters Muon trains, each with the number of matrices side by side in its last
    dimension (see `train.muon`): every trainable ≥2-D weight of the transformer blocks —
    attention and MLP projections, and each MoE expert's matrices (gate and up separately).

    On AdamW instead, as in the public recipes (Jordan et al.; Moonlight; torchtitan): embeddings,
    the output head, norms and biases (not hidden matrices), the MoE router (a softmax classifier
    over the experts: the same role as the head) and LoRA adapters (low-rank factors, not weight
    matrices; `RunConfig` refuses muon with lora, since Muon would then train nothing)."""
    skip = set()
    for module in model.modules():
        if isinstance(module, MoE):
            skip.update(id(p) for p in module.router.parameters())
        elif isinstance(module, LoRALinear):
            skip.update((id(module.lora_A), id(module.lora_B)))
    out = []
    for block in model.blocks:
        for module in block.modules():
            fused = module.FUSED_COLUMNS if isinstance(module, GroupedExperts) else {}
            for name, p in module.named_parameters(recurse=False):
                if p.requires_grad and p.dim() >= 2 and id(p) not in skip:
                    out.append((p, fused.get(name, 1)))
    return out


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                    eps: float, device_type: str, kind: str = "adamw",
                    muon_momentum: float = _DEFAULTS["muon_momentum"].default, muon_weight_decay: float | None = None,
                    ns_dtype: torch.dtype = torch.float32) -> Optimizers:
    """AdamW: decay 2-D+ weights (matmuls, embeddings), never norms or other vectors.

    ``muon``: `muon_matrices` go to `Muon` (its own momentum and weight decay — by default the
    AdamW one —, Newton–Schulz in ``ns_dtype``) at the same peak LR, which Moonshot's RMS-matching
    scale makes right for both; the rest stays on AdamW.
    """
    muon = muon_matrices(model) if kind == "muon" else []
    in_muon = {id(p) for p, _ in muon}
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad and id(p) not in in_muon:
            (decay if p.dim() >= 2 else no_decay).append(p)
    adamw = _adamw([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                   lr=lr, betas=betas, eps=eps, device_type=device_type)
    if not muon:
        return Optimizers([adamw])
    groups = [{"params": [p for p, k in muon if k == blocks], "column_blocks": blocks}
              for blocks in sorted({k for _, k in muon})]
    wd = weight_decay if muon_weight_decay is None else muon_weight_decay
    return Optimizers([Muon(groups, lr=lr, weight_decay=wd, momentum=muon_momentum, ns_dtype=ns_dtype), adamw])


def blended_lr(lr: float, blend: dict | None, schedule: Schedule, step: int, elapsed_s: float,
               ramp: float) -> float:
    """After a resume under a different schedule (a longer training_duration, another LR): move
    linearly from the LR the checkpoint last used to the new schedule's over ``ramp`` (in the
    schedule's unit), instead of jumping to it."""
    if not blend:
        return lr
    since = schedule.position(step, elapsed_s) - schedule.position(blend["step"], blend["elapsed_s"])
    t = min(1.0, max(0.0, since / ramp)) if ramp > 0 else 1.0
    return blend["lr"] + (lr - blend["lr"]) * t
