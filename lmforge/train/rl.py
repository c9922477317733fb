"""Reinforcement learning's rollouts: a step's prompts → sampled completions → rewards → advantages →
the micro-batches its update trains on.

`Rollouts` is the `BatchStream` a run of task_type rl trains from (the objective of that kind,
`train.objective.PolicyGradient`, makes it in its ``prepare``). For each step it reads this rank's
prompts (`data.rl.PromptStream`), samples the layout's ``group_size`` completions of each with the policy
itself (`models.generate.sample`: one batch, a KV cache; every rank for its own prompts), scores
them (`rewards.functions`), turns each group's rewards into advantages
(`models.policy_loss.group_advantages`) and yields the step's ``grad_accum`` micro-batches of
completions (`data.rl.RLBatch`). The trainer then takes ``rl.updates_per_batch`` optimizer updates
on them. What a step saw — the reward of each function, groups scored alike ("flat": no learning
signal), completion lengths, truncation, the sampler's entropy, generation and update time — is
summed over the ranks once per step and given to the trainer as the stream's `metrics()`.

Randomness: the sampler draws from a generator seeded from (seed, step, replica) at every step, so
a resumed run samples exactly what the uninterrupted run did; the checkpoint's step is the whole of
the sampler's state.

Held-out: `greedy_rewards` generates greedily from the eval prompts (each once) and scores them —
the held-out reward of each evaluation.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from lmforge.config.schema import RL_TASK, RLOptions
from lmforge.data.batch import EvalSet, StreamLayout
from lmforge.data.rows.rl import PromptBatch, PromptStream, RLBatch, RLData, completion_batch
from lmforge.distributed.dist import DistInfo, all_reduce_max, all_reduce_sum
from lmforge.models.generate import Samples, sample
from lmforge.models.policy_loss import group_advantages
from lmforge.rewards.functions import Reward, score, weighted_total

FLAT = 1e-9  # rewards of a group closer than this are alike


def step_generator(seed: int, step: int, replica: int, device: torch.device) -> torch.Generator:
    """The sampler's random numbers at ``step`` on ``replica``: a pure function of the three."""
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + step) * 1_000_003 + replica)


@dataclass
class Completions:
    """A batch of sampled completions, and the text of each as the rewards read it."""

    samples: Samples
    texts: list[str]


class Sampler:
    """The policy's sampling, as a run's settings ask: its stop strings, the end-of-text token, eager
    (compiled blocks were specialized for training shapes) and under the run's autocast; every rank
    runs all ``max_new_tokens`` passes under FSDP/HSDP (each pass gathers weights with every rank)."""

    def __init__(self, model, tokenizer, opts: RLOptions, *, sharded: bool, compiled: bool, autocast):
        self.model, self.tokenizer, self.opts = model, tokenizer, opts
        self.sharded, self.compiled, self.autocast = sharded, compiled, autocast
        self.window = max((len(s) for s in opts.stop), default=0) + 2  # tokens whose text may end in a stop string

    def _stop(self, tokens: list[int]) -> bool:
        tail = self.tokenizer.decode(tokens[-self.window:])
        return any(s in tail for s in self.opts.stop)

    def __call__(self, prompts: list[list[int]], generator: torch.Generator | None, greedy: bool = False,
                 cache: bool = True) -> Completions:
        stance = torch.compiler.set_stance("force_eager") if self.compiled else nullcontext()
        with stance, self.autocast():
            s = sample(self.model, prompts, self.opts.max_new_tokens, temperature=0.0 if greedy else
                       self.opts.temperature, top_p=self.opts.top_p, eos_id=self.tokenizer.eos_id,
                       stop=self._stop if self.opts.stop else None, generator=generator,
                       pad_id=self.tokenizer.pad_id, cache=cache, to_the_end=self.sharded)
        return Completions(s, [self.text(t, f) for t, f in zip(s.tokens, s.finish)])

    def text(self, tokens: list[int], finish: str) -> str:
        """What the rewards read of a completion: without its end-of-text token, cut before a stop string."""
        text = self.tokenizer.decode(tokens[:-1] if finish == "eos" else tokens)
        cuts = [i for i in (text.find(s) for s in self.opts.stop) if i >= 0]
        return text[:min(cuts)] if cuts else text


def as_completion(prompt, text: str):
    """A completion in the form of its prompt: text, or an assistant message (TRL's conversational form)."""
    return text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]


def score_completions(rewards: list[Reward], batch: PromptBatch, group: int, c: Completions) -> list[list]:
    """Each reward's values for completions ``c`` of ``batch``'s prompts, ``group`` per prompt, in order."""
    rows = [i for i in batch.index for _ in range(group)]
    p = batch.prompts
    prompts = [p.prompts[i] for i in rows]
    return score(rewards, prompts, [as_completion(q, t) for q, t in zip(prompts, c.texts)], [p.rows[i] for i in rows],
                 [p.wheres[i] for i in rows], completion_ids=c.samples.tokens)


class Rollouts:
    """The `BatchStream` of a task_type rl run: each step's completions of this rank's prompts, as the
    step's micro-batches (see the module docstring)."""

    def __init__(self, prompts: PromptStream, sampler: Sampler, rewards: list[Reward], opts: RLOptions,
                 layout: StreamLayout, dist: DistInfo, log):
        self.prompts, self.sampler, self.rewards, self.opts = prompts, sampler, rewards, opts
        self.layout, self.dist, self.log = layout, dist, log
        self.group = layout.layout.group_size  # completions per prompt, as planned
        self.tokenizer = sampler.tokenizer
        self._metrics: dict = {}
        self._generated_at: float | None = None  # when the last step's generation ended
        self._flat_said = False  # the last step was said to be flat (said once per run of flat steps)

    # -- BatchStream
    def __iter__(self):
        for batch in self.prompts:
            yield from self.rollout(batch)

    @property
    def epoch(self) -> int:
        return self.prompts.epoch

    def state_dict(self) -> dict:
        return self.prompts.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state)

    def close(self) -> None:
        self.prompts.close()

    def phase(self) -> str | None:
        return None

    def metrics(self) -> dict:
        """The last step's rollout metrics (all ranks), with its update's time: from the end of its
        generation to now — the trainer asks right after the step, once its loss is read."""
        m = dict(self._metrics)
        if m and self._generated_at is not None:
            update = time.perf_counter() - self._generated_at
            m["time/update_s"] = update
            m["time/generation_share"] = m["time/generation_s"] / max(m["time/generation_s"] + update, 1e-9)
        return m

    # -- one step
    def rollout(self, batch: PromptBatch) -> list[RLBatch]:
        """Sample, score and split one step's completions of this rank's prompts."""
        G, t0 = self.group, time.perf_counter()
        generator = step_generator(self.layout.seed, batch.step, self.layout.replica, self.dist.device)
        prompt_ids = [ids for ids in batch.ids() for _ in range(G)]
        c = self.sampler(prompt_ids, generator)
        values = score_completions(self.rewards, batch, G, c)
        totals = torch.tensor(weighted_total(self.rewards, values), dtype=torch.float64).view(-1, G)
        flat = _flat(totals)
        sampled = c.samples.tokens[:]
        if self.opts.resample_flat_groups:
            c, values, totals, resampled = self._resample(batch, c, values, totals, generator)
            sampled += resampled
        generation_s = time.perf_counter() - t0
        batch_std = self._stats(batch.step, totals, values, c, flat, sampled, generation_s)
        adv = group_advantages(totals.float(), self.opts.scale_rewards, batch_std).flatten().tolist()
        trained = [not (self.opts.mask_truncated and f == "length") for f in c.samples.finish]
        micro = self.layout.micro_batch
        out = [completion_batch(prompt_ids[i:i + micro], c.samples.tokens[i:i + micro], trained[i:i + micro],
                                adv[i:i + micro], c.samples.logprobs[i:i + micro], self.tokenizer.pad_id)
               for i in range(0, len(prompt_ids), micro)]
        self._generated_at = time.perf_counter()
        return [b.pin_memory() for b in out] if self.layout.pin_memory else out

    def _resample(self, batch: PromptBatch, c: Completions, values, totals: torch.Tensor, generator):
        """Groups scored alike sampled again, up to rl.resample_flat_groups rounds; a group that comes back
        with a signal replaces the flat one. Every rank runs as many rounds (a rank with no flat group
        samples a stand-in under FSDP, whose forwards need every rank)."""
        G, resampled = self.group, []
        for _ in range(self.opts.resample_flat_groups):
            flat = [p for p in range(totals.shape[0]) if _flat(totals[p:p + 1])]
            if not _any(bool(flat), self.dist):
                break
            if not flat and not self.sampler.sharded:
                continue
            again = PromptBatch(batch.prompts, [batch.index[p] for p in flat] or batch.index[:1], batch.step)
            new = self.sampler([ids for ids in again.ids() for _ in range(G)], generator)
            resampled += new.samples.tokens
            if not flat:
                continue
            new_values = score_completions(self.rewards, again, G, new)
            new_totals = torch.tensor(weighted_total(self.rewards, new_values), dtype=torch.float64).view(-1, G)
            for k, p in enumerate(flat):
                if _flat(new_totals[k:k + 1]):
                    continue
                totals[p] = new_totals[k]
                for i in range(G):
                    a, b = p * G + i, k * G + i
                    for v, nv in zip(values, new_values):
                        v[a] = nv[b]
                    for field in ("tokens", "logprobs", "entropy", "finish"):
                        getattr(c.samples, field)[a] = getattr(new.samples, field)[b]
                    c.texts[a] = new.texts[b]
        return c, values, totals, resampled

    def _stats(self, step: int, totals: torch.Tensor, values, c: Completions, flat_first: int, sampled: list,
               generation_s: float) -> float:
        """The step's metrics (kept for `metrics`), summed over the ranks in one all-reduce (and one for
        the maxima); returns the standard deviation of every reward of the step (all ranks)."""
        lengths = [len(t) for t in c.samples.tokens]
        entropy = [e for row in c.samples.entropy for e in row]
        r = totals.flatten()
        sums = [len(r), float(r.sum()), float((r * r).sum()), totals.shape[0], flat_first, _flat(totals),
                sum(lengths), sum(f == "length" for f in c.samples.finish), sum(entropy), len(entropy),
                sum(len(t) for t in sampled)]
        for v in values:
            given = [x for x in v if x is not None]
            sums += [len(given), sum(given), sum(x * x for x in given)]
        device = self.dist.device
        s = all_reduce_sum(torch.tensor(sums, dtype=torch.float64, device=device)).tolist()
        top = all_reduce_max(torch.tensor([max(lengths), generation_s], dtype=torch.float64, device=device)).tolist()
        n, total, total_sq, groups, flat, flat_left, length, truncated, ent, ent_n, generated = s[:11]
        mean = total / n
        m = {"train/reward": mean, "train/reward_std": _std(n, total, total_sq),
             "train/flat_groups": flat / groups, "train/completion_length": length / n,
             "train/completion_length_max": top[0], "train/truncated": truncated / n,
             "train/entropy": ent / max(ent_n, 1), "time/generation_s": top[1],
             "throughput/generation_tokens_per_s": generated / max(top[1], 1e-9)}
        if self.opts.resample_flat_groups:
            m["train/flat_groups_left"] = flat_left / groups
        for k, rw in enumerate(self.rewards):
            cnt, sm, sq = s[11 + 3 * k:14 + 3 * k]
            if cnt:
                m[f"train/reward/{rw.key}"] = sm / cnt
                m[f"train/reward_std/{rw.key}"] = _std(cnt, sm, sq)
        self._say_flat(step, flat_left == groups, mean)
        self._metrics = m
        return m["train/reward_std"]

    def _say_flat(self, step: int, all_flat: bool, mean: float) -> None:
        """One line when every group of a step is scored alike (again after a step that was not)."""
        if all_flat and not self._flat_said:
            self.log(f"warning: step {step + 1}: every group's {self.group} completions got the same reward "
                     f"(mean {mean:.3g}): no learning signal; the task is too hard or too easy for the model as it "
                     "is (a higher rl.temperature or rl.group_size, rl.resample_flat_groups, or SFT first), or the "
                     "rewards cannot tell completions apart")
        self._flat_said = all_flat


class RolloutData:
    """RL's prompts as the trainer takes them: a `TrainingData` whose stream is the rollouts of its
    prompts (completions sampled and scored: `train.rl.Rollouts`) and whose eval sets are the held-out
    prompts."""

    kind = RL_TASK

    def __init__(self, data: RLData, sampler: Sampler, rewards, opts, dist: DistInfo, log):
        self.data, self.sampler, self.rewards, self.opts, self.dist, self.log = data, sampler, rewards, opts, dist, log
        self.tokenizer_path, self.chat_template = data.tokenizer_path, data.chat_template

    def train_stream(self, layout: StreamLayout) -> Rollouts:
        return Rollouts(self.data.train_stream(layout), self.sampler, self.rewards, self.opts, layout, self.dist,
                        self.log)

    def eval_sets(self, layout: StreamLayout, max_batches: int) -> list[EvalSet]:
        return self.data.eval_sets(layout, max_batches)


def _flat(totals: torch.Tensor) -> int:
    """How many of the [P, G] groups have all their rewards alike."""
    return int(((totals.max(1).values - totals.min(1).values) <= FLAT).sum())


def _std(n: float, s: float, sq: float) -> float:
    """The sample standard deviation (n − 1, as torch's) from a count, a sum and a sum of squares."""
    return math.sqrt(max(sq - s * s / n, 0.0) / (n - 1)) if n > 1 else 0.0


def _any(flag: bool, dist: DistInfo) -> bool:
    return bool(all_reduce_max(torch.tensor([float(flag)], device=dist.device)).item())


@torch.no_grad()
def greedy_rewards(sampler: Sampler, rewards: list[Reward], batches, dist: DistInfo) -> dict:
    """The held-out reward: one greedy completion of each eval prompt, scored; summed over the ranks
    (every rank calls it). Returns the weighted reward (``reward``), each function's mean over the
    prompts it applies to (``reward/<name>``) and the prompts scored."""
    sums = [0.0] * (2 + 2 * len(rewards))  # prompts, Σ reward, then each function's count and Σ
    for batch in batches:
        c = sampler(batch.ids(), None, greedy=True)
        if not batch.scored:  # a stand-in: run with the peers, never scored
            continue
        values = score_completions(rewards, batch, 1, c)
        sums[0] += len(batch)
        sums[1] += sum(weighted_total(rewards, values))
        for k, v in enumerate(values):
            given = [x for x in v if x is not None]
            sums[2 + 2 * k] += len(given)
            sums[3 + 2 * k] += sum(given)
    s = all_reduce_sum(torch.tensor(sums, dtype=torch.float64, device=dist.device)).tolist()
    out = {"reward": s[1] / s[0] if s[0] else float("nan"), "prompts": int(s[0])}
    for k, r in enumerate(rewards):
        if s[2 + 2 * k]:
            out[f"reward/{r.key}"] = s[3 + 2 * k] / s[2 + 2 * k]
    return out
