"""Reinforcement learning (task_type rl): the rewards and their errors as one line, answer
extraction, the loss family against the papers' formulas written out as loops, the batched sampler
(its KV cache against recomputing everything), the planner's batch split, the prompts and their
stream; a tiny run whose printed numbers are recomputed from its metrics.jsonl; a killed run that
resumes to the same weights; two FSDP ranks."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import REPO
from lmforge.config.load import build_config
from lmforge.config.model import ModelConfig
from lmforge.config.schema import RunConfig
from lmforge.errors import UserError
from lmforge.models import build_model, save_pretrained
from lmforge.models.generate import generate
from lmforge.models.generate import filter_logits, sample
from lmforge.models.policy_loss import aggregate, group_advantages, policy_terms, row_units
from lmforge.rewards.answers import final_answer, same_answer
from lmforge.rewards.functions import RewardError, check_columns, load_rewards, score, weighted_total
from train_helpers import (assert_one_line_error, cli, final_weights, lmforge, metrics, set_dotted,
                           train_in_process, write_config)

SMALL = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=64, vocab_size=512)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------------------- answers and rewards

def test_the_final_answer_is_found_the_usual_ways():
    assert final_answer(r"so it is \boxed{\frac{3}{4}} and \boxed{x^{2}+1}") == "x^{2}+1"  # the last, braces nested
    assert final_answer("Natalia sold 48/2 = 24 clips in May.\n#### 72") == "72"  # GSM8K's answer line
    assert final_answer("The answer is #### 1,000.") == "1,000"
    assert final_answer("we get 3 apples, then 12.5 more.") == "12.5"  # else the last number
    assert final_answer("no number here") is None and final_answer(r"\boxed{never closed") is None
    assert same_answer("1,000", "1000.0") and same_answer("$72", "72") and same_answer("3/4", "0.75")
    assert same_answer(r"\frac{3}{4}", "0.75") and same_answer("-5", "-5.00") and not same_answer("72", "27")
    assert same_answer("x^{2}+1", "x^{2} + 1") and not same_answer(None, "1")
    huge = "9" * 400 + "/7"  # past a float's range: compared exactly, never an error
    assert same_answer(huge, huge) and not same_answer(huge, "1")


def test_built_in_rewards_follow_trls_signature():
    exact, math_, fmt = load_rewards(["exact_match", "math", "format"], [1.0, 2.0, 0.5], r"^\s*\d+\s*$")
    completions = [" 42", "It is 40 + 2 = 42.", "41", [{"role": "assistant", "content": "#### 42"}]]
    answers = ["42", "Work: 40 + 2.\n#### 42", "42", "42"]  # a GSM8K answer's final line counts
    values = score([exact, math_, fmt], ["p"] * 4, completions, [{"answer": a} for a in answers],
                   [f"t.jsonl:{i}" for i in range(1, 5)])
    assert values == [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 0.0]]
    assert weighted_total([exact, math_, fmt], values) == [3.5, 2.0, 0.5, 2.0]
    assert [r.key for r in (exact, math_, fmt)] == ["exact_match", "math", "format"]


def test_a_users_reward_gets_the_columns_and_none_means_not_applicable(tmp_path):
    (tmp_path / "rw.py").write_text(
        "def length_bonus(prompts, completions, target_len, **kwargs):\n"
        "    ids = kwargs['completion_ids']\n"
        "    return [None if t is None else float(len(c) == t) for c, t in zip(completions, target_len)]\n")
    rw, exact = load_rewards([f"{tmp_path}/rw.py:length_bonus", "exact_match"], [2.0, 1.0])
    assert rw.key == "length_bonus" and rw.needs == ("target_len",)
    rows = [{"prompt": "a", "answer": "ab", "target_len": 2}, {"prompt": "b", "answer": "x", "target_len": None}]
    values = score([rw, exact], ["a", "b"], ["ab", "xyz"], rows, ["f:1", "f:2"], completion_ids=[[1], [2]])
    assert values == [[1.0, None], [1.0, 0.0]] and weighted_total([rw, exact], values) == [3.0, 0.0]


BAD_REWARDS = [
    ("raises", "def f(prompts, completions, **kw):\n    return [1 / (len(c) - 3) for c in completions]\n",
     ["rl.reward", "rw.py:f raised ZeroDivisionError", "on the completion of t.jsonl:2"]),
    ("length", "def f(prompts, completions, **kw):\n    return [1.0]\n",
     ["rl.reward", "rw.py:f returned 1 values for 3 completions", "t.jsonl:1 … t.jsonl:3"]),
    ("nan", "def f(prompts, completions, **kw):\n    return [0.0, float('nan'), 1.0]\n",
     ["rw.py:f returned nan for the completion of t.jsonl:2"]),
    ("text", "def f(prompts, completions, **kw):\n    return ['yes', 0.0, 1.0]\n",
     ["rw.py:f returned 'yes' (str) for the completion of t.jsonl:1", "expected a float or None"]),
    ("overflow", "def f(prompts, completions, **kw):\n    return [10 ** 400, 0.0, 1.0]\n",
     ["rw.py:f returned 1000", "for the completion of t.jsonl:1", "expected a float or None"]),
    ("generator", "def f(prompts, completions, **kw):\n    for c in completions:\n        yield 1 / (len(c) - 3)\n",
     ["rw.py:f raised ZeroDivisionError", "t.jsonl:1 … t.jsonl:3"]),
    ("column", "def f(prompts, completions, solution, **kw):\n    return [0.0] * len(completions)\n",
     ["rl.reward", "rw.py:f: needs column 'solution', which t.jsonl:1 lacks"]),
]


@pytest.mark.parametrize("case,code,needles", BAD_REWARDS, ids=[c[0] for c in BAD_REWARDS])
def test_a_reward_that_cannot_score_is_one_line_naming_it_and_the_row(tmp_path, case, code, needles):
    (tmp_path / "rw.py").write_text(code)
    (rw,) = load_rewards([f"{tmp_path}/rw.py:f"])
    with pytest.raises(RewardError) as e:
        score([rw], ["p"] * 3, ["abc", "abc", "abcd"][:3] if case != "raises" else ["ab", "abc", "a"],
              [{"prompt": "p"}] * 3, ["t.jsonl:1", "t.jsonl:2", "t.jsonl:3"])
    line = str(e.value)
    assert "\n" not in line, line
    for needle in needles:
        assert needle in line, (needle, line)


def test_a_reward_file_that_does_not_load_and_a_missing_answer_are_one_line(tmp_path):
    (tmp_path / "broken.py").write_text("def f(:\n")
    (tmp_path / "ok.py").write_text("x = 1\n")
    for spec, needle in ((f"{tmp_path}/missing.py:f", "missing.py: no such file"),
                         (f"{tmp_path}/broken.py:f", "broken.py cannot be imported (SyntaxError"),
                         (f"{tmp_path}/ok.py:f", "ok.py defines no function 'f'")):
        with pytest.raises(UserError, match="^rl.reward: .*" + needle.replace("(", r"\(")):
            load_rewards([spec])
    with pytest.raises(RewardError, match=r"rl.reward math: needs column 'answer', which v.jsonl:2 lacks"):
        check_columns(load_rewards(["math"]), [{"answer": "1"}, {"prompt": "x"}], ["v.jsonl:1", "v.jsonl:2"])


BAD_CONFIG = [
    ({}, "rl.reward: task_type rl needs at least one reward"),
    ({"reward": ["nope"]}, "rl.reward: 'nope' is not a reward"),
    ({"reward": ["format"]}, "the format reward needs rl.format_regex"),
    ({"reward": ["math"], "reward_weights": [1, 2]}, "2 rl.reward_weights for 1 reward(s)"),
    ({"reward": ["math"], "group_size": 1}, "rl.group_size"),
    ({"reward": ["math"], "clip": [1.5, 0.2]}, "rl.clip: expected [low, high] with 0 ≤ low < 1"),
    ({"reward": ["math"], "loss": "ppo"}, "rl.loss"),
    ({"reward": ["math"], "scale_rewards": "all"}, "rl.scale_rewards"),
    ({"reward": ["math"], "temperature": 0}, "rl.temperature"),
    ({"reward": ["math"], "top_p": 1.5}, "rl.top_p"),
    ({"reward": ["math"], "stop": [""]}, "rl.stop: a stop string is empty"),
    ({"reward": ["math"], "kl": -1}, "rl.kl"),
    ({"reward": ["math"], "updates_per_batch": 0}, "rl.updates_per_batch"),
    ({"reward": ["math"], "engine": "sglang"}, "rl.engine"),
    ({"reward": ["math", "math"]}, "rl.reward: a reward is listed twice"),
    ({"reward": ["format"], "format_regex": "("}, "rl.format_regex: '(' is not a regular expression"),
]


@pytest.mark.parametrize("rl,needle", BAD_CONFIG, ids=[n.split(":")[0] + str(i) for i, (_, n) in enumerate(BAD_CONFIG)])
def test_bad_rl_settings_are_one_line(rl, needle):
    base = {"model": "llama-tiny", "train_data": "p.jsonl", "training_duration": "1ba", "task_type": "rl"}
    with pytest.raises(UserError) as e:
        build_config(base | {"rl": rl})
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(UserError, match="rl: applies to task_type rl"):
        build_config(base | {"task_type": "preference", "rl": {"reward": ["math"]}})
    with pytest.raises(UserError, match="task_type rl counts prompts per step"):
        build_config(base | {"rl": {"reward": ["math"]}, "parameters": {"global_batch_size": "1M tok"}})


# --------------------------------------------------------------------------- the loss family

def paper_advantages(rewards: np.ndarray, scale: str) -> np.ndarray:
    out = np.zeros_like(rewards)
    for p in range(rewards.shape[0]):
        for i in range(rewards.shape[1]):
            out[p, i] = rewards[p, i] - rewards[p].mean()
            if scale == "group":
                out[p, i] /= rewards[p].std(ddof=1) + 1e-4
            elif scale == "batch":
                out[p, i] /= rewards.std(ddof=1) + 1e-4
    return out


def paper_loss(kind: str, logp, old, mask, adv, low: float, high: float, ref=None, beta: float = 0.0,
               max_new: int = 0) -> float:
    """The papers' objectives (negated), one loop per sum: GRPO (Shao et al. 2024, eq. 3), DAPO (Yu et
    al. 2025, eq. 8), Dr. GRPO (Liu et al. 2025), GSPO (Zheng et al. 2025, eq. 5-7); k3 = e^q − q − 1."""
    B, T = logp.shape

    def clip(x):
        return min(max(x, 1 - low), 1 + high)

    def kl(b, t):
        q = ref[b, t] - logp[b, t]
        return math.exp(q) - q - 1

    if kind == "gspo":
        total = 0.0
        for b in range(B):
            ts = [t for t in range(T) if mask[b, t]]
            s = math.exp(sum(logp[b, t] - old[b, t] for t in ts) / max(len(ts), 1))
            term = -min(s * adv[b], clip(s) * adv[b])
            if beta:
                term += beta * sum(kl(b, t) for t in ts) / max(len(ts), 1)
            total += term
        return total / B
    loss = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            r = math.exp(logp[b, t] - old[b, t])
            loss[b][t] = -min(r * adv[b], clip(r) * adv[b]) + (beta * kl(b, t) if beta else 0.0)
    if kind == "grpo":
        per_seq = []
        for b in range(B):
            n = sum(mask[b, t] for t in range(T))
            per_seq.append(sum(loss[b][t] * mask[b, t] for t in range(T)) / max(n, 1))
        return sum(per_seq) / B
    tokens = sum(loss[b][t] * mask[b, t] for b in range(B) for t in range(T))
    if kind == "dapo":
        return tokens / sum(mask[b, t] for b in range(B) for t in range(T))
    assert kind == "dr_grpo"
    return tokens / (B * max_new)


@pytest.mark.parametrize("kind", ["grpo", "dapo", "dr_grpo", "gspo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_each_loss_equals_its_papers_formula(kind, beta):
    """On completions of unequal lengths, with π ≠ π_old (a later update of μ) so that clipping acts,
    split into two micro-batches as the trainer splits a step: Σ aggregate / Σ units is the paper's."""
    g = torch.Generator().manual_seed(3)
    B, T, max_new = 6, 7, 9
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = [7, 3, 5, 1, 6, 4]
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths], dtype=torch.float64)
    rewards = torch.tensor([[1.0, 0.0, 0.5], [0.0, 0.0, 1.0]], dtype=torch.float64)
    adv = group_advantages(rewards, "group").flatten()
    clip = (0.2, 0.28) if kind != "gspo" else (0.01, 0.02)
    loss_sum, units = 0.0, 0.0
    for part in (slice(0, 4), slice(4, 6)):
        terms = policy_terms(kind, logp[part], old[part], mask[part], adv[part], clip=clip,
                             ref_logp=ref[part] if beta else None, beta=beta)
        loss_sum += float(aggregate(kind, terms, mask[part], max_new))
        units += float(row_units(kind, mask[part], max_new).sum())
    expected = paper_loss(kind, logp.numpy(), old.numpy(), mask.numpy(), adv.numpy(), *clip,
                          ref=ref.numpy(), beta=beta, max_new=max_new)
    assert loss_sum / units == pytest.approx(expected, rel=1e-9, abs=1e-12)
    clipped = policy_terms(kind, logp, old, mask, adv, clip=clip).clipped
    assert 0 < float(clipped.sum()) < clipped.numel()  # the case exercises both sides of the clip


@pytest.mark.integration  # importing TRL's trainers takes seconds
@pytest.mark.parametrize("kind", ["grpo", "dapo", "dr_grpo", "gspo"])
def test_each_loss_equals_trls(kind):
    """The same batch through TRL's own `GRPOTrainer._compute_loss` (its loss types; GSPO as TRL runs it:
    sequence-level importance sampling under the grpo aggregation), the policy's log-probs handed to it
    as its model's."""
    pytest.importorskip("trl")
    from collections import defaultdict

    from trl import GRPOTrainer

    g = torch.Generator().manual_seed(7)
    B, T, max_new = 6, 7, 9
    old = -torch.rand(B, T, generator=g) * 3
    logp = old + 0.3 * torch.randn(B, T, generator=g)
    ref = old + 0.2 * torch.randn(B, T, generator=g)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in (7, 3, 5, 1, 6, 4)])
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.5], [0.0, 0.0, 1.0]]), "group").flatten()
    clip, beta = ((0.2, 0.28) if kind != "gspo" else (0.01, 0.02)), 0.04
    terms = policy_terms(kind, logp, old, mask, adv, clip=clip, ref_logp=ref, beta=beta)
    ours = aggregate(kind, terms, mask, max_new) / row_units(kind, mask, max_new).sum()
    same = lambda x, **_: x  # noqa: E731 - one process: gathering and reducing change nothing
    trl_self = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, beta=beta, loss_type="grpo" if kind == "gspo" else kind,
        importance_sampling_level="sequence" if kind == "gspo" else "token", epsilon_low=clip[0], epsilon_high=clip[1],
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        use_vllm=False, vllm_importance_sampling_correction=False, model=SimpleNamespace(training=False),
        max_completion_length=max_new, current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False,
        aux_loss_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
        accelerator=SimpleNamespace(num_processes=1, gather=same, reduce=same, gather_for_metrics=same, sync_gradients=True))
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask, "advantages": adv,
              "old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()}
    theirs = GRPOTrainer._compute_loss(trl_self, None, inputs)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_the_formula(scale):
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.2, 0.2, 0.2, 0.2], [3.0, 1.0, 2.0, 0.0]], dtype=torch.float64)
    batch_std = float(rewards.std()) if scale == "batch" else None
    got = group_advantages(rewards, scale, batch_std).numpy()
    np.testing.assert_allclose(got, paper_advantages(rewards.numpy(), scale), rtol=1e-12)
    assert (got[1] == 0).all()  # a flat group teaches nothing


def test_on_the_first_update_the_ratio_is_one_and_the_gradient_is_the_policy_gradient():
    """μ = 1: π_old is π itself (detached): every ratio is 1, nothing is clipped, and the gradient of the
    DAPO loss is −A·m/Σm on each token's log-prob (REINFORCE with a group baseline)."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, -4.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([0.7, -1.2])
    terms = policy_terms("dapo", logp, logp.detach(), mask, adv, clip=(0.2, 0.28))
    (aggregate("dapo", terms, mask, 3) / row_units("dapo", mask, 3).sum()).backward()
    assert float(terms.clipped.sum()) == 0
    torch.testing.assert_close(logp.grad, -adv[:, None] * mask / mask.sum())


# --------------------------------------------------------------------------- the sampler

@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return build_model(SMALL.model_copy(update={"vocab_size": 97}))


def test_the_kv_cache_samples_what_recomputing_everything_does(tiny_model):
    """Greedy: the batched sampler with its KV cache (left-padded prompts, the padding masked), without
    it, and `generate` one prompt at a time all write the same tokens; a seeded generator draws the same
    samples twice; a row ends at the end-of-text token or a stop, the others run on."""
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11]]
    cached = sample(tiny_model, prompts, 12, temperature=0)
    assert cached.tokens == sample(tiny_model, prompts, 12, temperature=0, cache=False).tokens
    assert cached.tokens == [generate(tiny_model, p, 12, temperature=0) for p in prompts]
    assert cached.finish == ["length"] * 3 and all(len(t) == 12 for t in cached.tokens)
    with torch.no_grad():  # each token's log-probability: the model's own, recomputed over the whole row
        logp = torch.log_softmax(tiny_model(torch.tensor([prompts[0] + cached.tokens[0]])).float(), dim=-1)[0]
    want = [float(logp[len(prompts[0]) - 1 + i, t]) for i, t in enumerate(cached.tokens[0])]
    assert cached.logprobs[0] == pytest.approx(want, abs=1e-4)

    def draw(**kw):
        return sample(tiny_model, prompts, 10, temperature=1.0, top_p=0.9,
                      generator=torch.Generator().manual_seed(5), **kw)

    a = draw()
    assert a.tokens == draw().tokens
    eos = a.tokens[1][2]  # the second row's third token, made the end of text: that row ends there
    ended = draw(eos_id=eos)
    assert ended.finish[1] == "eos" and ended.tokens[1] == a.tokens[1][:3]
    stopped = draw(stop=lambda toks: len(toks) == 4)
    assert stopped.finish == ["stop"] * 3 and all(len(t) == 4 for t in stopped.tokens)
    run_on = draw(stop=lambda toks: len(toks) == 4, to_the_end=True)
    assert run_on.steps == 10 and run_on.tokens == stopped.tokens


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.9, 0.05, 0.03, 0.02]]))
    kept = filter_logits(logits, 1.0, None, 0.8).isfinite()
    assert kept.tolist() == [[True, True, False, False], [True, False, False, False]]


# --------------------------------------------------------------------------- the plan

def _rl_config(**over) -> RunConfig:
    raw = {"model": SMALL.model_dump(), "train_data": "p.jsonl", "training_duration": "10ba", "task_type": "rl",
           "custom_weights_path": None, "rl": {"reward": ["math"], "group_size": 4, "max_new_tokens": 16},
           "parameters": {"global_batch_size": 6, "context_length": 64}}
    for key, value in over.items():
        node = raw
        *parents, last = key.split(".")
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = value
    return build_config(raw)


def test_the_plan_counts_prompts_and_splits_their_completions():
    """global_batch_size counts prompts; each rank samples group_size completions of its own; the
    update's micro-batches split the completions (a CPU's: the largest divisor up to 8)."""
    from lmforge.plan.layout import Layout
    from lmforge.plan.machine import nominal_machine
    from lmforge.plan.run import make_plan

    plan = make_plan(_rl_config(), nominal_machine("cpu", 2), samples_per_epoch=60, data_seq_len=64)
    layout = plan.layout
    assert (layout.global_batch, layout.group_size, layout.per_replica, layout.sequences) == (6, 4, 3, 24)
    assert (layout.micro_batch, layout.grad_accum) == (6, 2) and plan.tokens_per_step == 24 * 64
    assert make_plan(_rl_config(training_duration="2ep"), nominal_machine("cpu", 2), samples_per_epoch=60,
                     data_seq_len=64).total_steps == 20  # an epoch is every prompt once
    with pytest.raises(ValueError, match="unchecked split"):
        Layout(ranks=2, global_batch=3, micro_batch=1, group_size=4)
    for over, needle in (({"parameters.global_batch_size": 5}, "global_batch_size (5 prompts) must be divisible by "
                          "the number of ranks (2): each rank samples the completions of its own prompts"),
                         ({"parameters.micro_batch_size": 5}, "micro_batch_size (5) × ranks (2) = 10 must divide the "
                          "completions of a step: parameters.global_batch_size (6) × rl.group_size (4) = 24"),
                         ({"rl.max_new_tokens": 64}, "rl.max_new_tokens (64) leaves no room for a prompt"),
                         ({"compute.context_parallel": 2, "compute.data_parallel": "fsdp"},
                          "compute.context_parallel: the policy samples and scores whole completions"),
                         ({"rl.kl": 0.1, "compute.data_parallel": "fsdp"}, "rl.kl: the reference of full fine-tuning"),
                         ({"rl.engine": "vllm"}, "rl.engine: vllm needs CUDA and the vllm extra")):
        with pytest.raises(UserError) as e:
            make_plan(_rl_config(**over), nominal_machine("cpu", 2), samples_per_epoch=60, data_seq_len=64)
        assert needle in str(e.value), (needle, str(e.value))


# --------------------------------------------------------------------------- prompts and their stream

def test_prompts_are_rendered_cut_from_the_left_and_streamed_by_step(tmp_path, tiny_data):
    from lmforge.data.batch import StreamLayout
    from lmforge.data.chat import ASSISTANT_HEADER
    from lmforge.data.rows.rl import PromptStream, completion_batch, load_prompts
    from lmforge.data.text.tokenizer import load_tokenizer
    from lmforge.plan.layout import Layout

    tok = load_tokenizer(tiny_data.tokenizer)
    rows = [{"prompt": "def add(a, b):", "answer": "x"},
            {"messages": [{"role": "user", "content": "2 + 2?"}], "answer": "4"},
            {"prompt": "".join(f"line {i}\n" for i in range(40)) + "last", "answer": "y"}]
    p = load_prompts([str(write_jsonl(tmp_path / "p.jsonl", rows))], tok, 40)
    assert p.ids[0] == tok.prefix_ids + tok.encode("def add(a, b):", add_special_tokens=False)
    assert tok.decode(p.ids[1]).endswith(ASSISTANT_HEADER) and p.prompts[1] == rows[1]["messages"]
    assert len(p.ids[2]) == 40 and tok.decode(p.ids[2]).endswith("last") and p.cut == [f"{tmp_path}/p.jsonl:3"]
    for bad, needle in (({"chosen": "a", "rejected": "b"}, "missing field 'prompt'"),
                        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
                         "the last message is the assistant's")):
        with pytest.raises(UserError, match=needle):
            load_prompts([str(write_jsonl(tmp_path / "bad.jsonl", [bad]))], tok, 24)

    layout = Layout(ranks=2, global_batch=4, micro_batch=4, group_size=2)
    streams = [PromptStream(p, StreamLayout(seq_len=64, layout=layout, rank=r, seed=1)) for r in range(2)]
    steps = [[next(iter(s)) for _ in range(3)] for s in streams]
    firsts = [b.index for b in steps[0]] + [b.index for b in steps[1]]
    assert all(len(i) == 2 for i in firsts) and [b.step for b in steps[0]] == [0, 1, 2]
    assert set(steps[0][0].index + steps[1][0].index) == {0, 1, 2}  # a step's 4 prompts: the whole epoch and one
    again = PromptStream(p, StreamLayout(seq_len=64, layout=layout, rank=1, seed=1))
    again.load_state_dict(streams[1].state_dict())
    # resumed at step 3, it reads what the stream it stands for reads next (across the epoch's end)
    assert again.steps == 3 and next(iter(again)).index == next(iter(streams[1])).index
    # a row of prompt + completion: the completion's tokens are the targets, padding never is
    b = completion_batch([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], [True, False], [0.5, -0.5],
                         [[-0.1, -0.2], [-0.3, -0.4, -0.5]], pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 9, 10], [8, 11, 12, 13, 0]]
    assert b.targets.tolist() == [[-100, -100, 9, 10, -100], [-100] * 5]  # the second is masked (truncated)
    assert b.sampler_logp[0].tolist() == pytest.approx([0, 0, -0.1, -0.2, 0])


# --------------------------------------------------------------------------- runs

@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_data):
    """The starting weights: a freshly initialized tiny model with the session's tokenizer."""
    folder = tmp_path_factory.mktemp("rl-base") / "base"
    torch.manual_seed(0)
    save_pretrained(build_model(SMALL), SMALL, folder, tokenizer_dir=tiny_data.tokenizer)
    return folder


REWARD_FILE = """\
def variety(prompts, completions, **kwargs):
    # distinct characters, a tenth each: random completions differ, so groups are not flat
    return [len(set(c)) / 10 for c in completions]
"""


def rl_config(tmp_path, weights, name="rl", **extra) -> dict:
    rows = [{"prompt": f"def f{i}(x):\n    return", "answer": f" x + {i}"} for i in range(24)]
    (tmp_path / "rw.py").write_text(REWARD_FILE)
    cfg = {"name": f"rl-{name}-{abs(hash(str(tmp_path))) % 10**8}", "custom_weights_path": str(weights),
           "task_type": "rl", "train_data": str(write_jsonl(tmp_path / "train.jsonl", rows[:18])),
           "training_duration": "4ba", "save_interval": "2ba", "save_folder": str(tmp_path / name), "log_interval": 1,
           "rl": {"reward": ["exact_match", f"{tmp_path}/rw.py:variety", "format"], "reward_weights": [1.0, 0.5, 2.0],
                  "format_regex": "e", "group_size": 4, "max_new_tokens": 6, "stop": ["\n"]},
           "parameters": {"global_batch_size": 4, "micro_batch_size": 8, "learning_rate": 1e-3,
                          "context_length": 32, "warmup": "1ba", "precision": "fp32"},
           "eval": {"data_path": str(write_jsonl(tmp_path / "val.jsonl", rows[18:])), "interval": "2ba"},
           "experiment_tracker": {"mlflow": None, "console": True}}
    set_dotted(cfg, extra)
    return cfg


@pytest.mark.integration
def test_a_tiny_run_logs_its_rollouts_and_every_printed_number_is_in_its_metrics(tmp_path, base):
    """`lmforge finetune` of a tiny RL run: per step the reward of each function and their weighted sum,
    flat groups, completion lengths, truncation, clip fraction, entropy, the sampler's log-probs against
    the trainer's, generation and update time; the held-out greedy reward at each evaluation. What the
    console, `runs describe` and the report show is recomputed from metrics.jsonl."""
    raw = rl_config(tmp_path, base)
    out = cli("finetune", "-f", write_config(tmp_path / "rl.yaml", raw), "--no-supervisor", check=True).stdout
    lines = out.splitlines()
    rows = metrics(tmp_path / "rl")
    train = {m["step"]: m for m in rows if "train/loss" in m}
    evals = {m["step"]: m for m in rows if "eval/reward" in m}
    assert sorted(train) == [1, 2, 3, 4] and sorted(evals) == [2, 4], rows
    for step, m in train.items():
        weighted = m["train/reward/exact_match"] + 0.5 * m["train/reward/variety"] + 2.0 * m["train/reward/format"]
        assert m["train/reward"] == pytest.approx(weighted, rel=1e-9, abs=1e-12), step  # no reward said n/a here
        assert 0 <= m["train/flat_groups"] <= 1 and 0 <= m["train/truncated"] <= 1
        assert 1 <= m["train/completion_length"] <= m["train/completion_length_max"] <= 6
        assert m["train/clip_fraction"] == 0.0  # one update per batch: the ratio is 1
        assert m["train/logprob_gap"] < 1e-4  # the sampler's log-probs are the trainer's (fp32)
        assert m["train/entropy"] > 0 and m["throughput/generation_tokens_per_s"] > 0
        assert m["time/generation_share"] == pytest.approx(
            m["time/generation_s"] / (m["time/generation_s"] + m["time/update_s"]), rel=1e-9)
        printed = next(ln for ln in lines if ln.startswith(f"step {step}/4 | "))
        assert (f"reward {m['train/reward']:.3f} flat {100 * m['train/flat_groups']:.0f}% "
                f"len {m['train/completion_length']:.1f}") in printed, printed
    for step, m in evals.items():
        assert m["eval/prompts"] == 6
        assert m["eval/reward"] == pytest.approx(m["eval/reward/exact_match"] + 0.5 * m["eval/reward/variety"]
                                                 + 2.0 * m["eval/reward/format"], rel=1e-9, abs=1e-12)
        printed = next(ln for ln in lines if ln.startswith(f"eval step {step} | "))
        assert printed.startswith(f"eval step {step} | reward {m['eval/reward']:.3f} (greedy, 6 prompts) | "
                                  f"reward/exact_match {m['eval/reward/exact_match']:.4g}"), printed
    assert any(ln.startswith("rl: dapo loss, clip [0.2, 0.28], 1 update(s) per batch") for ln in lines), lines
    assert any("batch 4 prompts × 4 completions = micro-batch 8 × 2 accumulation" in ln for ln in lines), lines
    # `runs describe`: what the supervisor keeps of metrics.jsonl, as it prints it
    from lmforge.cli.runs import metrics_lines
    from lmforge.runs.progress import MetricsTail, metrics_path, summarize

    tail = MetricsTail(metrics_path(str(tmp_path / "rl")))
    described = metrics_lines(SimpleNamespace(latest_metrics=summarize(tail.poll(), raw, tail.latest_eval),
                                              is_terminal=True, config=raw))
    assert f"  reward {train[4]['train/reward']:.3f}  flat {100 * train[4]['train/flat_groups']:.0f}%" in described[0]
    assert described[1].startswith(f"held-out   step 4  reward {evals[4]['eval/reward']:.3f} (greedy)  "
                                   f"exact_match {evals[4]['eval/reward/exact_match']:.3f}"), described
    assert described[1].endswith("(6 prompts)")
    assert "Reward" in (tmp_path / "rl" / "report.html").read_text()


@pytest.mark.integration
@pytest.mark.parametrize("variant", ["lora-gspo", "full-kl"])
def test_kl_to_the_reference_several_updates_and_resampling(tmp_path, base, variant):
    """With a KL penalty to the reference — LoRA's base with its adapters off, or a frozen copy of the
    starting weights — the first update's KL is 0 (the policy is the reference), later ones are not;
    with μ = 2 updates per batch the second update's ratios move and clip (GSPO's sequence ratios, on
    a tight clip); flat groups are sampled again and what is left counted; truncated ones masked."""
    extra = {"rl.kl": 0.05, "rl.resample_flat_groups": 1, "rl.mask_truncated": True,
             "parameters.learning_rate": 2e-2, "training_duration": "3ba", "eval.interval": "3ba"}
    if variant == "lora-gspo":
        extra |= {"lora": {"rank": 4, "dropout": 0.0}, "rl.loss": "gspo", "rl.clip": [0.001, 0.002],
                  "rl.updates_per_batch": 2}
    log: list[str] = []
    cfg = rl_config(tmp_path, base, variant, **extra)
    (tmp_path / "rw.py").write_text(REWARD_FILE + "open(__file__ + '.loads', 'a').write('x')\n")  # counts its loads
    train_in_process(cfg, log=log.append)
    assert (tmp_path / "rw.py.loads").read_text() == "x"  # the user's file runs once: resolution's rewards are kept
    train = {m["step"]: m for m in metrics(tmp_path / variant) if "train/loss" in m}
    if variant == "lora-gspo":  # the step's KL and clip fraction are the means of its two updates: the first's 0
        assert train[1]["train/kl"] > 1e-6 and any(m["train/clip_fraction"] > 0 for m in train.values()), train
    else:
        assert train[1]["train/kl"] == pytest.approx(0.0, abs=1e-7) and train[1]["train/clip_fraction"] == 0, train
    assert train[3]["train/kl"] > 1e-6, train
    assert all(0 <= m["train/flat_groups_left"] <= m["train/flat_groups"] for m in train.values())
    reference = "base, adapters off" if variant == "lora-gspo" else "starting weights"
    assert any(f"KL to the {reference} β 0.05" in line for line in log), log


@pytest.mark.integration
def test_a_flat_reward_says_so_once(tmp_path, base):
    """Every completion scored 0 (an answer the model never writes): every group is flat, the metrics say
    so at each step, and the log in one line (once for the run of flat steps, not at every step)."""
    raw = rl_config(tmp_path, base, "flat", training_duration="3ba", **{"eval.interval": "3ba"})
    raw["rl"] |= {"reward": ["exact_match"], "reward_weights": None, "format_regex": None}
    log: list[str] = []
    train_in_process(raw, log=log.append)
    said = [line for line in log if "got the same reward" in line]
    assert len(said) == 1 and said[0].startswith("warning: step 1: every group's 4 completions got the same "
                                                 "reward (mean 0): no learning signal"), said
    assert all(m["train/flat_groups"] == 1.0 and m["train/reward"] == 0.0
               for m in metrics(tmp_path / "flat") if "train/loss" in m)


@pytest.mark.integration
def test_a_reward_that_fails_mid_run_is_one_line_and_its_checkpoints_stay(tmp_path, base):
    """A user's reward raising on its third call (step 2) stops the run with one line naming the function
    and the rows (tried alone, none fails again), exit 2, and the checkpoint of step 1 intact; a row without the `answer` a built-in
    needs is refused before anything is written."""
    (tmp_path / "boom.py").write_text(
        "import os\n"
        "def boom(prompts, completions, **kwargs):\n"
        "    calls = os.path.join(os.path.dirname(__file__), 'calls')\n"
        "    n = int(open(calls).read()) if os.path.exists(calls) else 0\n"
        "    open(calls, 'w').write(str(n + 1))\n"
        "    if n == 2:\n"
        "        raise RuntimeError('the judge is down')\n"
        "    return [0.5] * len(completions)\n")
    raw = rl_config(tmp_path, base, "boom", save_interval="1ba", **{"eval.interval": "4ba"})
    raw["rl"] |= {"reward": [f"{tmp_path}/boom.py:boom"], "reward_weights": None, "format_regex": None}
    proc = cli("finetune", "-f", write_config(tmp_path / "boom.yaml", raw), "--no-supervisor")
    assert_one_line_error(proc, "rl.reward", "boom.py:boom raised RuntimeError: the judge is down on the "
                          f"completions of rows {tmp_path}/train.jsonl:")  # (it fails once: on no row alone)
    assert (tmp_path / "boom" / "checkpoints" / "step_00000001").is_dir()
    bad = write_config(tmp_path / "bad.yaml", rl_config(tmp_path, base, "bad"))
    write_jsonl(tmp_path / "val.jsonl", [{"prompt": "def h(x):\n    return"}])
    proc = cli("finetune", "-f", bad, "--no-supervisor")
    assert_one_line_error(proc, "rl.reward exact_match: needs column 'answer', which", "val.jsonl:1 lacks")
    assert not [f.name for f in (tmp_path / "bad").iterdir() if f.name != ".lmforge.lock"]  # (the folder's lock)


@pytest.mark.e2e
def test_a_killed_run_resumes_to_the_same_weights(tmp_path, base):
    """`lmforge finetune -f` killed after step 3 (SIGKILL: LMFORGE_FAULT), restarted by its supervisor
    from the checkpoint of step 2: the sampler draws what it drew, and the weights end bitwise equal to
    an uninterrupted run's."""
    common = {"training_duration": "5ba", "save_interval": "2ba", "eval.interval": "5ba", "max_retries": 1,
              "compute.async_checkpoint": False}
    train_in_process(rl_config(tmp_path, base, "whole", **common))
    victim = write_config(tmp_path / "victim.yaml", rl_config(tmp_path, base, "victim", **common))
    lmforge("finetune", "-f", victim, env={"LMFORGE_FAULT": "kill:step=3"}, check=True)
    assert [json.loads(ln)["kind"] for ln in (tmp_path / "victim" / "faults.jsonl").read_text().splitlines()] == ["kill"]
    a, b = final_weights(tmp_path / "whole"), final_weights(tmp_path / "victim")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rewards = [{m["step"]: m["train/reward"] for m in metrics(tmp_path / n) if "train/reward" in m}
               for n in ("whole", "victim")]
    assert rewards[0] == rewards[1]  # steps 3-5 again: the same completions, the same rewards


@pytest.mark.e2e
@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_two_ranks_sample_their_own_prompts(tmp_path, base, monkeypatch, data_parallel):
    """Two gloo ranks, DDP or FSDP2: each samples the completions of its own prompts (under FSDP every
    rank as many forwards: the sampler runs to max_new_tokens), the rewards and held-out prompts are
    counted over both (7 held-out prompts: one rank runs a stand-in under FSDP), and the run exports."""
    monkeypatch.setenv("LMFORGE_NO_SUPERVISOR", "1")
    raw = rl_config(tmp_path, base, data_parallel, **{"compute.ranks": 2, "compute.data_parallel": data_parallel,
                                                      "training_duration": "2ba", "parameters.micro_batch_size": 4})
    write_jsonl(tmp_path / "val.jsonl", [{"prompt": f"def g{i}(y):\n    return", "answer": " y"} for i in range(7)])
    lmforge("finetune", "-f", write_config(tmp_path / "two.yaml", raw), check=True)
    rows = metrics(tmp_path / data_parallel)
    evals = [m for m in rows if "eval/reward" in m]
    assert evals and all(m["eval/prompts"] == 7 for m in evals), rows
    assert all(m["train/completion_length_max"] <= 6 for m in rows if "train/loss" in m)
    assert (tmp_path / data_parallel / "final" / "model.safetensors").is_file()


def test_example_data_is_what_its_generator_writes(tmp_path):
    """examples/data/rl is the output of examples/rl_tasks.py; the example configs read; the held-out
    sums are in no training file."""
    import subprocess
    import sys

    from lmforge.config.load import read_yaml

    subprocess.run([sys.executable, str(REPO / "examples" / "rl_tasks.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    data = REPO / "examples" / "data" / "rl"
    for f in data.iterdir():
        assert (tmp_path / f.name).read_text() == f.read_text(), f.name
    cfg = build_config(read_yaml(str(REPO / "examples" / "rl.yaml")) | {"model": "llama-tiny", "tokenizer": "tok"})
    assert cfg.task_type == "rl" and cfg.rl.reward == ("exact_match",)
    from lmforge.runs.stages import load_pipeline

    stages = load_pipeline(str(REPO / "examples" / "pipeline.yaml"))["stages"]
    rung = build_config(stages[-1]["config"] | {"model": "llama-tiny", "tokenizer": "tok"})  # the ladder's last rung
    assert stages[-1]["command"] == "finetune" and rung.task_type == "rl" and rung.eval.data_path
    assert [s["name"] for s in load_pipeline(str(REPO / "examples" / "rl_base.yaml"))["stages"]] == ["pretrain", "sft"]
    def prompts(name):
        return {json.loads(ln)["prompt"] for ln in (data / name).read_text().splitlines()}

    seen = {ln.rsplit(" ", 1)[0] + " " for ln in (data / "sums.txt").read_text().splitlines()}  # "a + b = " of "a + b = c"
    held = prompts("val.jsonl")
    assert len(held) == 200 and prompts("train.jsonl") <= seen
    assert not held & (seen | prompts("sft.jsonl") | prompts("train.jsonl"))
