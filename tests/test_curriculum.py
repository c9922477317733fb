"""Curricula: phases of the data stream, their config and plan, and a resume inside phase 2."""

from __future__ import annotations

from collections import Counter
from itertools import islice

import pytest
import torch

from conftest import tiny_run_config
from lmforge.config.load import build_config
from lmforge.data.stream.tokens import StreamPhase, TokenStream
from lmforge.distributed.dist import DistInfo
from lmforge.errors import UserError
from lmforge.train.callbacks import Callback
from lmforge.resolve import resolve
from lmforge.train.machine import process_machine
from lmforge.train.build import build_trainer
from lmforge.train.trainer import Trainer
from lmforge.plan.layout import Layout
from test_stream import SEQ, make_dataset
from train_helpers import final_weights, write_config

GB = 8
ONE_RANK = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture
def three(tmp_path):
    return [("web", make_dataset(tmp_path / "web", 300, tag=1)), ("code", make_dataset(tmp_path / "code", 150, tag=2)),
            ("hq", make_dataset(tmp_path / "hq", 60, tag=3))]


def phased(three, tmp_path, phases, **kw):
    from lmforge.data.stream.tokens import DatasetSpec

    kw = {"seq_len": SEQ, "micro_batch_size": 2, "global_batch_size": GB, "seed": 5,
          "cache_dir": str(tmp_path / "cache"), "phases": phases} | kw
    return TokenStream([DatasetSpec(n, p) for n, p in three], **split(kw))


def split(kw: dict) -> dict:
    """The stream's layout from the sizes a test names (as the planner would make it)."""
    kw = dict(kw)
    layout = Layout(ranks=kw.pop("world_size", 1), global_batch=kw.pop("global_batch_size"),
                    micro_batch=kw.pop("micro_batch_size"))
    return kw | {"layout": layout}


PHASES = [StreamPhase(400 * GB, {"web": 0.7, "code": 0.3}), StreamPhase(None, {"web": 0.2, "hq": 0.8})]


def take(it, n: int) -> list[torch.Tensor]:
    """The token ids of the next n micro-batches of an iterator over a stream."""
    return [b.input_ids for b in islice(it, n)]


def tags(batches) -> list[int]:
    return [int(r[1]) for b in batches for r in b]


def test_token_counts_per_phase_follow_the_proportions(three, tmp_path):
    s = phased(three, tmp_path, PHASES)
    it = iter(s)
    assert s.current_phase() == 0 and s.metrics() == {"data/phase": 0, "data/mix/web": 0.7, "data/mix/code": 0.3,
                                                       "data/mix/hq": 0.0}
    first = tags(take(it, 400 * GB // 2))  # micro-batches of 2 → exactly phase 1
    assert s.current_phase() == 1 and s.metrics()["data/mix/hq"] == 0.8
    second = tags(take(it, 400 * GB // 2))
    c1, c2 = Counter(first), Counter(second)
    assert set(c1) == {1, 2} and set(c2) == {1, 3}
    # Epoch of phase 1 = 510 samples: 357 web + 153 code; 3200 samples ≈ 6.27 epochs.
    assert c1[1] / len(first) == pytest.approx(0.7, abs=0.01)
    assert c2[3] / len(second) == pytest.approx(0.8, abs=0.01)
    assert s.phase() == "phase 2/2: web 20%, hq 80%"


def test_one_phase_is_the_plain_mix(three, tmp_path):
    from lmforge.data.stream.tokens import DatasetSpec

    mix = {"web": 0.5, "code": 0.3, "hq": 0.2}
    plain = TokenStream([DatasetSpec(n, p, mix[n]) for n, p in three], seq_len=SEQ,
                        layout=Layout(global_batch=GB, micro_batch=2), seed=5, cache_dir=str(tmp_path / "c2"))
    one = phased(three, tmp_path, [StreamPhase(None, mix)])
    assert all(torch.equal(a, b) for a, b in zip(take(iter(plain), 50), take(iter(one), 50)))


def test_resume_inside_phase_two_is_exact_also_on_other_ranks(three, tmp_path):
    ref = take(iter(phased(three, tmp_path, PHASES)), 1800)  # 4 micro-batches a step: 450 steps
    s = phased(three, tmp_path, PHASES)
    it = iter(s)
    for _ in range(1700):  # 425 global batches: inside phase 2
        next(it)
    state = s.state_dict()
    assert state["samples_seen"] == 425 * GB and s.current_phase() == 1
    fresh = phased(three, tmp_path, PHASES)
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(ref[1700:], take(iter(fresh), 50)))
    # Two ranks: rank r's micro-batches are the r-th half of each global batch.
    halves = [phased(three, tmp_path, PHASES, world_size=2, rank=r) for r in (0, 1)]
    for h in halves:
        h.load_state_dict(state)
    r0, r1 = (take(iter(h), 10) for h in halves)
    for step in range(5):
        whole = torch.cat(ref[1700 + 4 * step: 1704 + 4 * step])
        assert torch.equal(torch.cat([r0[2 * step], r0[2 * step + 1], r1[2 * step], r1[2 * step + 1]]), whole)
    # A different curriculum is a different stream: refused, not silently continued.
    other = phased(three, tmp_path, [StreamPhase(300 * GB, PHASES[0].mix), PHASES[1]])
    with pytest.raises(UserError, match="does not match the data"):
        other.load_state_dict(state)


def test_bad_phases(three, tmp_path):
    with pytest.raises(UserError, match=r"curriculum\[1\]: end points must increase"):
        phased(three, tmp_path, [StreamPhase(80, {"web": 1}), StreamPhase(40, {"hq": 1}), StreamPhase(None, {"hq": 1})])
    with pytest.raises(UserError, match=r"curriculum\[0\].mix: unknown dataset news"):
        phased(three, tmp_path, [StreamPhase(None, {"news": 1})])


# ----------------------------------------------------------------------------- config

def cfg_with(train_data, duration="100ba"):
    return {"model": "llama-tiny", "train_data": train_data, "training_duration": duration}


def test_config_phases_become_datasets_plus_curriculum():
    cfg = build_config(cfg_with([
        {"until": "60%", "mix": {"web": {"path": "w/", "proportion": 3}, "code": {"path": "c/", "proportion": 1}}},
        {"mix": {"web": 1, "hq": {"path": "h/", "proportion": 3}}}]))
    assert [(d.name, d.path, d.proportion) for d in cfg.train_data] == [("web", "w/", None), ("code", "c/", None),
                                                                        ("hq", "h/", None)]
    assert [(p.until, p.mix) for p in cfg.curriculum] == [("60%", {"web": 3, "code": 1}), (None, {"web": 1, "hq": 3})]
    # The dumped (resolved) config validates back to the same thing.
    assert build_config(cfg.model_dump(mode="json")).curriculum == cfg.curriculum


@pytest.mark.parametrize("train_data, duration, needle", [
    ([{"until": "50ba", "mix": {"a": "x/"}}, {"until": "40ba", "mix": {"a": 1}}, {"mix": {"a": 1}}], "100ba",
     "train_data[1].until: end points must increase"),
    ([{"until": "150ba", "mix": {"a": "x/"}}, {"mix": {"a": 1}}], "100ba", "train_data[0].until: '150ba' is past the end"),
    ([{"until": "1.5", "mix": {"a": "x/"}}, {"mix": {"a": 1}}], "100ba", "a fraction of the run must be in (0, 1]"),
    ([{"until": "0.5", "mix": {"a": {"path": "x/", "proportion": 0}}}, {"mix": {"a": 1}}], "100ba",
     "proportion of 'a' must be > 0"),
    ([{"until": "0.5", "mix": {"a": "x/"}}, {"mix": {"b": 1}}], "100ba", "train_data[1].mix.b: no phase gives"),
    ([{"until": "2ep", "mix": {"a": "x/"}}, {"mix": {"a": 1}}], "100ba", "ends after tokens, steps or samples"),
])
def test_config_errors(train_data, duration, needle):
    with pytest.raises(UserError) as e:
        build_config(cfg_with(train_data, duration))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_plan_checks_end_points_in_steps():
    import torch as _t

    from lmforge.plan.run import make_plan
    from lmforge.train.machine import local_machine

    # 1M tokens = 62 steps of 8 × 2048 tokens, past a 50-step run: only the plan can tell.
    cfg = build_config(cfg_with([{"until": "1M tok", "mix": {"a": "x/"}}, {"mix": {"a": 1}}], "50ba")
                       | {"parameters": {"global_batch_size": 8, "context_length": 2048}})
    with pytest.raises(UserError, match=r"train_data\[0\].until: '1M tok' is step 62, past the end of the run"):
        make_plan(cfg, local_machine(_t.device("cpu")), samples_per_epoch=None, data_seq_len=None)
    cfg = build_config(cfg_with([{"until": "25%", "mix": {"a": "x/"}}, {"until": "20ba", "mix": {"a": 1}},
                                 {"mix": {"a": 1}}], "40ba") | {"parameters": {"global_batch_size": 8}})
    assert make_plan(cfg, local_machine(_t.device("cpu")), samples_per_epoch=None,
                     data_seq_len=None).phase_steps == (10, 20)


# ----------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def second_dataset(tiny_data, tmp_path_factory):
    """Another prepared dataset with the tiny tokenizer: a different slice of the stdlib."""
    import sysconfig
    from pathlib import Path

    from lmforge.data.prepare.prepare import prepare

    root = tmp_path_factory.mktemp("second")
    (root / "text").mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("shlex.py", "calendar.py", "pprint.py", "difflib.py"):
        (root / "text" / (name + ".txt")).write_text((stdlib / name).read_text())
    prepare([str(root / "text")], str(tiny_data.tokenizer), str(root / "data"), 64)  # no val: eval on `a` only
    return str(root / "data")


class Recorder(Callback):
    def __init__(self):
        self.metrics: dict[int, dict] = {}

    def on_metrics(self, metrics, step):
        self.metrics.setdefault(step, {}).update(metrics)


def trainer_for(tiny_data, folder, second_dataset, lines: list, rec: Recorder | None = None) -> Trainer:
    phases = [{"until": "5ba", "mix": {"a": {"path": str(tiny_data.dataset), "proportion": 0.8},
                                       "b": {"path": second_dataset, "proportion": 0.2}}},
              {"mix": {"a": 0.1, "b": 0.9}}]
    cfg = build_config(tiny_run_config(tiny_data, folder, train_data=phases, training_duration="12ba",
                                       save_interval="3ba", **{"eval.interval": "6ba", "eval.prompts": [],
                                                              "compute.async_checkpoint": False}))
    return build_trainer(resolve(cfg, process_machine(ONE_RANK), log=lambda *_: None), ONE_RANK, callbacks=[rec] if rec else (),
                   log=lines.append)


@pytest.mark.e2e
def test_resume_inside_phase_two_continues_bitwise(tmp_path, tiny_data, second_dataset):
    """The whole path: config phases → plan (ends on steps) → the data's stream → trainer logs
    and metrics → a checkpoint inside phase 2 → a new trainer continues exactly as an
    uninterrupted run. (A real SIGKILL of `lmforge train` is test_train's; what the curriculum
    adds is the stream position, which travels in the checkpoint.)"""
    lines, rec = [], Recorder()
    ref = trainer_for(tiny_data, tmp_path / "ref", second_dataset, lines, rec)
    assert ref.plan.phase_steps == (5,) and ref.data.phases[0].end_sample == 5 * 8
    ref.fit()
    assert "data: phase 1/2: a 80%, b 20% from step 0" in lines
    assert "data: phase 2/2: a 10%, b 90% from step 5" in lines
    phase_of = {s: m["data/phase"] for s, m in rec.metrics.items() if "data/phase" in m}
    assert [phase_of[s] for s in range(1, 13)] == [0] * 4 + [1] * 8  # logged after step s: phase of step s+1
    assert {m["data/mix/b"] for m in rec.metrics.values() if m.get("data/phase") == 1} == {0.9}

    # A run that dies at step 8: its latest checkpoint is step 6, inside phase 2.
    victim = trainer_for(tiny_data, tmp_path / "victim", second_dataset, [])
    batches = iter(victim.stream)
    while victim.state.step < 8:
        victim.train_step([next(batches) for _ in range(victim.plan.grad_accum)])
        if victim.state.step % 3 == 0:
            victim.save()
    victim.stream.close()
    lines, rec2 = [], Recorder()
    resumed = trainer_for(tiny_data, tmp_path / "victim", second_dataset, lines, rec2)
    assert resumed.resumed and resumed.state.step == 6
    resumed.fit()
    assert "data: phase 2/2: a 10%, b 90% from step 6" in lines
    want, got = final_weights(tmp_path / "ref"), final_weights(tmp_path / "victim")
    for k in want:
        assert torch.equal(want[k], got[k]), f"{k} differs after the resume"
    assert all(rec2.metrics[s]["train/loss"] == rec.metrics[s]["train/loss"] for s in range(7, 13))


def test_bad_curriculum_is_one_line_and_writes_nothing(tmp_path, tiny_data, capsys):
    from lmforge.cli.main import main

    folder = tmp_path / "bad"
    phases = [{"until": "20ba", "mix": {"a": str(tiny_data.dataset)}}, {"mix": {"a": 1}}]
    cfg = write_config(tmp_path / "bad.yaml", tiny_run_config(tiny_data, folder, train_data=phases,
                                                              training_duration="12ba"))
    assert main(["train", "-f", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert "train_data[0].until" in err and "past the end of the run" in err
    assert not folder.exists()
