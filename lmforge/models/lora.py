"""LoRA: train low-rank adapters on a frozen base model, then merge them or save them for PEFT.

A targeted projection ``W`` (nn.Linear) becomes ``LoRALinear``: the same ``weight``/``bias``
parameters (frozen) plus ``lora_A`` [r, in] and ``lora_B`` [out, r], and computes

    y = x Wᵀ + b + (alpha / r) · dropout(x) Aᵀ Bᵀ

with A Kaiming-uniform and B zero, so training starts exactly at the base model (PEFT's
initialization and scaling). Parameter names of the base stay as they were, so checkpoints,
FSDP sharding and resume treat an adapted model like any other; the optimizer sees only the
adapters because it takes parameters with ``requires_grad`` only.

Targets use the Hugging Face / PEFT projection names (``q_proj`` … ``down_proj``), the names
people already write in PEFT configs and the ones the exported adapter uses. Mixture-of-experts
feed-forward layers are not targets (their experts are batched 3-D weights, not Linears).

Exports: ``merge_lora`` folds ``scale · B A`` into ``W`` (a plain model again); ``peft_adapter``
writes ``adapter_config.json`` + ``adapter_model.safetensors`` that ``peft.PeftModel`` loads
onto the Hugging Face export of the base model.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.config.schema import LORA_TARGETS, LoRAConfig
from lmforge.errors import UserError
from lmforge.run_files import MODEL_CONFIG_FILE, RUN_FILE, STATE_FILE

# PEFT / HF projection name → (our submodule path in a block, HF submodule in a layer).
_MODULES = {
    "q_proj": ("attn.wq", "self_attn.q_proj"), "k_proj": ("attn.wk", "self_attn.k_proj"),
    "v_proj": ("attn.wv", "self_attn.v_proj"), "o_proj": ("attn.wo", "self_attn.o_proj"),
    "gate_proj": ("mlp.w1", "mlp.gate_proj"), "up_proj": ("mlp.w3", "mlp.up_proj"),
    "down_proj": ("mlp.w2", "mlp.down_proj"),
}
assert set(_MODULES) == set(LORA_TARGETS)


class LoRALinear(nn.Linear):
    """A frozen nn.Linear plus a trainable low-rank update (see the module docstring)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # the same Parameter objects: names and storage unchanged
        self.bias = base.bias
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=w.device, dtype=w.dtype))
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True  # False: the base projection alone (`adapters_off`)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        if not self.enabled:
            return base
        update = F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B)
        return base + self.scale * update

    def merged_weight(self) -> torch.Tensor:
        return self.weight + self.scale * (self.lora_B @ self.lora_A).to(self.weight.dtype)


def _targets(model: nn.Module, lora: LoRAConfig):
    """(block index, target name, parent module, attribute) for every targeted Linear."""
    found = []
    for name in lora.targets:
        path, _ = _MODULES[name]
        parent_path, attr = path.rsplit(".", 1)
        hits = 0
        for i, block in enumerate(model.blocks):
            parent = block.get_submodule(parent_path)
            if isinstance(getattr(parent, attr, None), nn.Linear):
                found.append((i, name, parent, attr))
                hits += 1
        if not hits:
            why = " (mixture-of-experts layers have no dense MLP projections)" if parent_path == "mlp" else ""
            raise UserError(f"lora.targets: {name} matches no module of this model{why}")
    return found


def apply_lora(model: nn.Module, lora: LoRAConfig | None, log=None) -> nn.Module:
    """Freeze `model` and put adapters on the targeted projections (in place). No-op for None.

    Call it on the built (or meta-device) model before parallelizing it; A is drawn from the
    current torch RNG, so a seeded run gets the same adapters on every rank."""
    if lora is None:
        return model
    targets = _targets(model, lora)
    for p in model.parameters():
        p.requires_grad_(False)
    for _, _, parent, attr in targets:
        adapted = LoRALinear(getattr(parent, attr), lora.rank, lora.alpha, lora.dropout)
        setattr(parent, attr, adapted.train(parent.training))  # an eval-mode model stays without dropout
    if log is not None:
        trainable, total = trainable_counts(model)
        log(f"lora: rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.targets)} × {len(model.blocks)} "
            f"blocks: {trainable:,} trainable parameters ({100 * trainable / total:.2f}% of {total:,})")
    return model


def lora_modules(model: nn.Module):
    for i, block in enumerate(model.blocks):
        for name, (path, _) in _MODULES.items():
            parent_path, attr = path.rsplit(".", 1)
            module = getattr(block.get_submodule(parent_path), attr, None)
            if isinstance(module, LoRALinear):
                yield i, name, block.get_submodule(parent_path), attr, module


@contextmanager
def adapters_off(model: nn.Module):
    """Run ``model`` as its frozen base inside the block: the reference model of preference
    tuning without a second copy of the weights. A plain flag on each adapted projection, so it
    works the same inside FSDP-sharded blocks (compiled blocks specialize on it: two graphs)."""
    modules = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in modules:
        m.enabled = False
    try:
        yield model
    finally:
        for m in modules:
            m.enabled = True


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight, in place: the model is a plain one again."""
    for _, _, parent, attr, module in list(lora_modules(model)):
        plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                          device="meta")
        plain.weight = nn.Parameter(module.merged_weight(), requires_grad=module.weight.requires_grad)
        if module.bias is not None:
            plain.bias = module.bias
        setattr(parent, attr, plain)
    return model


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's names for a causal LM (`base_model.model.` + the HF module)."""
    out = {}
    for i, name, _, _, module in lora_modules(model):
        hf = f"base_model.model.model.layers.{i}.{_MODULES[name][1]}"
        out[f"{hf}.lora_A.weight"] = module.lora_A.detach().to("cpu").contiguous()
        out[f"{hf}.lora_B.weight"] = module.lora_B.detach().to("cpu").contiguous()
    return out


def write_peft_adapter(tensors: dict[str, torch.Tensor], lora: LoRAConfig, out_dir: str | Path,
                       base_model: str | None = None) -> Path:
    """Write a PEFT LoRA adapter folder (loads with `peft.PeftModel.from_pretrained(hf_base, dir)`)."""
    from safetensors.torch import save_file

    if not tensors:
        raise UserError("this model has no LoRA adapters to save")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.targets), "bias": "none", "fan_in_fan_out": False,
        "init_lora_weights": True, "use_rslora": False, "use_dora": False, "inference_mode": True,
        "modules_to_save": None, "layers_to_transform": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def base_model_reference(custom_weights_path: str | None) -> str | None:
    """What the adapter names as its base: the Hugging Face folder it was trained on, by its absolute
    path (a relative one resolves only from where training ran), or a hub name as given; None for
    a base that transformers cannot load (an lmforge run, its final/ or a checkpoint)."""
    if not custom_weights_path:
        return None
    path = custom_weights_path.removeprefix("hf:")
    local = os.path.expanduser(path)
    if not os.path.isdir(local):
        return path
    if not os.path.isfile(os.path.join(local, "config.json")) and \
            any(os.path.exists(os.path.join(local, f)) for f in (MODEL_CONFIG_FILE, STATE_FILE, RUN_FILE, "final")):
        return None
    return os.path.abspath(local)


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen base's weights (the adapters left out), as contiguous CPU tensors."""
    return {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()
            if not name.endswith((".lora_A", ".lora_B"))}


def _peft_base(model: nn.Module, cfg, adapter_dir: Path, tokenizer_dir: str | None) -> str | None:
    """The base the adapter names: a Hugging Face folder or hub name as given; a base transformers
    cannot load (an lmforge folder) is written beside the adapter in the Hugging Face layout
    (``adapter/base``), so that ``AutoPeftModelForCausalLM.from_pretrained(adapter)`` finds it."""
    ref = base_model_reference(cfg.custom_weights_path)
    if ref is not None or not cfg.custom_weights_path:
        return ref
    from lmforge.data.text.tokenizer import load_tokenizer
    from lmforge.models.io import save_hf

    tok = load_tokenizer(tokenizer_dir) if tokenizer_dir else None
    out = adapter_dir / "base"
    try:
        save_hf(None, cfg.model, out, tokenizer_dir, bos_id=tok.bos_id if tok else None,
                eos_id=tok.eos_id if tok else None, weights=base_state_dict(model))
    except UserError:  # no Hugging Face form (clip_qkv): the adapter names no base rather than a wrong one
        return None
    return str(out.resolve())


def trainable_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters; totals count each adapter pair once."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's weights with every adapter folded in, as contiguous CPU tensors; the
    model itself is left as it is (a trainer can go on using it, and the device holds no
    merged copy)."""
    adapted = {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith((".lora_A", ".lora_B")):
            continue
        t = t.detach().to("cpu")
        if name in adapted:
            m = adapted[name]
            t = t + m.scale * (m.lora_B.detach().to("cpu") @ m.lora_A.detach().to("cpu")).to(t.dtype)
        out[name] = t.contiguous()
    return out


def save_final(model: nn.Module, cfg, final_dir: str, tokenizer_dir: str | None) -> str:
    """A LoRA run's final export: `final/` holds the merged model (so generate, export and later
    stages use it like any other) and `final/adapter/` the PEFT adapter (with the base in the Hugging Face layout where it had none)."""
    from lmforge.models.io import save_pretrained

    save_pretrained(None, cfg.model, final_dir, tokenizer_dir=tokenizer_dir, weights=merged_state_dict(model))
    adapter = Path(final_dir) / "adapter"
    write_peft_adapter(adapter_tensors(model), cfg.lora, adapter, _peft_base(model, cfg, adapter, tokenizer_dir))
    return final_dir


__all__ = ["LORA_TARGETS", "LoRALinear", "adapter_tensors", "adapters_off", "apply_lora", "merge_lora",
           "merged_state_dict", "save_final", "trainable_counts", "write_peft_adapter"]
