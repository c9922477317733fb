"""The default recipe: budget-aware LR schedules, `model: auto`, the model options the sweep
measures (QK-norm, ReLU², soft-capping, z-loss), and their bad input (Muon: tests/test_muon.py). Seconds each."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_run_config
from train_helpers import cli
from lmforge.config.durations import parse_duration
from lmforge.config.load import build_config
from lmforge.config.model import ModelConfig
from lmforge.distributed.dist import DistInfo
from lmforge.errors import UserError
from lmforge.plan.auto import SMALL_SHAPES, TOKENS_PER_PARAM, Budget, candidates, choose, effective_tokens
from lmforge.plan.flops import param_counts
from lmforge.models import build_model
from lmforge.resolve import resolve
from lmforge.plan.run import make_plan
from lmforge.plan.schedule import Schedule
from lmforge.train.machine import local_machine, process_machine
from lmforge.train.build import build_trainer
from lmforge.train.trainer import Trainer

ONE_RANK = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
CPU = torch.device("cpu")


# ---------------------------------------------------------------------------- schedules

def test_wsd_warms_up_holds_then_decays_over_the_last_fraction():
    s = Schedule("wsd", unit="steps", total=100, warmup=5, warmup_unit="steps", decay_fraction=0.2, min_ratio=0.0)
    f = [s.factor(i, 0.0, 0.0) for i in range(100)]
    assert f[0] == pytest.approx(0.2) and f[4] == 1.0  # (step + 1) / warmup: the first step learns
    assert all(x == 1.0 for x in f[4:81])  # stable until 80% of the run
    assert f[90] == pytest.approx(0.5) and f[99] == pytest.approx(0.05)  # linear to 0 at the end
    assert all(a >= b for a, b in zip(f[5:], f[6:]))


def test_cosine_and_linear_decay_from_the_end_of_warmup_to_min_ratio():
    for kind in ("cosine", "linear"):
        s = Schedule(kind, unit="steps", total=110, warmup=10, warmup_unit="steps", min_ratio=0.1)
        assert s.factor(10, 0, 0) == pytest.approx(1.0)
        assert s.factor(60, 0, 0) == pytest.approx(0.55)  # halfway: cosine and linear agree
        assert s.decay(110) == pytest.approx(0.1)


def test_wall_clock_schedule_is_in_seconds_not_guessed_steps():
    """70 s run: warmup 3.5 s and decay over the last 14 s, whatever the step rate."""
    s = Schedule("wsd", unit="s", total=70.0, warmup=3.5, warmup_unit="s", decay_fraction=0.2)
    assert s.factor(0, 0.0, 1.0) == pytest.approx(1.0 / 3.5)  # warmup ramps to where the step ends
    assert s.factor(3, 3.0, 1.0) == 1.0
    assert s.factor(40, 55.0, 1.0) == 1.0
    assert s.factor(50, 63.0, 1.0) == pytest.approx(0.5)
    assert s.factor(60, 69.3, 1.0) == pytest.approx(0.05)


def plan_of(tiny_data, tmp_path, **overrides):
    cfg = build_config(tiny_run_config(tiny_data, tmp_path / "run", **overrides))
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": 512})})
    return make_plan(cfg, local_machine(CPU), samples_per_epoch=None, data_seq_len=64)


def test_plan_puts_a_wall_clock_run_on_a_seconds_schedule(tiny_data, tmp_path):
    plan = plan_of(tiny_data, tmp_path, training_duration="70s", **{"parameters.warmup": None})
    s = plan.schedule
    assert (s.unit, s.total, s.kind, s.warmup_unit) == ("s", 70.0, "wsd", "s")
    assert s.warmup == pytest.approx(3.5)  # 5% of the run by default
    assert plan.total_steps is None and plan.step_time_s > 0
    steps = plan_of(tiny_data, tmp_path, training_duration="200ba", **{"parameters.warmup": None}).schedule
    assert (steps.unit, steps.total, steps.warmup) == ("steps", 200.0, 10.0)
    given = plan_of(tiny_data, tmp_path, training_duration="70s", **{"parameters.warmup": "7s"}).schedule
    assert (given.warmup, given.warmup_unit) == (7.0, "s")


def test_flop_budget_is_steps_on_the_standard_basis(tiny_data, tmp_path):
    plan = plan_of(tiny_data, tmp_path, training_duration="1e12flop")
    assert plan.total_steps == pytest.approx(1e12 / (plan.flops_per_token * plan.tokens_per_step), abs=1)


@pytest.mark.parametrize("value", [0, 1, 1.5, -0.2])
def test_decay_fraction_outside_0_1_is_one_line_naming_the_key(tiny_data, tmp_path, value):
    with pytest.raises(UserError, match=r"^parameters\.decay_fraction: "):
        build_config(tiny_run_config(tiny_data, tmp_path, **{"parameters.decay_fraction": value}))


def test_wall_clock_budget_shorter_than_one_step_names_the_key(tiny_data, tmp_path):
    big = {"d_model": 512, "n_layers": 8, "n_heads": 8, "max_seq_len": 64}
    with pytest.raises(UserError, match=r"^training_duration: 0\.01s is shorter than one optimizer step"):
        plan_of(tiny_data, tmp_path, training_duration="0.01s", model=big,
                **{"parameters.global_batch_size": 64, "parameters.micro_batch_size": 8})


def test_short_runs_get_many_small_steps_long_runs_the_size_default():
    from lmforge.config.defaults import MIN_BATCH_TOKENS, default_batch_tokens

    assert default_batch_tokens(1e6) == 8192  # no length known (a step count): by size
    assert default_batch_tokens(1e6, 0.7e6) == 2048  # 60 s on 2 cores: ~340 steps (the sweep's best)
    assert default_batch_tokens(1e6, 3.07e6) == 2048  # the quickstart: ~1,000 steps beat ~510 and ~260
    assert default_batch_tokens(1e6, 5e6) == 4096
    assert default_batch_tokens(1e6, 1e4) == MIN_BATCH_TOKENS
    assert default_batch_tokens(100e6, 1e12) == 524288  # long runs: the published recipes


def test_plan_sizes_the_default_batch_for_the_run(tiny_data, tmp_path):
    no_default = {"parameters.global_batch_size": None, "parameters.micro_batch_size": "auto"}
    assert plan_of(tiny_data, tmp_path, training_duration="0.7M tok", **no_default).tokens_per_step == 2048
    assert plan_of(tiny_data, tmp_path, training_duration="10M tok", **no_default).tokens_per_step == 8192
    assert plan_of(tiny_data, tmp_path, training_duration="100ba", **no_default).tokens_per_step == 8192
    timed = plan_of(tiny_data, tmp_path, training_duration="60s", **no_default)
    assert 2048 <= timed.tokens_per_step <= 8192


@pytest.mark.parametrize("override, message", [
    ({"parameters.decay_fraction": 1.0}, "parameters.decay_fraction: Input should be less than 1"),
    ({"training_duration": "0.01s", "model": {"d_model": 512, "n_layers": 8, "n_heads": 8, "max_seq_len": 64},
      "parameters.global_batch_size": 64, "parameters.micro_batch_size": 8},
     "training_duration: 0.01s is shorter than one optimizer step"),
])
def test_recipe_bad_input_exits_2_with_one_line(tiny_data, tmp_path, override, message):
    (tmp_path / "bad.yaml").write_text(json.dumps(tiny_run_config(tiny_data, tmp_path / "run", **override)))
    out = cli("train", "-f", tmp_path / "bad.yaml", "--dry-run")
    assert out.returncode == 2 and out.stderr.startswith("error: ") and message in out.stderr, out.stderr
    assert out.stderr.strip().count("\n") == 0 and not (tmp_path / "run").exists()


def make_trainer(tiny_data, folder, **overrides) -> Trainer:
    raw = tiny_run_config(tiny_data, folder, **({"compute.async_checkpoint": False, "eval.prompts": []} | overrides))
    return build_trainer(resolve(build_config(raw), process_machine(ONE_RANK), log=lambda *_: None), ONE_RANK, log=lambda *_: None)


def run_steps(trainer: Trainer, n: int) -> list[float]:
    it = iter(trainer.stream)
    lrs = []
    for _ in range(n):
        lrs.append(trainer.train_step([next(it) for _ in range(trainer.plan.grad_accum)]).lr)
    return lrs


@pytest.mark.e2e
def test_extending_a_finished_run_blends_the_lr_instead_of_jumping(tiny_data, tmp_path):
    """10 steps of wsd decaying over their last half end at 0.2× the peak; resumed with 20ba the
    new schedule says 'peak' at step 10. The LR instead moves from the checkpoint's last LR to the
    new schedule's over one warmup (2 steps), then follows the new decay."""
    opts = {"parameters.warmup": "2ba", "parameters.learning_rate": 1e-2, "parameters.decay_fraction": 0.5}
    a = make_trainer(tiny_data, tmp_path / "run", training_duration="10ba", **opts)
    first = run_steps(a, 10)
    a.save()
    assert first[-1] == pytest.approx(0.2e-2)
    b = make_trainer(tiny_data, tmp_path / "run", training_duration="20ba", **opts)
    assert b.resumed and b.state.lr_blend is not None
    after = run_steps(b, 10)
    assert after[0] == pytest.approx(first[-1])  # continuous at the resume point, not 1e-2
    assert after[1] == pytest.approx(0.2e-2 + (0.9e-2 - 0.2e-2) / 2)  # halfway to the new schedule
    assert after[2:] == pytest.approx([1e-2 * (1 - (s / 20 - 0.5) / 0.5) for s in range(12, 20)])
    b.save()
    c = make_trainer(tiny_data, tmp_path / "run", training_duration="20ba", **opts)  # same schedule again
    assert c.state.lr_blend == b.state.lr_blend  # the blend is part of the run's state


@pytest.mark.e2e
def test_resume_with_the_same_schedule_continues_exactly(tiny_data, tmp_path):
    a = make_trainer(tiny_data, tmp_path / "run", training_duration="10ba")
    run_steps(a, 4)
    a.save()
    expected = run_steps(a, 1)
    b = make_trainer(tiny_data, tmp_path / "run", training_duration="10ba")
    assert b.state.lr_blend is None and run_steps(b, 1) == expected


# ---------------------------------------------------------------------------- model options

OPTIONS = [{"qk_norm": "head"}, {"tie_embeddings": True}, {"qk_norm": "head", "tie_embeddings": True}]


@pytest.mark.integration
@pytest.mark.parametrize("opts", OPTIONS)
def test_model_options_train_and_count_their_parameters(opts):
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=32, **opts)
    torch.manual_seed(0)
    model = build_model(cfg)
    assert param_counts(cfg)["total"] == sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, 128, (2, 32))
    targets = torch.roll(ids, -1, 1)
    out = model.training_loss(ids, targets)
    (out.ce_sum / targets.numel()).backward()
    assert all(p.grad is not None for p in model.parameters())
    # forward and training loss agree
    ce = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten(), reduction="sum")
    assert ce.item() == pytest.approx(out.ce_sum.item(), rel=1e-4)


# ---------------------------------------------------------------------------- model: auto

def small_cands(vocab=1024):
    return candidates(vocab, None, None, lambda m, ctx: 8192)


def test_auto_picks_the_shape_nearest_the_compute_optimal_tokens_per_parameter():
    import math

    for tokens in (2e6, 3e7, 2e9, 2e11):
        best, reason = choose(Budget("tok", tokens), small_cands())
        others = [param_counts(c.model)["total"] for c in small_cands()]
        nearest = min(abs(math.log(tokens / (TOKENS_PER_PARAM * n))) for n in others)
        assert abs(math.log(tokens / (TOKENS_PER_PARAM * best.params))) == pytest.approx(nearest)
        assert reason.startswith("model: auto → ") and "\n" not in reason
    small, _ = choose(Budget("tok", 2e6), small_cands())
    large, _ = choose(Budget("tok", 2e11), small_cands(32000))
    assert small.params < 2e6 < 1e9 < large.params


def test_auto_step_budget_costs_every_shape_at_one_batch():
    """The default batch grows with the model (8K → 0.5M tokens): 3 steps must not buy a 70M model
    more tokens than a 1M one and so pick it."""
    from lmforge.config.defaults import default_batch_tokens

    cands = candidates(1024, None, None, lambda m, ctx: default_batch_tokens(param_counts(m)["non_embedding"]))
    best, reason = choose(Budget("ba", 3), cands)
    assert best.model.d_model == SMALL_SHAPES[0][0] and "3 steps × 8.19K tokens" in reason
    big, _ = choose(Budget("ba", 1e6), cands)
    assert big.params > best.params


def test_auto_wall_clock_budget_uses_the_measured_rate():
    """The same seconds buy more tokens on a faster machine, so a faster one gets a bigger model."""
    def rate(flops_per_s):
        from lmforge.plan.flops import flops_per_token
        return lambda c: flops_per_s / flops_per_token(c.model, c.context_length)["total"]

    slow, _ = choose(Budget("s", 60), small_cands(), tokens_per_s=rate(5e10), flops_per_s_guess=5e10)
    fast, reason = choose(Budget("s", 60), small_cands(), tokens_per_s=rate(5e13), flops_per_s_guess=5e13)
    assert slow.params < fast.params and "tokens/s (measured here)" in reason


def test_repeated_data_is_worth_less():
    assert effective_tokens(1e6, None) == 1e6 and effective_tokens(1e6, 2e6) == 1e6
    assert 4e6 < effective_tokens(5e6, 1e6) < 5e6  # four repeats: nearly as good as fresh data
    assert effective_tokens(1e9, 1e6) < 20e6  # a thousand epochs: little more than R* of them


def test_auto_with_epochs_on_unknown_data_is_one_line_naming_the_key():
    with pytest.raises(UserError, match=r"^training_duration: model: auto needs a budget"):
        Budget.from_duration(parse_duration("2ep"), data_tokens=None)
    assert Budget.from_duration(parse_duration("2ep"), data_tokens=1000).value == 2000


def test_measured_throughput_is_cached_per_machine_and_shape(tmp_path, monkeypatch):
    from lmforge.train.throughput import cached_tokens_per_s, measure_tokens_per_s

    monkeypatch.setenv("LMFORGE_HOME", str(tmp_path))
    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=16)
    assert cached_tokens_per_s(cfg, 16, 2) is None
    tps = measure_tokens_per_s(cfg, 16, 2, steps=1, warmup=0)
    assert tps > 0 and cached_tokens_per_s(cfg, 16, 2) == tps
    assert cached_tokens_per_s(cfg.model_copy(update={"n_layers": 2}), 16, 2) is None


@pytest.mark.integration
def test_measured_throughput_is_the_fastest_step():
    """A busy moment slows some timed steps; the rate is that of the fastest (real steps, a clock
    whose readings make the first timed step 10× slower than the others)."""
    from lmforge.train.throughput import measure_tokens_per_s

    step_s = iter([1.0, 0.1, 0.1])
    now = [0.0]

    def clock():  # called at the start and the end of each timed step
        if clock.started:
            now[0] += next(step_s)
        clock.started = not clock.started
        return now[0]

    clock.started = False
    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=16)
    tps = measure_tokens_per_s(cfg, 16, 2, steps=3, warmup=0, use_cache=False, clock=clock)
    assert tps == pytest.approx(2 * 16 / 0.1)  # the mean step (0.4 s) would say 80 tokens/s


def test_auto_dry_run_and_estimate_print_the_choice_in_one_line(tiny_data, tmp_path):
    cfg = tiny_run_config(tiny_data, tmp_path / "run", model="auto", training_duration="3M tok")
    cfg.pop("parameters")
    (tmp_path / "auto.yaml").write_text(json.dumps(cfg))
    out = cli("train", "-f", tmp_path / "auto.yaml", "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    line = out.stdout.splitlines()[0]
    assert line.startswith("model: auto → ") and "3M tokens" in line
    resolved = json.loads(out.stdout[out.stdout.index("{"):])["config"]
    assert resolved["model"]["d_model"] in {d for d, _, _ in SMALL_SHAPES}
    assert resolved["parameters"]["context_length"] == 64  # no longer than the prepared samples
    est = cli("estimate", "--model", "auto", "--flops", "1e18")
    assert est.returncode == 0 and est.stdout.startswith("model: auto → ") and "Plan:" in est.stdout
    bad = cli("estimate", "--model", "auto")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--tokens, --flops or --time" in bad.stderr


def test_auto_with_an_epoch_budget_on_raw_data_exits_2_naming_the_key(tiny_data, tmp_path):
    cfg = tiny_run_config(tiny_data, tmp_path / "run", model="auto", training_duration="2ep",
                          train_data=str(tiny_data.raw), tokenizer={"train": {}})
    (tmp_path / "auto.yaml").write_text(json.dumps(cfg))
    out = cli("train", "-f", tmp_path / "auto.yaml", "--dry-run")
    assert out.returncode == 2 and out.stderr.startswith("error: training_duration: model: auto needs a budget")
    assert out.stderr.strip().count("\n") == 0


def test_auto_sizes_a_wall_clock_budget_for_every_gpu(tiny_data, tmp_path):
    """A wall-clock budget on 8 GPUs buys 8 GPUs' tokens: `model: auto` picks a bigger shape than
    on one (its rate is one device's; the line says how many it counted)."""
    from lmforge.plan.machine import nominal_machine
    from lmforge.resolve.request import RunRequest

    chosen, lines = {}, []
    for gpus in (1, 8):
        raw = tiny_run_config(tiny_data, tmp_path / "run", model="auto", training_duration="10min")
        raw["parameters"] = {"precision": "bf16"}
        run = resolve(RunRequest.from_mapping("train", raw), nominal_machine("h100-sxm", gpus), until="plan",
                      log=lines.append)
        chosen[gpus] = run.plan.params["total"]
    assert chosen[8] > chosen[1]
    assert "× 8 GPUs" in lines[-1] and "× 8 GPUs" not in lines[0]
