"""Prompts of reinforcement learning (task_type rl): JSONL rows → token ids, and the stream of a step's prompts.

Rows, one prompt each, with any other columns the rewards read (`rewards.functions`)::

    {"prompt": "What is 17 + 25?", "answer": "42"}
    {"messages": [{"role": "system", "content": "…"}, {"role": "user", "content": "What is 17 + 25?"}],
     "answer": "42"}

- A string ``prompt`` is used as written (as ``instruction_finetune`` uses one): the completion
  continues it.
- ``messages`` are rendered with the tokenizer's own chat template and its generation prompt
  (`data.chat`), else lmforge's plain one — exactly as SFT renders a conversation up to the turn
  the model answers. Their rewards see the messages, and each completion as
  ``[{"role": "assistant", "content": …}]`` (TRL's conversational form).
- A prompt longer than the context leaves for its completion (``context_length −
  rl.max_new_tokens``) is cut from the left, keeping the tokenizer's BOS; cut prompts are counted
  and named in the run's first lines.

`PromptStream` gives each rank its prompts of each step (a `PromptBatch`), in a seeded order that
is a pure function of the step (as `data.sft.SFTStream`'s rows): a resumed run continues with the
prompts it would have had. The trainer samples and scores their completions (`train.rl`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from lmforge.config.schema import RL_TASK
from lmforge.data.batch import IGNORE, Batch, EpochOrder, EvalSet, StreamLayout
from lmforge.data.chat import ASSISTANT_HEADER, CHAT_TEMPLATE, render_chat
from lmforge.data.rows.sft import ROLES, json_rows
from lmforge.errors import UserError

PROMPT_ROWS = "prompt (or messages) rows"
NAMED = 3  # rows named in a log line; the rest are counted


# --------------------------------------------------------------------------- reading rows

def _messages(msgs, where: str, template) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise UserError(f"{where}: field 'messages' must be a non-empty list of {{role, content}}")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise UserError(f"{where}: messages[{j}] needs 'role' and 'content' (strings)")
        if template is None and m["role"] not in ROLES:
            raise UserError(f"{where}: messages[{j}].role {m['role']!r} is unknown; expected one of {', '.join(ROLES)}")
    if msgs[-1]["role"] == "assistant":
        raise UserError(f"{where}: the last message is the assistant's; a prompt ends with the turn the completion "
                        "answers (leave the answer in another column, e.g. 'answer')")
    return msgs


def prompt_ids(row, where: str, tokenizer, template=None) -> tuple[list[int], object]:
    """Validate one row; its prompt's token ids and the prompt as the rewards see it (text or messages)."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object with a prompt (or messages) and the columns the rewards read")
    if "messages" in row:
        msgs = _messages(row["messages"], where, template)
        if template is not None:  # the template writes its own special tokens
            text = template.render(msgs, add_generation_prompt=True, where=where)
            return list(tokenizer.backend.encode(text, add_special_tokens=False).ids), msgs
        ids = list(tokenizer.prefix_ids)
        for text, answered in render_chat(msgs):
            ids += tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_id] if answered else [])
        return ids + tokenizer.encode(ASSISTANT_HEADER, add_special_tokens=False), msgs
    if "prompt" not in row:
        hint = " (prompt/chosen/rejected rows are for task_type preference)" if "chosen" in row else ""
        raise UserError(f"{where}: missing field 'prompt' (each row needs a prompt or messages){hint}")
    prompt = row["prompt"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise UserError(f"{where}: field 'prompt' must be a non-empty string (or give messages)")
    return list(tokenizer.prefix_ids) + tokenizer.encode(prompt, add_special_tokens=False), prompt


@dataclass
class PromptSet:
    """Prompts as token ids, with what the rewards see of each row: the prompt (text or messages), the
    row's other columns, and where it is (``file:line``)."""

    ids: list[list[int]]
    prompts: list
    rows: list[dict]
    wheres: list[str]
    cut: list[str] = field(default_factory=list)  # where the prompts cut from the left are

    def __len__(self) -> int:
        return len(self.ids)


def load_prompts(paths: list[str], tokenizer, max_prompt_tokens: int, template=None) -> PromptSet:
    """Every row of every file; a prompt longer than ``max_prompt_tokens`` is cut from the left (its
    first ``len(tokenizer.prefix_ids)`` tokens, a BOS, kept). The first bad row stops with its file:line."""
    keep_first = len(tokenizer.prefix_ids)
    out = PromptSet([], [], [], [])
    for row, where in json_rows(paths, PROMPT_ROWS):
        ids, prompt = prompt_ids(row, where, tokenizer, template)
        if len(ids) > max_prompt_tokens:
            if max_prompt_tokens <= keep_first:
                raise UserError(f"{where}: no room for a prompt: parameters.context_length minus rl.max_new_tokens "
                                f"leaves {max_prompt_tokens} token(s)")
            ids = ids[:keep_first] + ids[len(ids) - (max_prompt_tokens - keep_first):]
            out.cut.append(where)
        out.ids.append(ids)
        out.prompts.append(prompt)
        out.rows.append(row)
        out.wheres.append(where)
    if not out.ids:
        raise UserError(f"{', '.join(paths)}: no prompts (expected JSONL {PROMPT_ROWS})")
    return out


def _named(wheres: list[str]) -> str:
    more = len(wheres) - NAMED
    return ", ".join(wheres[:NAMED]) + (f" and {more} more" if more > 0 else "")


# --------------------------------------------------------------------------- what a step trains on

@dataclass
class RLBatch(Batch):
    """A micro-batch of completions to train on: each row a prompt and one of its completions,
    right-padded (plain causal attention is exact for every real token; padding is never trained),
    targets on the completion's tokens only, with what the policy loss needs besides the policy's own
    log-probs: each completion's advantage, the log-probs its sampler gave, and — filled on the step's
    first update and reused by the next ones — the log-probs of the weights that sampled it (π_old)
    and of the reference (a KL penalty)."""

    advantages: torch.Tensor | None = None  # [B] fp32
    sampler_logp: torch.Tensor | None = None  # [B, T] fp32 at the positions whose target is a completion token
    old_logp: torch.Tensor | None = None  # [B, T] fp32
    ref_logp: torch.Tensor | None = None  # [B, T] fp32

    def _map(self, fn) -> "RLBatch":
        def f(t):
            return None if t is None else fn(t)

        return RLBatch(f(self.input_ids), f(self.targets), f(self.doc_ids), advantages=f(self.advantages),
                       sampler_logp=f(self.sampler_logp), old_logp=f(self.old_logp), ref_logp=f(self.ref_logp))

    def to(self, device: torch.device, non_blocking: bool = True) -> "RLBatch":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "RLBatch":
        return self._map(lambda t: t.pin_memory())

    def mask(self) -> torch.Tensor:
        """[B, T] 1.0 at the positions trained (their target is a completion token), else 0."""
        return (self.targets != IGNORE).float()


def completion_batch(prompts: list[list[int]], completions: list[list[int]], trained: list[bool],
                     advantages: list[float], sampler_logp: list[list[float]], pad_id: int) -> RLBatch:
    """Rows ``prompt + completion`` right-padded to the longest; the completion's tokens are the targets
    (of the completions ``trained``: a masked one has none)."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    n = len(prompts)
    tokens = torch.full((n, width), pad_id, dtype=torch.long)
    targets = torch.full((n, width), IGNORE, dtype=torch.long)
    logp = torch.zeros((n, width), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        row = p + c
        tokens[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        if trained[i] and c:  # position t predicts token t + 1: the last prompt token predicts the first
            targets[i, len(p) - 1:len(row) - 1] = torch.tensor(c, dtype=torch.long)
            logp[i, len(p) - 1:len(row) - 1] = torch.tensor(sampler_logp[i], dtype=torch.float32)
    return RLBatch(tokens, targets, advantages=torch.tensor(advantages, dtype=torch.float32), sampler_logp=logp)


# --------------------------------------------------------------------------- a step's prompts

@dataclass
class PromptBatch:
    """Prompts of one rank: rows ``index`` of ``prompts``. ``step``: the step they are for (what the
    sampler's random numbers are drawn from); ``scored``: False for a stand-in that a rank whose
    held-out prompts ran out runs with its peers (under FSDP every rank takes part in each forward)."""

    prompts: PromptSet
    index: list[int]
    step: int = 0
    scored: bool = True

    def __len__(self) -> int:
        return len(self.index)

    def ids(self) -> list[list[int]]:
        return [self.prompts.ids[i] for i in self.index]


class PromptStream:
    """Each step's prompts of this rank, one `PromptBatch` per step: global prompt k of the run is row
    ``EpochOrder(N, seed)(k)`` (a seeded permutation per epoch, `data.batch`); replica r of a step
    takes its ``per_replica`` consecutive ones. Resumable at a step boundary."""

    def __init__(self, prompts: PromptSet, layout: StreamLayout):
        self.prompts, self.seed, self.layout = prompts, layout.seed, layout.layout
        self.replica = layout.replica
        self.steps = 0  # steps this rank has read
        self._row = EpochOrder(len(prompts), self.seed)

    def __iter__(self):
        while True:
            per = self.layout.per_replica
            start = self.steps * self.layout.global_batch + self.replica * per
            batch = PromptBatch(self.prompts, [self._row(k) for k in range(start, start + per)], step=self.steps)
            self.steps += 1
            yield batch

    @property
    def epoch(self) -> int:
        return self.steps * self.layout.global_batch // len(self.prompts)

    def state_dict(self) -> dict:
        return {"kind": RL_TASK, "steps": self.steps, "prompts": len(self.prompts)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != RL_TASK or state.get("prompts") != len(self.prompts):
            raise UserError("checkpoint: its data position belongs to different prompts "
                            f"({state.get('prompts')} then, {len(self.prompts)} now); --no-autoresume starts fresh")
        self.steps = int(state["steps"])

    def close(self) -> None:
        pass

    def phase(self) -> str | None:
        return None

    def metrics(self) -> dict:
        return {}


def eval_prompt_batches(prompts: PromptSet, layout: StreamLayout, max_batches: int, chunk: int):
    """Each held-out prompt once (replica r of W takes rows r, r+W, ...), ``chunk`` prompts at a time, at
    most ``max_batches`` chunks per rank. Every rank yields as many chunks: one whose prompts ran out
    yields a stand-in (``scored=False``)."""
    mine = list(range(layout.replica, len(prompts), layout.replicas))
    per_rank = -(-len(prompts) // layout.replicas)
    for b in range(min(max_batches, -(-per_rank // chunk))):
        idx = mine[b * chunk:(b + 1) * chunk]
        yield PromptBatch(prompts, idx) if idx else PromptBatch(prompts, [0], scored=False)


@dataclass
class RLData:
    """Prompts (and held-out prompts) of a run: a `TrainingData` of kind ``"rl"``. Its stream gives
    prompts, not batches to train on: the objective of this kind (`train.rl`) samples and scores
    their completions."""

    tokenizer_path: str
    prompts: PromptSet
    eval_prompts: PromptSet | None
    chat_template: str | None = CHAT_TEMPLATE
    kind: str = RL_TASK
    tokenizer: object = None  # the run's `Tokenizer` (the completions are decoded for the rewards)
    eval_chunk: int = 64  # held-out prompts generated for at once (greedy: one completion each)
    rewards: tuple = ()  # the run's `Reward`s, loaded once at resolution (a user's file runs once)

    def train_stream(self, layout: StreamLayout) -> PromptStream:
        return PromptStream(self.prompts, layout)

    def eval_sets(self, layout: StreamLayout, max_batches: int) -> list[EvalSet]:
        if self.eval_prompts is None:
            return []
        return [EvalSet("eval", partial(eval_prompt_batches, self.eval_prompts, layout, max_batches, self.eval_chunk))]


def load_rl_data(train_paths: list[str], eval_path: str | None, tokenizer, max_prompt_tokens: int, *, template=None,
                 chat_template: str | None = CHAT_TEMPLATE, log=print) -> RLData:
    """The train (and held-out) prompts of a run; one log line about them."""
    prompts = load_prompts(train_paths, tokenizer, max_prompt_tokens, template)
    held = load_prompts([eval_path], tokenizer, max_prompt_tokens, template) if eval_path else None
    cut = prompts.cut + (held.cut if held is not None else [])
    lengths = [len(i) for i in prompts.ids]
    log(f"data: {len(prompts)} prompts of {min(lengths)}–{max(lengths)} tokens"
        + (f"; {len(held)} held-out prompts" if held is not None else "")
        + (f"; {len(cut)} cut from the left to {max_prompt_tokens} tokens ({_named(cut)})" if cut else ""))
    return RLData(tokenizer.path, prompts, held, chat_template=chat_template, tokenizer=tokenizer)
