"""What a training step minimizes, chosen by the data's declared kind.

`Trainer.train_step` is one loop for every kind of data: for each micro-batch it asks the
objective for the loss summed over the micro-batch's *units*, divides by the step's count of
units, and backpropagates. The objective says what a unit is and how held-out batches become
metrics:

- `NextToken` (pretraining, continued pretraining, SFT): units are the trained-on target tokens;
  the loss is the summed next-token cross-entropy; held-out metrics are loss, perplexity, tokens
  and bits per byte.
- `Preference` (``task_type: preference``): units are pairs; the loss is DPO, IPO, SimPO or ORPO
  (`models.preference_loss`) on each pair's whole-answer log-probabilities; it also reports the
  pairs' mean implicit rewards, margin and accuracy, in training and on held-out pairs.
  DPO and IPO need the reference model's log-probs: precomputed once before training
  (`train.reference`, stored with the run) or, with LoRA, the base with its adapters off at
  every step (``preference.reference: live``).
- `PolicyGradient` (``task_type: rl``): the batches are completions the policy sampled itself
  (`train.rl.Rollouts`, which its ``prepare`` makes the training stream); the loss is GRPO, DAPO,
  Dr. GRPO or GSPO (`models.policy_loss`) and its units are what that loss averages over
  (tokens, completions, or completions × max_new_tokens); it takes ``rl.updates_per_batch``
  updates per batch and reports the clip fraction, the KL to the reference (``rl.kl``) and how far
  the sampler's log-probs are from the trainer's. Held out: the reward of greedy completions of the
  eval prompts.

Every objective says how many optimizer updates a step takes on its batches (``updates``): one,
but for reinforcement learning's μ.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from lmforge.config.schema import RL_TASK, RunConfig
from lmforge.data.batch import Batch, EvalSet, StreamLayout, TrainingData
from lmforge.data.rows.preference import PreferenceBatch, PreferenceData
from lmforge.data.rows.rl import RLBatch, RLData
from lmforge.distributed.dist import DistInfo, all_reduce_sum
from lmforge.distributed.parallelize import compile_enabled
from lmforge.eval.heldout import bits_per_byte, heldout_loss
from lmforge.models.lora import adapters_off
from lmforge.models.policy_loss import aggregate, per_unit, policy_terms, row_units
from lmforge.models.preference_loss import PairLogps, pair_terms
from lmforge.rewards.functions import Reward
from lmforge.train.reference import attach_reference, legacy_weights_tag, weights_tag
from lmforge.train.rl import RolloutData, Sampler, greedy_rewards

# forward(input_ids, targets, doc_ids, positions=None, per_token=False) -> models.loss.LossOutput: the module
# `distributed.parallelize` returns (gradients synchronized), or the bare model's training_loss.
Forward = Callable[..., object]


@dataclass
class MicroLoss:
    """One micro-batch's share of a step."""

    loss_sum: torch.Tensor  # the loss summed over the micro-batch's units (fp32), with its graph
    aux_loss: torch.Tensor | None = None  # MoE load-balancing + z losses (added as they are)
    moe: dict = field(default_factory=dict)  # MoE routing statistics
    stats: dict[str, torch.Tensor] = field(default_factory=dict)  # detached sums over units, logged as means


class Objective(Protocol):
    updates: int  # optimizer updates a step takes on its batches (reinforcement learning's μ; else 1)

    def units(self, batch: Batch) -> torch.Tensor:
        """How many units the loss is a mean over, counted on the host copy (no device wait)."""
        ...

    def __call__(self, forward: Forward, batch: Batch) -> MicroLoss: ...

    def evaluate(self, model: torch.nn.Module, eval_set: EvalSet, device: torch.device, autocast) -> dict:
        """Held-out metrics of one eval set, summed over ranks (every rank calls it); "loss" among them."""
        ...

    def prepare(self, data: TrainingData, model: torch.nn.Module, layout: StreamLayout, save_folder: str,
                dist: DistInfo, autocast, *, resuming: bool, log) -> TrainingData:
        """Called once the model holds its starting weights, before any step: the data, with
        whatever the objective computes ahead (the reference log-probs)."""
        ...


def model_forward(model: torch.nn.Module) -> Forward:
    """The bare model's training forward, called like the parallelized one (evaluation, reference)."""
    def forward(input_ids, targets, doc_ids=None, positions=None, per_token=False):
        return model.training_loss(input_ids, targets, doc_ids=doc_ids, positions=positions, per_token=per_token)
    return forward


class NextToken:
    """Summed next-token cross-entropy over the trained-on targets."""

    updates = 1

    def units(self, batch: Batch) -> torch.Tensor:
        return batch.num_targets()

    def __call__(self, forward: Forward, batch: Batch) -> MicroLoss:
        out = forward(batch.input_ids, batch.targets, batch.doc_ids, batch.positions)
        return MicroLoss(out.ce_sum, out.aux_loss, out.moe)

    def evaluate(self, model, eval_set: EvalSet, device, autocast) -> dict:
        loss, n = heldout_loss(model, eval_set.batches(), device, autocast)
        metrics = {"loss": loss, "perplexity": math.exp(min(loss, 50)), "tokens": n}
        bpb = bits_per_byte(loss, eval_set.bytes_per_token)
        if bpb is not None:
            metrics["bits_per_byte"] = bpb
        return metrics

    def prepare(self, data, model, layout, save_folder, dist, autocast, *, resuming, log):
        return data


PAIR_STATS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")


class Preference:
    """DPO / IPO / SimPO / ORPO over pairs (``cfg.preference``). ``model``: the unwrapped model,
    for a live reference (its base with the adapters off)."""

    updates = 1

    def __init__(self, cfg: RunConfig, model: torch.nn.Module):
        p = cfg.preference.resolved(lora=cfg.lora is not None)
        self.loss, self.beta, self.label_smoothing, self.gamma = p.loss, p.beta, p.label_smoothing, p.gamma or 0.0
        self.reference = p.reference  # None for the reference-free losses
        self.model = model
        self.start = (cfg.custom_weights_path, cfg.parameters.seed)  # the starting weights (`weights_tag`)

    def units(self, batch: PreferenceBatch) -> torch.Tensor:
        return batch.num_pairs()

    def __call__(self, forward: Forward, batch: PreferenceBatch) -> MicroLoss:
        ref = self._reference(batch)  # first: the policy's forward is then followed right by its backward
        out = forward(batch.input_ids, batch.targets, batch.doc_ids, per_token=True)
        logps, tokens = batch.answer_sums(out.token_logp), batch.answer_tokens().clamp(min=1.0)
        ref_chosen, ref_rejected = (None, None) if ref is None else (ref[..., 0], ref[..., 1])
        pairs = PairLogps(logps[..., 0], logps[..., 1], tokens[..., 0], tokens[..., 1], ref_chosen, ref_rejected)
        terms = pair_terms(self.loss, pairs, beta=self.beta, label_smoothing=self.label_smoothing, gamma=self.gamma)
        margin = terms.chosen_reward - terms.rejected_reward
        stats = {"rewards/chosen": terms.chosen_reward, "rewards/rejected": terms.rejected_reward,
                 # a tie counts half: at step 0 (policy = reference) accuracy is 0.5, chance
                 "rewards/margin": margin, "rewards/accuracy": (margin > 0).float() + 0.5 * (margin == 0).float()}
        # [B, P] slots: those of a row that hold no pair count for nothing
        loss_sum = torch.where(batch.pair_mask, terms.loss, 0.0).sum()
        return MicroLoss(loss_sum, out.aux_loss, out.moe,
                         {k: torch.where(batch.pair_mask, stats[k], 0.0).sum() for k in PAIR_STATS})

    def _reference(self, batch: PreferenceBatch) -> torch.Tensor | None:
        """[B, P, 2] reference log-probs: carried by the batch (precomputed), from the base with its
        adapters off (live), or None (reference-free losses)."""
        if self.reference is None:
            return None
        if self.reference == "precomputed":
            return batch.ref_logps
        with torch.no_grad(), adapters_off(self.model):
            out = self.model.training_loss(batch.input_ids, batch.targets, doc_ids=batch.doc_ids, per_token=True)
        return batch.answer_sums(out.token_logp)

    @torch.no_grad()
    def evaluate(self, model, eval_set: EvalSet, device, autocast=nullcontext) -> dict:
        was_training = model.training
        model.eval()
        forward = model_forward(model)
        total = torch.zeros(2 + len(PAIR_STATS), dtype=torch.float64, device=device)  # loss, pairs, stats
        for batch in eval_set.batches():
            batch = batch.to(device)
            with autocast():
                out = self(forward, batch)
            stats = [out.stats[k] for k in PAIR_STATS]
            total += torch.stack([out.loss_sum, batch.num_pairs().float(), *stats]).double()
        model.train(was_training)
        all_reduce_sum(total)
        pairs = total[1].item()
        values = (total / pairs).tolist() if pairs else [float("nan")] * len(total)
        return {"loss": values[0], "pairs": int(pairs)} | dict(zip(PAIR_STATS, values[2:]))

    def prepare(self, data: PreferenceData, model, layout, save_folder, dist, autocast, *, resuming, log):
        settings = f"β {self.beta:g}" + (f", γ {self.gamma:g}" if self.loss == "simpo" else "") + \
            (f", label smoothing {self.label_smoothing:g}" if self.label_smoothing else "")
        log(f"preference: {self.loss} ({settings}); reference: " + {
            None: "none (reference-free)", "live": "the base with its LoRA adapters off, at every step",
            "precomputed": "log-probs of the starting weights, computed once"}[self.reference])
        if self.reference != "precomputed":
            return data
        main = dist.is_main  # only rank 0 reads the stored file
        return attach_reference(model, data, layout, save_folder, dist, autocast,
                                weights=weights_tag(*self.start) if main else "", resuming=resuming, log=log,
                                legacy_weights=legacy_weights_tag(*self.start) if main else None)


class PolicyGradient:
    """GRPO, DAPO, Dr. GRPO or GSPO (``cfg.rl``) on completions the policy samples itself. ``model``:
    the unwrapped model (it samples; with LoRA and ``rl.kl`` its base with the adapters off is the
    reference); ``reference``: a frozen copy of the starting weights (``rl.kl`` without LoRA), or None."""

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, rewards: Sequence[Reward],
                 reference: torch.nn.Module | None = None):
        self.opts = o = cfg.rl.resolved()
        self.loss, self.clip, self.beta, self.max_new_tokens, self.updates = \
            o.loss, o.clip, o.kl, o.max_new_tokens, o.updates_per_batch
        self.model, self.reference, self.cfg = model, reference, cfg
        self.rewards = list(rewards)  # loaded once, at resolution (`RLData.rewards`)
        self.sampler: Sampler | None = None  # made in `prepare` (it needs the run's ranks and autocast)
        self.dist: DistInfo | None = None

    def units(self, batch: RLBatch) -> torch.Tensor:
        return row_units(self.loss, batch.mask(), self.max_new_tokens).sum()

    def __call__(self, forward: Forward, batch: RLBatch) -> MicroLoss:
        if self.beta and batch.ref_logp is None:  # first: the policy's forward is then followed right by its backward
            batch.ref_logp = self._reference(batch)
        out = forward(batch.input_ids, batch.targets, batch.doc_ids, per_token=True)
        mask = batch.mask()
        if batch.old_logp is None:  # the step's first update: the weights that sampled the batch (ratio 1)
            batch.old_logp = out.token_logp.detach()
        terms = policy_terms(self.loss, out.token_logp, batch.old_logp, mask, batch.advantages, clip=self.clip,
                             ref_logp=batch.ref_logp, beta=self.beta)
        units = row_units(self.loss, mask, self.max_new_tokens)
        stats = {"clip_fraction": per_unit(terms.clipped, mask, units),
                 # the sampler's log-probs against the trainer's, on the same weights: 0 but for rounding
                 "logprob_gap": per_unit((batch.old_logp - batch.sampler_logp).abs(), mask, units)}
        if terms.kl is not None:
            stats["kl"] = per_unit(terms.kl.detach(), mask, units)
        return MicroLoss(aggregate(self.loss, terms, mask, self.max_new_tokens), out.aux_loss, out.moe, stats)

    @torch.no_grad()
    def _reference(self, batch: RLBatch) -> torch.Tensor:
        """[B, T] the reference's log-probs: a frozen copy of the starting weights, or the base with its
        adapters off."""
        if self.reference is not None:
            return self.reference.training_loss(batch.input_ids, batch.targets, per_token=True).token_logp
        with adapters_off(self.model):
            return self.model.training_loss(batch.input_ids, batch.targets, per_token=True).token_logp

    def evaluate(self, model, eval_set: EvalSet, device, autocast=nullcontext) -> dict:
        """The held-out reward of greedy completions of the eval prompts (`train.rl.greedy_rewards`)."""
        return greedy_rewards(self.sampler, self.rewards, eval_set.batches(), self.dist)

    def prepare(self, data: RLData, model, layout: StreamLayout, save_folder, dist, autocast, *, resuming, log):
        o = self.opts
        self.dist = dist
        self.sampler = Sampler(model, data.tokenizer, o, sharded=layout.layout.sharded, autocast=autocast,
                               compiled=compile_enabled(self.cfg.compute.compile, dist.device))
        rewards = ", ".join(f"{r.name}" + (f" × {r.weight:g}" if r.weight != 1 else "") for r in self.rewards)
        log(f"rl: {o.loss} loss, clip [{o.clip[0]:g}, {o.clip[1]:g}], {o.updates_per_batch} update(s) per batch, "
            f"rewards {rewards} (advantages scaled by {o.scale_rewards}); {layout.layout.group_size} completions per "
            f"prompt of at most {o.max_new_tokens} tokens, temperature {o.temperature:g}, top-p {o.top_p:g}"
            + (f", stop {list(o.stop)}" if o.stop else "")
            + (f"; KL to the {'starting weights' if self.reference is not None else 'base, adapters off'} "
               f"β {o.kl:g}" if o.kl else ""))
        return RolloutData(data, self.sampler, self.rewards, o, dist, log)


def objective_for(data: TrainingData, cfg: RunConfig, model: torch.nn.Module,
                  reference: torch.nn.Module | None = None) -> Objective:
    """The objective of the data's declared kind: preference pairs, prompts to sample (reinforcement
    learning; ``reference``: its frozen starting weights, if any), else next-token prediction."""
    if data.kind == RL_TASK:
        return PolicyGradient(cfg, model, data.rewards, reference)
    return Preference(cfg, model) if data.kind == "preference" else NextToken()
