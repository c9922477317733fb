"""Curricula: phases of the data stream, their config, and a kill + resume inside phase 2."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from collections import Counter
from itertools import islice

import pytest
import torch

from conftest import tiny_run_config
from lmforge.config.load import build_config
from lmforge.data.stream import StreamPhase, TokenStream
from lmforge.errors import UserError
from test_stream import SEQ, make_dataset
from train_helpers import assert_one_line_error, env, final_weights, lmforge, metrics, train_losses, write_config

GB = 8


@pytest.fixture
def three(tmp_path):
    return [("web", make_dataset(tmp_path / "web", 300, tag=1)), ("code", make_dataset(tmp_path / "code", 150, tag=2)),
            ("hq", make_dataset(tmp_path / "hq", 60, tag=3))]


def phased(three, tmp_path, phases, **kw):
    from lmforge.data.stream import DatasetSpec

    kw = {"seq_len": SEQ, "micro_batch_size": 2, "global_batch_size": GB, "seed": 5,
          "cache_dir": str(tmp_path / "cache"), "phases": phases} | kw
    return TokenStream([DatasetSpec(n, p) for n, p in three], **kw)


PHASES = [StreamPhase(400 * GB, {"web": 0.7, "code": 0.3}), StreamPhase(None, {"web": 0.2, "hq": 0.8})]


def tags(batches) -> list[int]:
    return [int(r[1]) for b in batches for r in b]


def test_token_counts_per_phase_follow_the_proportions(three, tmp_path):
    s = phased(three, tmp_path, PHASES)
    it = iter(s)
    assert s.current_phase() == 0 and s.metrics() == {"data/phase": 0, "data/mix/web": 0.7, "data/mix/code": 0.3,
                                                       "data/mix/hq": 0.0}
    first = tags(islice(it, 400 * GB // 2))  # micro-batches of 2 → exactly phase 1
    assert s.current_phase() == 1 and s.metrics()["data/mix/hq"] == 0.8
    second = tags(islice(it, 400 * GB // 2))
    c1, c2 = Counter(first), Counter(second)
    assert set(c1) == {1, 2} and set(c2) == {1, 3}
    # Epoch of phase 1 = 510 samples: 357 web + 153 code; 3200 samples ≈ 6.27 epochs.
    assert c1[1] / len(first) == pytest.approx(0.7, abs=0.01)
    assert c2[3] / len(second) == pytest.approx(0.8, abs=0.01)
    assert "phase 2/2: web 20%, hq 80%" == s.describe_phase()


def test_one_phase_is_the_plain_mix(three, tmp_path):
    from lmforge.data.stream import DatasetSpec

    mix = {"web": 0.5, "code": 0.3, "hq": 0.2}
    plain = TokenStream([DatasetSpec(n, p, mix[n]) for n, p in three], seq_len=SEQ, micro_batch_size=2,
                        global_batch_size=GB, seed=5, cache_dir=str(tmp_path / "c2"))
    one = phased(three, tmp_path, [StreamPhase(None, mix)])
    assert all(torch.equal(a, b) for a, b in zip(islice(iter(plain), 50), islice(iter(one), 50)))


def test_resume_inside_phase_two_is_exact_also_on_other_ranks(three, tmp_path):
    ref = list(islice(iter(phased(three, tmp_path, PHASES)), 1800))  # 4 micro-batches a step: 450 steps
    s = phased(three, tmp_path, PHASES)
    it = iter(s)
    for _ in range(1700):  # 425 global batches: inside phase 2
        next(it)
    state = s.state_dict()
    assert state["samples_seen"] == 425 * GB and s.current_phase() == 1
    fresh = phased(three, tmp_path, PHASES)
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(ref[1700:], islice(iter(fresh), 50)))
    # Two ranks: rank r's micro-batches are the r-th half of each global batch.
    halves = [phased(three, tmp_path, PHASES, world_size=2, rank=r) for r in (0, 1)]
    for h in halves:
        h.load_state_dict(state)
    r0, r1 = (list(islice(iter(h), 10)) for h in halves)
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

    from lmforge.train.plan import make_plan

    # 1M tokens = 62 steps of 8 × 2048 tokens, past a 50-step run: only the plan can tell.
    cfg = build_config(cfg_with([{"until": "1M tok", "mix": {"a": "x/"}}, {"mix": {"a": 1}}], "50ba")
                       | {"parameters": {"global_batch_size": 8, "context_length": 2048}})
    with pytest.raises(UserError, match=r"train_data\[0\].until: '1M tok' is step 62, past the end of the run"):
        make_plan(cfg, world_size=1, device=_t.device("cpu"), samples_per_epoch=None, data_seq_len=None)
    cfg = build_config(cfg_with([{"until": "25%", "mix": {"a": "x/"}}, {"until": "20ba", "mix": {"a": 1}},
                                 {"mix": {"a": 1}}], "40ba") | {"parameters": {"global_batch_size": 8}})
    assert make_plan(cfg, world_size=1, device=_t.device("cpu"), samples_per_epoch=None,
                     data_seq_len=None).phase_steps == [10, 20]


# ----------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def second_dataset(tiny_data, tmp_path_factory):
    """Another prepared dataset with the tiny tokenizer: a different slice of the stdlib."""
    import sysconfig
    from pathlib import Path

    from lmforge.data.prepare import prepare

    root = tmp_path_factory.mktemp("second")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("shlex.py", "calendar.py", "pprint.py", "difflib.py"):
        (root / (name + ".txt")).write_text((stdlib / name).read_text())
    prepare([str(root)], str(tiny_data.tokenizer), str(root / "data"), 64)  # no val: eval on `a` only
    return str(root / "data")


def test_kill_and_resume_inside_phase_two_is_bitwise(tmp_path, tiny_data, second_dataset):
    phases = [{"until": "5ba", "mix": {"a": {"path": str(tiny_data.dataset), "proportion": 0.8},
                                       "b": {"path": second_dataset, "proportion": 0.2}}},
              {"mix": {"a": 0.1, "b": 0.9}}]
    common = {"train_data": phases, "training_duration": "12ba", "save_interval": "3ba", "eval.interval": "6ba"}
    ref_folder, folder = tmp_path / "ref", tmp_path / "victim"
    ref_cfg = write_config(tmp_path / "ref.yaml", tiny_run_config(tiny_data, ref_folder, **common))
    ref = lmforge("train", "-f", ref_cfg, check=True)
    assert "data: phase 1/2: a 80%, b 20% from step 0" in ref.stdout
    assert "data: phase 2/2: a 10%, b 90% from step 5" in ref.stdout
    phase_of = {r["step"]: r["data/phase"] for r in metrics(ref_folder) if "data/phase" in r}
    assert [phase_of[s] for s in range(1, 13)] == [0] * 4 + [1] * 8  # logged after step s: phase of step s+1
    assert {r["data/mix/b"] for r in metrics(ref_folder) if r.get("data/phase") == 1} == {0.9}

    cfg = write_config(tmp_path / "victim.yaml", tiny_run_config(tiny_data, folder, **common))
    kill_at = random.Random().randint(7, 10)  # the latest checkpoint is then step 6 or 9: inside phase 2
    proc = subprocess.Popen([sys.executable, "-m", "lmforge", "train", "-f", str(cfg)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env())
    deadline = time.time() + 240
    while max(train_losses(folder), default=0) < kill_at:
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = lmforge("train", "-f", cfg, check=True)
    assert "resume: continuing from" in resumed.stdout and "data: phase 2/2" in resumed.stdout
    want, got = final_weights(ref_folder), final_weights(folder)
    for k in want:
        assert torch.equal(want[k], got[k]), f"{k} differs after resume (killed at step {kill_at})"
    assert train_losses(folder) == train_losses(ref_folder)


def test_bad_curriculum_is_one_line_and_writes_nothing(tmp_path, tiny_data):
    folder = tmp_path / "bad"
    phases = [{"until": "20ba", "mix": {"a": str(tiny_data.dataset)}}, {"mix": {"a": 1}}]
    cfg = write_config(tmp_path / "bad.yaml", tiny_run_config(tiny_data, folder, train_data=phases,
                                                              training_duration="12ba"))
    proc = lmforge("train", "-f", cfg)
    assert_one_line_error(proc, "train_data[0].until", "past the end of the run")
    assert not folder.exists()
