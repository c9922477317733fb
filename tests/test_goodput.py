"""Goodput's rules as units: straggler scores, conditions and their decisions, config bounds, the
diagnostic verdict, the cordon list as cluster arguments, the ledger's accounting, fault specs.
(The processes — a slow rank flagged, a node cordoned and the run resumed on the node left — are in
tests/test_distributed.py.)"""

from __future__ import annotations

import json
import time

import pytest

from lmforge.config.goodput import DiagnoseRule, GoodputConfig
from lmforge.config.load import build_config, parse_set, set_path
from lmforge.errors import UserError
from lmforge.goodput.conditions import ROW, Conditions, scored_sections, scores
from lmforge.goodput.cordon import add_to_cordon, k8s_affinity, read_cordon, resume_layout, slurm_exclude
from lmforge.goodput.diagnosis import Sweep, neighbour_links, verdict
from lmforge.goodput.faults import Injector, parse_faults
from lmforge.goodput.health import HealthSample, HealthSampler, InjectedHealth
from lmforge.goodput.ledger import PARTS, account, format_goodput
from lmforge.plan.layout import Layout


def row(forward=0.1, data=0.01, optimizer=0.05, wall=0.4, steps=1, **health) -> list[float]:
    r = dict.fromkeys(ROW, 0.0) | {"data": data, "forward": forward, "backward": 0.2, "optimizer": optimizer,
                                   "wall": wall, "steps": steps} | health
    return [r[k] for k in ROW]


def test_scores_are_against_the_peers_median():
    assert scores([1.0, 2.0]) == [0.5, 2.0]  # two ranks: each against the other (not their mean)
    assert scores([1.0, 1.0, 1.0, 2.0]) == [1.0, 1.0, 1.0, 2.0]


def test_a_half_speed_rank_is_flagged_after_warmup_and_k_intervals_in_a_row_then_acts():
    cfg = GoodputConfig.model_validate({"straggler": {"intervals": 3, "action": "diagnose"}})
    c = Conditions(cfg, ["a", "a", "b", "b"])
    slow = row(forward=0.2, optimizer=0.1, data=0.02)  # a device at half speed: every local section 2×
    rows = [row(), row(), row(), slow]
    results = [c.update(rows) for _ in range(4)]  # the first interval is warm-up: not scored
    assert [r[0] for r in results[:3]] == [[], [], []] and results[2][1] is None
    flags, decision, metrics = results[3]
    assert [(f.rank, f.node, f.section, round(f.score, 2)) for f in flags] == [(3, "b", "forward", 2.0)]
    assert "data+forward+optimizer 320.0 ms vs median 160.0 ms" in flags[0].detail
    assert decision.action == "diagnose" and decision.nodes == ("b",)
    assert metrics["straggler/score_rank3"] == 2.0 and metrics["straggler/max_score"] == 2.0
    assert c.update(rows)[0] == []  # one event per streak
    c.update([row()] * 4)  # a good interval ends the streak: K more in a row before the next flag
    assert [c.update(rows)[0] for _ in range(3)][2][0].rank == 3


def test_noise_is_no_straggler_below_the_threshold_the_minimum_time_or_outside_a_streak():
    c = Conditions(GoodputConfig(), ["a", "b"], scored_sections(Layout(data_parallel="ddp")))
    for _ in range(5):  # 10× the peer's data wait, but 0.18 ms per step: under min_ms (2 ms)
        flags, decision, _ = c.update([row(data=0.00002), row(data=0.0002)])
        assert flags == [] and decision is None
    c = Conditions(GoodputConfig(), ["a", "b"], scored_sections(Layout(data_parallel="ddp")))
    for i in range(8):  # 2× (and 160 ms ahead) every other interval: never 3 in a row
        flags, _, _ = c.update([row(), row(forward=0.2, optimizer=0.1, data=0.02) if i % 2 else row()])
        assert flags == []
    for _ in range(4):  # 1.4× the median, steadily: under the threshold (1.5)
        assert c.update([row(), row(forward=0.14)])[0] == []


def test_scored_sections_hold_no_collective_on_every_data_parallel_mode():
    assert scored_sections(Layout(data_parallel="ddp")) == ("data", "forward", "optimizer")
    assert scored_sections(Layout(data_parallel="none")) == ("data", "forward", "optimizer")
    assert scored_sections(Layout(data_parallel="ddp"), optimizer="muon") == ("data", "forward", "optimizer")  # whole gradients: local
    for sharded in ("fsdp", "hsdp"):  # parameters all-gathered in forward; the optimizer step on local shards
        assert scored_sections(Layout(data_parallel=sharded)) == ("data", "optimizer")
        assert scored_sections(Layout(data_parallel=sharded), optimizer="muon") == ("data",)  # Muon all-to-alls whole matrices
    assert scored_sections(Layout(ranks=2, data_parallel="ddp", context_parallel=2)) == ("data", "optimizer")  # keys and values exchanged
    assert scored_sections(Layout(ranks=2, data_parallel="fsdp", shard_group=2, expert_parallel=2, global_batch=2)) == ("data", "optimizer")  # tokens sent to experts


def test_the_layout_a_run_resumes_on_after_a_cordon():
    ranks = {"n0": 0, "n1": 1, "n2": 2, "n3": 3}
    assert resume_layout(ranks, ["n2"], min_nodes=1, too_few_nodes="stop") == {
        "nodes": 3, "node_ranks": {"n0": 0, "n1": 1, "n3": 2}}  # node 0 stays 0; the others close up
    assert resume_layout(ranks, [], min_nodes=1, too_few_nodes="stop")["nodes"] == 4  # restart: every node rejoins
    stop = resume_layout(ranks, ["n1", "n2"], min_nodes=3, too_few_nodes="stop")
    assert stop["nodes"] == 0
    assert "2 node(s) left after cordoning n1, n2, fewer than goodput.min_nodes (3)" in stop["stop"]
    assert resume_layout(ranks, ["n1", "n2"], min_nodes=3, too_few_nodes="wait") == {
        "nodes": 4, "node_ranks": {"n0": 0, "n3": 1}}  # replacements join as nodes 2 and 3
    head = resume_layout(ranks, ["n0"], min_nodes=1, too_few_nodes="stop")
    assert head["nodes"] == 0 and "node 0 (n0) is cordoned" in head["stop"]


def test_mfu_drop_against_the_runs_own_median_after_warmup():
    cfg = GoodputConfig.model_validate({"mfu_drop": {"fraction": 0.5, "intervals": 2, "warmup_intervals": 1,
                                                     "action": "restart"}})
    c = Conditions(cfg, ["a"])
    assert c.update([row(wall=5.0)])[1] is None  # warm-up (compiling): not the baseline
    for _ in range(3):
        assert c.update([row(wall=1.0)])[1] is None
    assert c.update([row(wall=1.9)])[1] is None  # 53% of the median MFU: above the fraction
    assert c.update([row(wall=2.5)])[1] is None  # 40%: once
    flags, decision, _ = c.update([row(wall=2.5)])
    assert decision.action == "restart" and decision.condition == "mfu_drop"
    assert [f.condition for f in flags] == ["mfu_drop"]


def test_a_fatal_health_event_cordons_its_node_at_once_and_throttling_is_an_event():
    c = Conditions(GoodputConfig(), ["a", "a", "b", "b"])
    flags, decision, _ = c.update([row(throttle=0x40), row(), row(xid=79), row()])
    assert {(f.condition, f.node) for f in flags} == {("health", "b"), ("throttle", "a")}
    assert "thermal (hardware)" in next(f.detail for f in flags if f.condition == "throttle")
    assert decision.action == "cordon" and decision.nodes == ("b",) and "XID 79" in decision.reason


@pytest.mark.parametrize("sets,needle", [
    (["goodput.straggler.threshold=1"], "goodput.straggler.threshold"),
    (["goodput.mfu_drop.fraction=1.5"], "goodput.mfu_drop.fraction"),
    (["goodput.straggler.intervals=0"], "goodput.straggler.intervals"),
    (["goodput.health.interval_s=0"], "goodput.health.interval_s"),
    (["goodput.straggler.action=diagnose", "goodput.max_actions=0"],
     "needs autoresume: true and goodput.max_actions ≥ 1"),
    (["goodput.straggler.action=cordon", "autoresume=false"], "needs autoresume: true"),
    (["goodput.straggler.min_ms=-1"], "goodput.straggler.min_ms"),
    (["goodput.mfu_drop.action=cordon"], "cordon names no node"),
    (["goodput.telemetry=false", "goodput.straggler.action=restart"], "needs goodput.telemetry: true"),
    (["goodput.min_nodes=3", "compute.nodes=2"], "more than the run's compute.nodes"),
    (["goodput.straggler.action=reboot"], "goodput.straggler.action"),
])
def test_bad_goodput_settings_are_one_clear_line(sets, needle):
    base = {"model": "llama-tiny", "train_data": "x", "training_duration": "10ba"}
    for item in sets:
        set_path(base, *parse_set(item))
    with pytest.raises(UserError) as e:
        build_config(base)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_goodput_actions_have_their_own_bound_apart_from_max_retries():
    base = {"model": "llama-tiny", "train_data": "x", "training_duration": "10ba", "max_retries": 0}
    cfg = build_config(base | {"goodput": {"straggler": {"action": "cordon"}}})  # no crash retries, yet actions
    assert cfg.goodput.health.action == "cordon" and cfg.goodput.max_actions == 10
    # the default health action does not refuse a run that cannot resume: it checkpoints and stops there
    assert build_config(base | {"goodput": {"max_actions": 0}}).goodput.health.action == "cordon"


def test_diagnosis_fails_the_slow_node_and_a_node_whose_links_all_fail():
    rule = DiagnoseRule()
    sweep = Sweep({"a": [10.0, 10.0], "b": [10.0, 4.0], "c": [9.5, 10.0]},
                  links={("a", "b"): 10.0, ("b", "c"): 10.0, ("c", "a"): 10.0})
    failing, notes = verdict(sweep, rule)
    assert list(failing) == ["b"] and "40% of its peers' median" in failing["b"] and notes == []
    assert neighbour_links(["a", "b", "c"]) == [("a", "b"), ("b", "c"), ("c", "a")]
    assert neighbour_links(["a", "b"]) == [("a", "b")]
    links = {("a", "b"): 1.0, ("b", "c"): 10.0, ("c", "d"): 10.0, ("d", "a"): 1.0}
    failing, _ = verdict(Sweep({n: [10.0] for n in "abcd"}, links=links), rule)
    assert list(failing) == ["a"]
    failing, notes = verdict(Sweep({"a": [10.0], "b": [10.0]}, links={("a", "b"): 1.0}, expected_tflops=20.0), rule)
    assert set(failing) == {"a", "b"} and "expected" in failing["a"]  # below the GPU's expected rate


def test_the_cordon_list_is_kept_and_becomes_slurm_and_k8s_arguments(tmp_path):
    assert read_cordon(str(tmp_path)) == {} and slurm_exclude({}) == [] and k8s_affinity({}) == {}
    add_to_cordon(str(tmp_path), {"gpu-07": "XID 79"}, step=12)
    nodes = add_to_cordon(str(tmp_path), {"gpu-03": "matmul 40%"}, step=30)
    assert read_cordon(str(tmp_path)) == nodes and nodes["gpu-07"]["step"] == 12
    assert slurm_exclude(nodes) == ["#SBATCH --exclude=gpu-03,gpu-07"]
    term = k8s_affinity(nodes)["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term == [{"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn",
                                           "values": ["gpu-03", "gpu-07"]}]}]
    from lmforge.distributed.cluster import pytorchjob_manifest, sbatch_script

    script = sbatch_script(name="r", config_path="/r.yaml", nodes=2, gpus_per_node=8, python="python", cordoned=nodes)
    assert "#SBATCH --exclude=gpu-03,gpu-07\n" in script
    manifest = pytorchjob_manifest(name="r", config_text="a: 1", nodes=2, gpus_per_node=8, image="i", cordoned=nodes)
    assert "operator: NotIn" in manifest and "fieldPath: spec.nodeName" in manifest


def _ledger(*records):
    return [dict(r, attempt=a) for a, rs in records for r in rs]


def test_goodput_parts_add_up_to_the_wall_and_redone_steps_are_lost_work():
    first = [{"kind": "start", "time": 110.0, "process_start": 100.0, "step": 0},
             {"kind": "tick", "time": 150.0, "step": 40, "steps_s": 30.0, "checkpoint_s": 6.0, "evaluation_s": 4.0}]
    second = [{"kind": "start", "time": 175.0, "process_start": 160.0, "step": 30},  # resumed at 30: 10 redone
              {"kind": "end", "time": 255.0, "step": 100, "steps_s": 70.0, "checkpoint_s": 5.0, "evaluation_s": 5.0,
               "status": "completed"}]
    acc = account(_ledger(("1", first), ("2", second)))
    p = acc["parts"]
    assert acc["wall_s"] == 155.0 and sum(p[k] for k in PARTS) == pytest.approx(155.0)
    assert p["startup"] == 25.0 and p["recovery"] == 10.0 and p["lost"] == 7.5  # 10 of 40 steps' 30 s
    assert p["productive"] == 92.5 and p["checkpoint"] == 11.0 and p["evaluation"] == 9.0 and p["other"] == 0
    assert acc["goodput"] == pytest.approx(92.5 / 155.0)
    assert acc["resumptions"][0]["steps_redone"] == 10 and "without a record" in acc["resumptions"][0]["cause"]
    assert format_goodput(acc).startswith("59.7% of 155.0s wall (steps 92.5s, start-up 25.0s")
    assert account([]) is None


def test_the_wait_after_an_end_as_asked_is_idle_not_recovery():
    """Issue 59: a COMPLETED run restarted 34 minutes later counted the 34 minutes as recovery (66.9% →
    1.6%). A wait after a completed or a requested stop is idle, outside the wall; after a crash or a
    detected condition it stays recovery."""
    done = [{"kind": "start", "time": 10.0, "process_start": 0.0, "step": 0},
            {"kind": "end", "time": 150.0, "step": 100, "steps_s": 100.35, "checkpoint_s": 20.0, "evaluation_s": 19.65,
             "status": "completed"}]
    alone = account(_ledger(("1", done)))
    assert round(100 * alone["goodput"], 1) == 66.9 and alone["idle_s"] == 0
    later = 150.0 + 34 * 60
    again = [{"kind": "start", "time": later + 8.0, "process_start": later, "step": 100},
             {"kind": "end", "time": later + 10.0, "step": 100, "steps_s": 0.0, "checkpoint_s": 2.0,
              "evaluation_s": 0.0, "status": "completed"}]
    acc = account(_ledger(("1", done), ("2", again)))
    assert acc["idle_s"] == 34 * 60 and acc["parts"]["recovery"] == 0
    assert acc["wall_s"] == pytest.approx(160.0) and sum(acc["parts"][k] for k in PARTS) == pytest.approx(160.0)
    assert acc["goodput"] == pytest.approx(100.35 / 160.0)  # the restart's own 10 s count, its wait does not
    assert "2040.0s idle between attempts not counted" in format_goodput(acc)
    stopped = [dict(r, status="stopped") if r["kind"] == "end" else r for r in done]
    assert account(_ledger(("1", stopped), ("2", again)))["idle_s"] == 34 * 60  # `runs stop`, restarted later
    crashed = done[:1] + [dict(done[1], kind="tick")]  # no end: killed, restarted by the supervisor
    assert account(_ledger(("1", crashed), ("2", again)))["parts"]["recovery"] == 34 * 60
    detected = stopped + [{"kind": "detected", "time": 149.0, "cause": "straggler", "action": "restart"}]
    acc = account(_ledger(("1", detected), ("2", again)))
    assert acc["parts"]["recovery"] == 34 * 60 and acc["idle_s"] == 0


def test_fault_specs_parse_target_and_fire_once(tmp_path):
    faults = parse_faults("slow:node=n1:local_rank=0:factor=2:from=5,xid:node=n1:step=3,nan:rank=2:step=4")
    health = InjectedHealth()
    mine = Injector(faults, rank=0, local_rank=0, node="n1", folder=str(tmp_path), health=health)
    assert mine.slow_factor(4) == 1.0 and mine.slow_factor(5) == 2.0
    assert not mine.after_step(2) and health.sample().xid == 0
    assert not mine.after_step(3) and health.sample().xid == 79
    again = Injector(faults, rank=0, local_rank=0, node="n1", folder=str(tmp_path), health=InjectedHealth())
    assert not again.after_step(3) and again.health.sample().xid == 0  # fired once per run (faults.jsonl)
    assert json.loads((tmp_path / "faults.jsonl").read_text())["kind"] == "xid"
    other = Injector(faults, rank=2, local_rank=1, node="n0", folder=str(tmp_path))
    assert other.slow_factor(10) == 1.0 and other.after_step(4) is True  # nan: the trainer poisons its weights
    for bad, needle in [("boom", "unknown fault 'boom'"), ("slow:speed=2", "is not KEY=VALUE"),
                        ("kill:step=x", "expected a whole number"), ("slow:factor=0.5", "at least 1")]:
        with pytest.raises(UserError, match=needle):
            parse_faults(bad)


@pytest.mark.parametrize("spec,needle", [
    # issue 59: each was accepted and silently did something else (truncated, never fired, never slowed, hung)
    ("kill:step=1.5", "'step=1.5' in 'kill:step=1.5': expected a whole number, at least 1"),
    ("kill:step=-1", "'step=-1'.*at least 1"),
    ("nan:step=0", "'step=0'.*at least 1"),
    ("slow:factor=nan", "'factor=nan'.*finite"),
    ("slow:factor=inf", "'factor=inf'.*finite"),
    ("diag:factor=1e400", "'factor=1e400'.*finite"),
    ("xid:code=-79", "'code=-79'.*an XID"),
    ("slow:rank=-1", "'rank=-1'.*0 or more"),
    ("slow:from=2.5", "'from=2.5'.*whole number"),
    ("kill:step=2:step=3", "step given twice"),
    ("slow:node=", "expected a node name"),
])
def test_fault_specs_are_checked_like_the_config(spec, needle):
    with pytest.raises(UserError, match=needle) as e:
        parse_faults(spec)
    assert str(e.value).startswith("LMFORGE_FAULT: ") and "\n" not in str(e.value)


def test_a_fault_names_a_rank_the_run_has():
    from lmforge.goodput.faults import check_faults

    with pytest.raises(UserError, match=r"rank=5 in 'slow:rank=5': the run has 1 rank \(0 to 0\)"):
        check_faults(parse_faults("slow:rank=5"), 1)
    with pytest.raises(UserError, match=r"local_rank=2 .* the run has 2 ranks"):
        check_faults(parse_faults("kill:node=n1:local_rank=2:step=3"), 2)
    check_faults(parse_faults("slow:rank=1:factor=2,xid:node=n9:step=3:code=79"), 2)  # a node is known only at start
    assert parse_faults("kill:step=3")[0].get("step") == 3 and parse_faults("slow:factor=2.5")[0].get("factor") == 2.5


@pytest.mark.parametrize("xids", [[-79], [0], [1.5], [True], [79, 10**9]])
def test_fatal_xids_are_whole_numbers_above_zero(xids):
    from lmforge.config.load import build_config

    with pytest.raises(UserError, match=r"goodput.health.fatal_xids\[\d\]"):
        build_config({"model": "llama-tiny", "train_data": "/nonexistent/x.txt", "training_duration": "10ba",
                      "goodput": {"health": {"fatal_xids": xids}}})


def test_the_sampler_keeps_a_fatal_xid_once_seen():
    source = InjectedHealth()
    sampler = HealthSampler([source], interval_s=3600)
    try:
        source.report(xid=79, temperature_c=80.0)
        assert sampler.poll().xid == 79
        source.report(xid=0, temperature_c=70.0)
        assert sampler.poll() == HealthSample(xid=79, temperature_c=70.0)
    finally:
        sampler.close()


def test_goodput_actions_resume_up_to_max_actions_and_a_stop_says_why(tmp_path):
    from lmforge.runs.launch_plan import LaunchPlan
    from lmforge.runs.registry import Registry
    from lmforge.runs.supervisor import Supervisor

    def supervisor():
        return Supervisor(Registry(str(tmp_path / "runs.db")), "r", plan=LaunchPlan("supervise"), lock=None,
                          argv=["train"], retry_argv=["train", "--name", "r"], cwd=str(tmp_path),
                          save_folder=str(tmp_path), local_folder=str(tmp_path), log_dir=str(tmp_path),
                          max_retries=0, config={"goodput": {"max_actions": 2}}, echo=False)

    status = {"status": "reshape", "action": "cordon", "cause": "fatal health event on n2: XID 79", "cordon": ["n2"],
              "nodes": 2, "node_ranks": {"n0": 0, "n1": 1}, "step": 5}
    sup = supervisor()
    for _ in range(2):  # max_retries 0: crashes are not retried, but goodput actions are not crashes
        assert sup._reshaped(status) == (["train", "--name", "r", "--nnodes", "2"],
                                         "cordon: fatal health event on n2: XID 79; cordoned n2")
    argv, why = sup._reshaped(status)
    assert argv is None and why.endswith("the run stops with its checkpoint after 2 goodput action(s) "
                                         "(goodput.max_actions=2)")
    argv, why = supervisor()._reshaped(status | {"cordon": ["n0"], "nodes": 0, "stop": "node 0 (n0) is cordoned"})
    assert argv is None and why.endswith("cordoned n0; node 0 (n0) is cordoned")


def test_telemetry_in_one_process_stretches_a_slow_section_and_acts_on_an_injected_xid(tmp_path):
    """The hooks the trainer calls, on one CPU process: the ``slow`` fault stretches a section inside its
    timing (on CPUs in CPU time: the section's own 20 ms of work at least 3× over), an ``xid`` fault
    reaches the health row, the condition decides to cordon, and acting says where the run resumes —
    nowhere here: the only node is node 0."""
    import torch

    from lmforge.distributed.dist import DistInfo
    from lmforge.train.telemetry import Telemetry

    one = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    lines = []
    tel = Telemetry(GoodputConfig(), one, folder=str(tmp_path), log=lines.append,
                    environ={"LMFORGE_FAULT": "slow:factor=3,xid:step=2:code=79", "LMFORGE_NODE": "n0"})
    tel.start(0)
    with tel.section("forward"):
        until = time.process_time() + 0.02
        while time.process_time() < until:  # 20 ms of CPU work
            pass
    assert tel.timer.totals["forward"] >= 0.06
    decisions = []
    for step in (1, 2):
        tel.after_step(step, torch.nn.Linear(1, 1))
        decisions.append(tel.interval()[1])
    assert decisions[0] is None and decisions[1].action == "cordon" and "XID 79" in decisions[1].reason
    report = tel.act(decisions[1])
    assert report["cordon"] == [tel.node] and report["nodes"] == 0 and "is cordoned" in report["stop"]
    assert read_cordon(str(tmp_path))[tel.node]["step"] == 2
    tel.close("stopped")


def test_a_killed_attempts_last_steps_are_lost_work_with_the_cause_the_supervisor_saw(tmp_path):
    """Rank 0 overwrites its progress after every step; killed after step 13 (its last tick at 10), the next
    attempt keeps that progress in the ledger, resumes from the step-10 checkpoint: 3 steps lost, and the
    cause is the supervisor's, recorded for the attempt that started before the next one."""
    from lmforge.goodput.ledger import Ledger, add_cause, read_ledger
    from lmforge.runs.supervisor import rank_failure

    first = Ledger(str(tmp_path), process_start=time.time() - 10)
    first.write("start", process_start=first.process_start, step=0)
    first.write("tick", step=10, steps_s=1.0, checkpoint_s=0.1, evaluation_s=0.0)
    first.progress(step=13, steps_s=1.3, checkpoint_s=0.1, evaluation_s=0.0)
    add_cause(str(tmp_path), "rank 1 killed by SIGKILL", started_before=time.time())
    second = Ledger(str(tmp_path), process_start=time.time() + 0.5)
    second.attempt += "-2"  # (the same pid here)
    second.write("start", process_start=second.process_start, step=10)
    second.progress(step=11, steps_s=0.1, checkpoint_s=0.0, evaluation_s=0.0)
    acc = account(read_ledger(str(tmp_path)))
    (r,) = acc["resumptions"]
    assert (r["step"], r["from_step"], r["steps_redone"], acc["steps_lost"]) == (10, 13, 3, 3)
    assert r["cause"] == "rank 1 killed by SIGKILL" and acc["parts"]["lost"] == pytest.approx(0.3, abs=1e-3)
    assert sum(acc["parts"][k] for k in PARTS) == pytest.approx(acc["wall_s"], abs=1e-3)
    assert "lost work 0.3s (3 steps)" in format_goodput(acc)
    # which rank died, as a node's torchrun saw it: a kill or a hang before a rank whose peer ended
    events = [{"event": "rank_failed", "node": "n0", "local_rank": 0, "exit_code": 1, "time": 5.0},
              {"event": "rank_failed", "node": "n1", "local_rank": 1, "exit_code": -9, "time": 6.0}]
    assert rank_failure(events, since=1.0) == "local rank 1 on n1 killed by SIGKILL"
    assert rank_failure(events, since=7.0) is None
