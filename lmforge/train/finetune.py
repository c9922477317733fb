"""Fine-tuning on top of the one trainer: data and defaults for prompt/response, chat and preference rows.

`finetune_setup` is the fine-tuning counterpart of `train.setup.pretrain_setup`: it returns an
`SFTData` (packed JSONL rows whose batches carry loss targets only on responses, and document
ids that keep packed examples apart) and the plan; the `Trainer` then runs unchanged — same
checkpoints, resume, trackers and final export. Defaults that differ from pretraining:

- learning rate: one tenth of the size-based pretraining default (e.g. 1.2e-5 for 7B), the
  usual SFT range — with `lora:` the pretraining default itself (adapters take ~10× the full
  fine-tuning rate); warmup, schedule and AdamW settings as in pretraining;
- chat rows: the tokenizer's own chat template when it has one (`data.chat`), else lmforge's
  plain one; the template used is the one exported with the final tokenizer;
- generation at each evaluation: max_new_tokens 100, temperature 1, top_k 50, top_p 0.95;
- `model` and `tokenizer` are taken from `custom_weights_path` when left out
  (`train.locate.fill_from_weights`);
- preference pairs (`task_type: preference`, `data.preference`): the loss's β and reference
  written into the config (`PreferenceOptions.resolved`), and a learning rate of one hundredth
  of the pretraining default (one tenth with LoRA; `config.defaults.preference_lr_factor`).

Continued pretraining (`task_type: continued_pretrain`, or `lmforge train` with
`custom_weights_path`) keeps the pretraining data path and defaults — the size-based peak LR
re-warmed, with a fresh optimizer and schedule.
"""

from __future__ import annotations

from lmforge.config.defaults import preference_lr_factor
from lmforge.config.model import padded_vocab
from lmforge.config.schema import RunConfig, TokenizerSpec
from lmforge.data.chat import load_chat_template
from lmforge.data.preference import PREFERENCE_TASK, load_preference_data
from lmforge.data.sft import ASSISTANT_HEADER, CHAT_TEMPLATE, SFTData, chat_prompt, load_rows
from lmforge.data.tokenizer import load_tokenizer
from lmforge.distributed.dist import DistInfo
from lmforge.errors import UserError
from lmforge.train.locate import check_tokenizer_fits
from lmforge.train.plan import make_plan, resolved_config
from lmforge.train.trainer import RunSetup

SFT_LR_FACTOR = 0.1
SFT_SAMPLING = {"max_new_tokens": 100, "temperature": 1.0, "top_k": 50, "top_p": 0.95}


def finetune_setup(cfg: RunConfig, dist: DistInfo, log=print) -> RunSetup:
    """Tokenizer, packed rows and plan for a fine-tuning run (``cfg`` has its names filled)."""
    if not isinstance(cfg.tokenizer, str):
        what = "a tokenizer to train or extend" if isinstance(cfg.tokenizer, TokenizerSpec) else "none"
        raise UserError(f"tokenizer: fine-tuning needs the base model's tokenizer folder (got {what}); "
                        "set tokenizer: PATH, or custom_weights_path to a model folder that holds one")
    tokenizer = load_tokenizer(cfg.tokenizer)
    if cfg.model.vocab_size is not None:
        check_tokenizer_fits(tokenizer, cfg.model, "tokenizer")
    else:
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(
            update={"vocab_size": padded_vocab(tokenizer.vocab_size)})})
    template = load_chat_template(tokenizer.path)  # the tokenizer's own, else None → ours
    updates = {k: v for k, v in SFT_SAMPLING.items() if k not in cfg.eval.model_fields_set}
    if cfg.task_type == "chat_completion":
        updates["prompts"] = [template.generation_prompt(p, tokenizer) if template else
                              p if ASSISTANT_HEADER in p else chat_prompt(p) for p in cfg.eval.prompts]
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update=updates)})
    seq_len = cfg.parameters.context_length or cfg.model.max_seq_len
    if seq_len > cfg.model.max_seq_len:  # as in pretraining: RoPE tables are derived, not stored
        cfg.model.max_seq_len = seq_len
    log(f"chat template: {'the tokenizer’s own' if template else 'lmforge’s plain one (the tokenizer has none)'}")
    chat_template = template.text if template else CHAT_TEMPLATE
    if cfg.task_type == PREFERENCE_TASK:  # [preference glue → resolve()] pairs, β/reference defaults, LR factor
        cfg = cfg.model_copy(update={"preference": cfg.preference.resolved(lora=cfg.lora is not None)})
        data = load_preference_data([d.path for d in cfg.train_data], cfg.eval.data_path, tokenizer, seq_len,
                                    packing=cfg.sft.packing, seed=cfg.parameters.seed, template=template,
                                    chat_template=chat_template, log=log)
        plan = make_plan(cfg, world_size=dist.world_size, device=dist.device, samples_per_epoch=len(data.rows),
                         data_seq_len=seq_len)
        if cfg.parameters.learning_rate is None:
            plan.learning_rate = float(f"{plan.learning_rate * preference_lr_factor(cfg.lora is not None):.3g}")
        return RunSetup(resolved_config(cfg, plan), plan, data, tokenizer)  # [/preference glue]
    rows = load_rows([d.path for d in cfg.train_data], tokenizer, seq_len, task=cfg.task_type,
                     packing=cfg.sft.packing, seed=cfg.parameters.seed, template=template)
    eval_rows = None
    if cfg.eval.data_path:
        eval_rows = load_rows([cfg.eval.data_path], tokenizer, seq_len, task=cfg.task_type,
                              packing=cfg.sft.packing, seed=cfg.parameters.seed, template=template)
    log(f"data: {rows.examples} examples in {len(rows)} rows of {seq_len} tokens"
        f"{' (packed)' if cfg.sft.packing else ''}"
        + (f"; {rows.truncated} cut at the context length" if rows.truncated else "")
        + (f"; {rows.dropped} dropped (no response token fits)" if rows.dropped else ""))
    plan = make_plan(cfg, world_size=dist.world_size, device=dist.device, samples_per_epoch=len(rows),
                     data_seq_len=seq_len)
    if cfg.parameters.learning_rate is None and cfg.lora is None:  # LoRA keeps the pretraining default (~10×)
        plan.learning_rate = float(f"{plan.learning_rate * SFT_LR_FACTOR:.3g}")
    data = SFTData(tokenizer.path, rows, eval_rows, chat_template=chat_template)
    return RunSetup(resolved_config(cfg, plan), plan, data, tokenizer)
