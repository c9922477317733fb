"""Goodput planned before a run (`plan.goodput`): the model against an independent computation of
Daly's, its monotonicity and edge cases, and `save_interval: auto` in a run's plan."""

from __future__ import annotations

import math

import pytest

from lmforge.config.goodput import LLAMA3_FAILURES_PER_GPU_HOUR
from lmforge.config.load import build_config
from lmforge.plan.goodput import (Tier, checkpoint_bytes, daly_interval, goodput_at, mtbf_s, plan_goodput,
                                  young_interval)
from lmforge.plan.machine import nominal_machine
from lmforge.plan.run import make_plan


def daly_wall_per_work(tau: float, delta: float, m: float, r: float) -> float:
    """Daly's complete model, written out here: expected wall time per unit of work for checkpoints of
    cost delta every tau seconds of work, failures at rate 1/m, restarts of r."""
    return m * math.exp(r / m) * (math.exp((tau + delta) / m) - 1) / tau


def best_tau(delta: float, m: float, r: float) -> float:
    """The work interval that minimises Daly's wall time, by golden-section search on log(tau)."""
    lo, hi = math.log(delta / 100), math.log(10 * m)
    g = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if daly_wall_per_work(math.exp(a), delta, m, r) < daly_wall_per_work(math.exp(b), delta, m, r):
            hi = b
        else:
            lo = a
    return math.exp((lo + hi) / 2)


@pytest.mark.parametrize("delta,m", [(1.0, 59_400.0), (30.0, 3 * 3600.0), (0.05, 200.0), (60.0, 1800.0)])
def test_daly_interval_is_the_optimum_of_dalys_complete_model(delta, m):
    tau = best_tau(delta, m, 600.0)
    assert daly_interval(delta, m) == pytest.approx(tau, rel=0.02)
    # Young's first-order form is close for a cheap checkpoint, and Daly's is at least as good
    wall = lambda t: daly_wall_per_work(t, delta, m, 600.0)  # noqa: E731
    assert wall(daly_interval(delta, m)) <= wall(young_interval(delta, m)) + 1e-12
    assert young_interval(delta, m) == pytest.approx(math.sqrt(2 * delta * m))


def test_the_additive_model_agrees_with_dalys_where_failures_are_rare():
    delta, m, r = 1.0, 59_400.0, 600.0
    for tau in (60.0, 350.0, 2000.0):
        additive = goodput_at([Tier("durable", delta, 0.0, tau, 1.0)], m, r)
        assert additive["goodput"] == pytest.approx(1 / daly_wall_per_work(tau, delta, m, r), abs=0.002)
        assert sum(additive[k] for k in ("goodput", "restart", "lost", "checkpoint")) == pytest.approx(1.0)


def test_goodput_falls_with_failures_checkpoint_cost_and_restart_time():
    def g(rate=LLAMA3_FAILURES_PER_GPU_HOUR, restart=600.0, write=2e9):
        return plan_goodput(devices=3072, nodes=384, device="cuda", params=int(73e9), trained=int(73e9),
                            optimizer="adamw", step_s=2.0, run_s=14 * 86400.0, total_steps=None,
                            async_checkpoint=False, failures_per_device_hour=rate, restart_s=restart,
                            write_bytes_per_s=write)
    base = g()
    assert g(rate=2 * LLAMA3_FAILURES_PER_GPU_HOUR).goodput < base.goodput
    assert g(restart=1200.0).goodput < base.goodput
    assert g(write=1e9).goodput < base.goodput
    assert g(rate=2 * LLAMA3_FAILURES_PER_GPU_HOUR).durable.optimal_s < base.durable.optimal_s  # more often
    assert g(write=1e9).durable.optimal_s > base.durable.optimal_s  # a dearer checkpoint: less often
    assert 0.95 < base.goodput < 1 and base.goodput == pytest.approx(base.optimal_goodput, abs=1e-4)
    # 3,072 GPUs at Llama 3's rate fail every ~16.5 h; about one interruption per 16.5 h of wall time
    assert base.mtbf_s / 3600 == pytest.approx(1 / (LLAMA3_FAILURES_PER_GPU_HOUR * 3072) , rel=1e-9)
    assert base.mtbf_s / 3600 == pytest.approx(16.5, abs=0.1)
    assert base.interruptions == pytest.approx(14 * 86400 / base.goodput / base.mtbf_s)


def test_edge_cases_stay_in_range():
    assert daly_interval(0.0, 100.0) == 0.0
    assert daly_interval(500.0, 100.0) == 100.0  # a checkpoint dearer than 2 MTBF: once per MTBF
    hopeless = goodput_at([Tier("durable", 1.0, 0.0, 10.0, 1.0)], mtbf=5.0, restart_s=60.0)
    assert hopeless["goodput"] == 0.0 and hopeless["restart"] == 1.0  # restarts alone outlast the MTBF
    laptop = plan_goodput(devices=1, nodes=1, device="cpu", params=10**6, trained=10**6, optimizer="adamw",
                          step_s=0.01, run_s=60.0, total_steps=6000, async_checkpoint=False)
    assert laptop.durable.interval_steps == 6000  # the optimum is years: a checkpoint at the end only
    # its goodput: the first start (START_S_ONE_NODE) and one checkpoint at the end of 60 s of steps
    assert laptop.goodput == pytest.approx(60 / (60 + 10 + 0.062), abs=1e-3) and laptop.note is None
    assert laptop.parts["startup"] == pytest.approx(10 / 70.062, abs=1e-3)
    assert checkpoint_bytes(100, 100, "adamw") == 1200 and checkpoint_bytes(100, 10, "muon") == 440  # LoRA: 10 trained
    assert mtbf_s(1.0, 4) == 900.0


def test_a_hand_set_interval_far_from_the_optimum_is_named_with_its_cost():
    kw = dict(devices=3072, nodes=384, device="cuda", params=int(73e9), trained=int(73e9), optimizer="adamw",
              step_s=1.3, run_s=14 * 86400.0, total_steps=None, async_checkpoint=True)
    auto = plan_goodput(**kw)
    far = plan_goodput(**kw, save_interval=20 * auto.durable.interval_steps)
    assert auto.note is None and far.note is not None
    cost = 100 * (far.optimal_goodput - far.goodput)
    assert f"costs {cost:.1f} points" in far.note and "save_interval: auto" in far.note and cost >= 0.5
    assert far.optimal_goodput == pytest.approx(auto.goodput)


def test_a_local_tier_checkpoints_more_often_and_raises_goodput():
    kw = dict(devices=64, nodes=8, device="cuda", params=int(8e9), trained=int(8e9), optimizer="adamw",
              step_s=5.0, run_s=30 * 86400.0, total_steps=None, async_checkpoint=False,
              failures_per_device_hour=1e-3)
    durable = plan_goodput(**kw)
    tiered = plan_goodput(**kw, local_interval=None)
    assert tiered.local.optimal_s < durable.durable.optimal_s < tiered.durable.optimal_s
    assert tiered.goodput > durable.goodput
    assert tiered.local.covers + tiered.durable.covers == pytest.approx(1.0)


def _plan(**over):
    raw = {"model": "llama-7b", "train_data": "x", "training_duration": "20000ba", "save_interval": "auto",
           "compute": {"nodes": 8, "rdzv_endpoint": "h:1", "data_parallel": "fsdp", "async_checkpoint": False},
           "goodput": {"failures_per_gpu_hour": 1e-3, "restart_s": 300}} | over
    return make_plan(build_config(raw), nominal_machine("h100-sxm", 64), samples_per_epoch=None, data_seq_len=4096)


def test_save_interval_auto_is_dalys_optimum_in_steps_of_the_plans_step_time():
    plan = _plan()
    gp = plan.goodput
    m = 3600 / (1e-3 * 64)
    delta = 1.0 + checkpoint_bytes(plan.params["total"], plan.params["total"], "adamw") / 8 / 2e9  # fixed + write
    tau = math.sqrt(2 * delta * m) * (1 + math.sqrt(delta / (2 * m)) / 3 + delta / (18 * m)) - delta
    assert gp.durable.blocking_s == pytest.approx(delta)
    assert plan.save_interval == max(1, round(tau / plan.step_time_s)) == gp.durable.interval_steps
    assert gp.restart_s == 300 and gp.restart_source == "goodput.restart_s" and gp.durable.auto
    hand = _plan(save_interval="100ba")
    assert hand.save_interval == 100 and not hand.goodput.durable.auto
    assert _plan(save_interval=None).save_interval == 1000  # the default rule: ~5 per run, at most 1000


def _checkpoint(folder, step: int, *, intact: bool = True, complete: bool = True):
    """A checkpoint folder as `train.checkpoint` leaves it: files, then the state file with their digests."""
    import json

    from lmforge.checksums import file_digests

    path = folder / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"weights %d" % step)
    if complete:
        (path / "lmforge-state.json").write_text(json.dumps({"step": step, "files": file_digests(str(path))}))
    if not intact:
        (path / "__0_0.distcp").write_bytes(b"bit rot")
    return str(path)


def test_a_resume_takes_the_newest_intact_checkpoint_of_either_tier(tmp_path):
    from lmforge.train.checkpoint import newest_checkpoint

    durable, local, lines = tmp_path / "durable", tmp_path / "local", []
    d10 = _checkpoint(durable, 10)
    assert newest_checkpoint(str(durable), str(local), lines.append) == d10  # no local tier written yet
    l14 = _checkpoint(local, 14)
    assert newest_checkpoint(str(durable), str(local), lines.append) == l14  # the newer tier
    _checkpoint(local, 16, complete=False)  # half-written: no state file, never a checkpoint
    assert newest_checkpoint(str(durable), str(local), lines.append) == l14
    d14 = _checkpoint(durable, 14)
    assert newest_checkpoint(str(durable), str(local), lines.append) == d14  # a tie: the durable one
    _checkpoint(local, 18, intact=False)  # a corrupt local copy: the intact one before it, or the durable
    assert newest_checkpoint(str(durable), str(local), lines.append) == d14 and any("18" in ln for ln in lines)
    lost = tmp_path / "lost"  # a node whose local disk is gone, and the durable tier's checkpoints
    _checkpoint(lost, 20, intact=False)  # only a corrupt one there: the durable tier covers it
    assert newest_checkpoint(str(durable), str(lost), lines.append) == d14
    assert "the local tier has no intact checkpoint" in lines[-1]
    assert newest_checkpoint(str(tmp_path / "none"), str(local), lines.append) == l14  # local alone


def test_an_auto_interval_follows_the_measured_checkpoint_time_and_the_failures_seen():
    from lmforge.goodput.interval import MIN_SAMPLES, CheckpointSchedule, History

    gp = plan_goodput(devices=4, nodes=2, device="cpu", params=10**6, trained=10**6, optimizer="adamw",
                      step_s=0.04, run_s=600.0, total_steps=15000, async_checkpoint=False,
                      failures_per_device_hour=1.0, restart_s=5.0)
    m = gp.mtbf_s
    assert m == 900.0
    s = CheckpointSchedule(gp, gp.durable.interval_steps, history=History())
    assert s.due(gp.durable.interval_steps) == "durable" and s.due(gp.durable.interval_steps + 1) is None
    lines = [s.measured("durable", 0.2, 0.04, step) for step in range(MIN_SAMPLES)]
    assert lines[:-1] == [None, None] and lines[-1] is not None  # re-estimated after MIN_SAMPLES
    tau = math.sqrt(2 * 0.2 * m) * (1 + math.sqrt(0.2 / (2 * m)) / 3 + 0.2 / (18 * m)) - 0.2
    assert s.every() == round(tau / 0.04) and "the median of 3 measured" in lines[-1]
    assert s.measured("durable", 0.21, 0.04, 9) is None  # within CHANGE: no change, no line
    # failures seen: 3 in 600 s of wall, the planned rate (one per 900 s) worth one more
    seen = CheckpointSchedule(gp, gp.durable.interval_steps, history=History(failures=3, wall_s=600.0))
    assert seen.mtbf_s() == pytest.approx((600 + 900) / 4)
    assert seen.start(0.04) and seen.every() < gp.durable.interval_steps  # more often from the start
    assert History.of({"wall_s": 10.0, "resumptions": [{"cause": "ended stopped"},
                                                      {"cause": "rank 1 killed by SIGKILL", "recovery_s": 1.0,
                                                       "startup_s": 2.0}]}) == History(1, 10.0, 3.0)
    # the plan counted in its own step time; the run's is 10× longer: the interval in steps is 10× shorter
    slow = CheckpointSchedule(gp, gp.durable.interval_steps, history=History())
    (line,) = slow.stepped(0.4, 20)
    assert slow.every() == pytest.approx(gp.durable.interval_steps / 10, rel=0.05) and "from step 20" in line
    assert slow.stepped(0.41, 30) == []  # within CHANGE of the step time it was counted in
    hand = CheckpointSchedule(gp, 7, 3)
    hand.tiers[0].auto = False
    assert hand.due(21) == "durable" and hand.due(9) == "local" and hand.due(8) is None
