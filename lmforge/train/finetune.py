"""Fine-tuning and continued pretraining on top of the one training loop.

`finetune(config)` is `train(config)` with a fine-tuning `task_type`: the trainer calls
`sft_setup` instead of the pretraining data pipeline, gets an `SFTData` (packed JSONL rows
streamed as dicts with loss targets and doc ids) and otherwise runs unchanged — same
checkpoints, resume, trackers and final export. Defaults that differ from pretraining:

- learning rate: one tenth of the size-based pretraining default (e.g. 1.2e-5 for 7B), the
  usual SFT range — with `lora:` the pretraining default itself (adapters take ~10× the full
  fine-tuning rate); warmup, schedule and AdamW settings as in pretraining;
- generation at each evaluation: max_new_tokens 100, temperature 1, top_k 50, top_p 0.95;
- `model` and `tokenizer` are taken from `custom_weights_path` when left out (`fill_from_weights`).

Continued pretraining (`lmforge train` with `custom_weights_path`) keeps the pretraining
defaults — the size-based peak LR re-warmed over 5% of the steps, then cosine to 10% — with a
fresh optimizer and schedule.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lmforge.config.schema import RunConfig, TokenizerSpec
from lmforge.data.sft import CHAT_TEMPLATE, IGNORE, SFT_TASKS, ASSISTANT_HEADER, PackedRows, SFTStream, chat_prompt
from lmforge.data.sft import eval_batches, load_rows
from lmforge.distributed.dist import all_reduce_sum
from lmforge.errors import UserError

SFT_LR_FACTOR = 0.1
SFT_SAMPLING = {"max_new_tokens": 100, "temperature": 1.0, "top_k": 50, "top_p": 0.95}


def is_sft(cfg: RunConfig) -> bool:
    return cfg.task_type in SFT_TASKS


def fill_from_weights(raw: dict) -> dict:
    """Fill `model` / `tokenizer` of a raw config dict from its `custom_weights_path`."""
    path = raw.get("custom_weights_path")
    if not path or (raw.get("model") and raw.get("tokenizer")):
        return raw
    from lmforge.models.locate import locate, model_config_of

    raw = dict(raw)
    if not raw.get("model"):
        raw["model"] = model_config_of(path).model_dump(mode="json")
    if not raw.get("tokenizer"):
        tok = locate(path).tokenizer_dir
        if tok:
            raw["tokenizer"] = tok
    return raw


@dataclass
class SFTData:
    """What the trainer's `setup` returns for fine-tuning, in place of `ResolvedData`."""
    tokenizer_path: str
    rows: PackedRows
    eval_rows: PackedRows | None
    eval: list = field(default_factory=list)  # no pretraining-style eval datasets

    def train_stream(self, plan, dist, cfg: RunConfig) -> SFTStream:
        return SFTStream(self.rows, micro_batch_size=plan.micro_batch, global_batch_size=plan.global_batch,
                         rank=dist.rank, world_size=dist.world_size, seed=cfg.parameters.seed)

    def eval_metrics(self, model, plan, dist, cfg: RunConfig, device, autocast) -> dict:
        if self.eval_rows is None:
            return {}
        loss, n = masked_heldout_loss(model, eval_batches(self.eval_rows, plan.micro_batch, dist.rank,
                                                          dist.world_size, cfg.eval.max_batches), device, autocast)
        import math

        return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50)), "eval/response_tokens": n}


def unpack_batch(batch, device):
    """(inputs, targets, doc_ids) for a pretraining tensor or a fine-tuning dict batch."""
    if isinstance(batch, dict):
        return (batch["input_ids"].to(device, non_blocking=True), batch["targets"].to(device, non_blocking=True),
                batch["doc_ids"].to(device, non_blocking=True))
    batch = batch.to(device, non_blocking=True)
    return batch, batch, None


def target_count(batches: list) -> int | None:
    """Trained-on targets in one optimizer step's micro-batches (None for pretraining batches)."""
    if not isinstance(batches[0], dict):
        return None
    return max(1, sum(int((b["targets"][:, 1:] != IGNORE).sum()) for b in batches))


@torch.no_grad()
def masked_heldout_loss(model, batches, device, autocast) -> tuple[float, int]:
    """Mean loss over response tokens only, summed across ranks."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in batches:
        inputs, targets, docs = unpack_batch(batch, device)
        with autocast():
            logits = model(inputs, doc_ids=docs)
        total[0] += F.cross_entropy(logits[:, :-1].float().flatten(0, 1), targets[:, 1:].flatten(),
                                    reduction="sum").double()
        total[1] += (targets[:, 1:] != IGNORE).sum()
    model.train(was_training)
    all_reduce_sum(total)
    n = int(total[1].item())
    return (total[0].item() / n if n else float("nan")), n


def sft_setup(cfg: RunConfig, dist, log=print):
    """The fine-tuning counterpart of `trainer.setup`: tokenizer, packed rows, plan."""
    from lmforge.data.tokenizer import load_tokenizer
    from lmforge.models.locate import check_tokenizer_fits
    from lmforge.train.plan import make_plan, resolved_config
    from lmforge.train.trainer import default_names, vocab_for

    cfg = default_names(cfg)
    if not isinstance(cfg.tokenizer, str):
        what = "a tokenizer to train or extend" if isinstance(cfg.tokenizer, TokenizerSpec) else "none"
        raise UserError(f"tokenizer: fine-tuning needs the base model's tokenizer folder (got {what}); "
                        "set tokenizer: PATH, or custom_weights_path to a model folder that holds one")
    tokenizer = load_tokenizer(cfg.tokenizer)
    if cfg.model.vocab_size is not None:
        check_tokenizer_fits(tokenizer, cfg.model, "tokenizer")
    cfg = vocab_for(cfg, tokenizer.vocab_size)
    from lmforge.data.chat import load_chat_template

    template = load_chat_template(tokenizer.path)  # the tokenizer's own, else None → ours
    updates = {k: v for k, v in SFT_SAMPLING.items() if k not in cfg.eval.model_fields_set}
    if cfg.task_type == "chat_completion":
        updates["prompts"] = [template.generation_prompt(p, tokenizer) if template else
                              p if ASSISTANT_HEADER in p else chat_prompt(p) for p in cfg.eval.prompts]
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update=updates)})
    seq_len = cfg.parameters.context_length or cfg.model.max_seq_len
    if seq_len > cfg.model.max_seq_len:  # as in pretraining: RoPE tables are derived, not stored
        cfg.model.max_seq_len = seq_len
    rows = load_rows([d.path for d in cfg.train_data], tokenizer, seq_len, task=cfg.task_type,
                     packing=cfg.sft.packing, seed=cfg.parameters.seed, template=template)
    eval_rows = None
    if cfg.eval.data_path:
        eval_rows = load_rows([cfg.eval.data_path], tokenizer, seq_len, task=cfg.task_type,
                              packing=cfg.sft.packing, seed=cfg.parameters.seed, template=template)
    log(f"chat template: {'the tokenizer’s own' if template else 'lmforge’s plain one (the tokenizer has none)'}")
    log(f"data: {rows.examples} examples in {len(rows)} rows of {seq_len} tokens"
        f"{' (packed)' if cfg.sft.packing else ''}"
        + (f"; {rows.truncated} cut at the context length" if rows.truncated else "")
        + (f"; {rows.dropped} dropped (no response token fits)" if rows.dropped else ""))
    plan = make_plan(cfg, world_size=dist.world_size, device=dist.device, samples_per_epoch=len(rows),
                     data_seq_len=seq_len)
    if cfg.parameters.learning_rate is None and cfg.lora is None:  # LoRA keeps the pretraining default (~10×)
        plan.learning_rate = float(f"{plan.learning_rate * SFT_LR_FACTOR:.3g}")
    return resolved_config(cfg, plan), plan, SFTData(tokenizer.path, rows, eval_rows), tokenizer


def write_chat_template(folder: str) -> None:
    """Store our chat template with the exported tokenizer (transformers' apply_chat_template),
    unless the tokenizer came with its own (then that one was used, and it stays)."""
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(path) or os.path.isfile(os.path.join(folder, "chat_template.jinja")):
        return
    with open(path) as f:
        config = json.load(f)
    if config.get("chat_template"):
        return
    config["chat_template"] = CHAT_TEMPLATE
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def finetune(cfg: RunConfig, *, overwrite: bool = False, log=print):
    """Run supervised fine-tuning (or continued pretraining); returns the trainer's TrainResult.

    The plain function behind `lmforge finetune` (and the SDK's `lmforge.finetune`)."""
    from lmforge.train.trainer import train

    if cfg.task_type == "pretrain":
        cfg = cfg.model_copy(update={"task_type": "instruction_finetune"})
    if cfg.task_type == "continued_pretrain" and not cfg.custom_weights_path:
        raise UserError("task_type continued_pretrain: set custom_weights_path to the model to continue from")
    result = train(cfg, overwrite=overwrite, log=log)
    if result.final_dir and is_sft(cfg):
        write_chat_template(result.final_dir)
    return result


def load_run_config(path: str | None, overrides: dict | None = None, sets: list[str] | None = None) -> RunConfig:
    """Like `config.load.load_config`, but `model`/`tokenizer` may come from `custom_weights_path`."""
    from lmforge.config.load import build_config, load_raw

    return build_config(fill_from_weights(load_raw(path, overrides=overrides, sets=sets)), source=path)
