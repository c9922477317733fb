"""The gauntlet's arithmetic and config, and `lmforge eval` end to end in a subprocess."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import yaml

from eval_helpers import REPO, SHARED_EVAL, sentence, write_jsonl
from lmforge.errors import UserError
from lmforge.eval.gauntlet import DEFAULT_GAUNTLET, gauntlet_scores, load_gauntlet, parse_gauntlet
from lmforge.eval.icl import DEFAULT_TASKS

RESULTS = {
    "a/0-shot": {"accuracy": 0.75, "n": 100},
    "b/3-shot": {"accuracy": 0.40, "n": 400},
    "c/0-shot": {"accuracy": 0.30, "n": 10},
    "unused/0-shot": {"accuracy": 1.0, "n": 5},
}


def _gauntlet(**top):
    doc = {
        "categories": [
            {"name": "reasoning", "benchmarks": [{"name": "a", "num_fewshot": 0, "random_baseline": 0.5},
                                                 {"name": "b", "num_fewshot": 3, "random_baseline": 0.25}]},
            {"name": "knowledge", "benchmarks": [{"name": "c", "num_fewshot": 0, "random_baseline": 0.0}]},
        ],
        "averages": {"core": ["reasoning", "knowledge"], "only_reasoning": ["reasoning"]},
        **top,
    }
    return parse_gauntlet(doc)


def test_equal_weighting_with_baseline_and_rescale():
    s = gauntlet_scores(RESULTS, _gauntlet())
    # a: (0.75-0.5)/0.5 = 0.5; b: (0.40-0.25)/0.75 = 0.2; c: 0.3
    assert s["benchmarks"] == pytest.approx({"a/0-shot": 0.5, "b/3-shot": 0.2, "c/0-shot": 0.3})
    assert s["categories"] == pytest.approx({"reasoning": 0.35, "knowledge": 0.3})
    assert s["averages"] == pytest.approx({"core": 0.325, "only_reasoning": 0.35})
    assert s["missing"] == []


def test_sample_size_weightings():
    s = gauntlet_scores(RESULTS, _gauntlet(weighting="SAMPLE_SZ"))
    assert s["categories"]["reasoning"] == pytest.approx((0.5 * 100 + 0.2 * 400) / 500)  # 0.26
    assert s["averages"]["core"] == pytest.approx((0.26 + 0.3) / 2)
    s = gauntlet_scores(RESULTS, _gauntlet(weighting="LOG_SAMPLE_SZ"))
    want = (0.5 * math.log2(100) + 0.2 * math.log2(400)) / (math.log2(100) + math.log2(400))
    assert s["categories"]["reasoning"] == pytest.approx(want)  # ≈ 0.3304
    assert s["categories"]["knowledge"] == pytest.approx(0.3)


def test_baseline_switches_and_overrides():
    s = gauntlet_scores(RESULTS, _gauntlet(subtract_random_baseline=False))
    assert s["categories"]["reasoning"] == pytest.approx((0.75 + 0.40) / 2)
    s = gauntlet_scores(RESULTS, _gauntlet(rescale_accuracy=False))
    assert s["categories"]["reasoning"] == pytest.approx((0.25 + 0.15) / 2)
    g = _gauntlet()
    g.categories[0].benchmarks[1].subtract_random_baseline = False  # as a per-benchmark key would
    assert gauntlet_scores(RESULTS, g)["categories"]["reasoning"] == pytest.approx((0.5 + 0.4) / 2)


def test_missing_benchmark_drops_its_category_only():
    partial = {k: v for k, v in RESULTS.items() if k != "c/0-shot"}
    s = gauntlet_scores(partial, _gauntlet())
    assert s["categories"] == {"reasoning": pytest.approx(0.35), "knowledge": None}
    assert s["averages"]["core"] == pytest.approx(0.35)
    assert s["missing"] == ["c/0-shot"]
    assert gauntlet_scores({}, _gauntlet())["averages"] == {"core": None, "only_reasoning": None}


def test_tasks_with_categories_count_the_mean_of_their_categories():
    # Foundry's gauntlet averages the per-category accuracies of a has_categories task,
    # unweighted: (0.9 + 0.2) / 2 = 0.55, not the pooled (9 + 18) / 100 = 0.27.
    results = {
        "jeopardy/3-shot": {"accuracy": 0.27, "n": 100, "size": 100, "categories": {
            "history": {"accuracy": 0.9, "n": 10, "size": 10}, "science": {"accuracy": 0.2, "n": 90, "size": 90}}},
        "arc/0-shot": {"accuracy": 0.5, "n": 100, "size": 100},
    }
    g = parse_gauntlet({"categories": [{"name": "wk", "benchmarks": [
        {"name": "jeopardy", "num_fewshot": 3, "random_baseline": 0},
        {"name": "arc", "num_fewshot": 0, "random_baseline": 0.25}]}]})
    s = gauntlet_scores(results, g)
    assert s["benchmarks"] == pytest.approx({"jeopardy/3-shot": 0.55, "arc/0-shot": 1 / 3})
    assert s["categories"]["wk"] == pytest.approx((0.55 + 1 / 3) / 2)  # 0.4417; pooled would give 0.3017


def test_sample_size_weights_use_the_full_task_size():
    # With --limit only 10 examples of each were scored; the weights are the tasks' sizes.
    results = {"a/0-shot": {"accuracy": 0.75, "n": 10, "size": 100},
               "b/3-shot": {"accuracy": 0.40, "n": 10, "size": 400},
               "c/0-shot": {"accuracy": 0.30, "n": 1, "size": 1}}
    s = gauntlet_scores(results, _gauntlet(weighting="SAMPLE_SZ"))
    assert s["categories"]["reasoning"] == pytest.approx((0.5 * 100 + 0.2 * 400) / 500)
    s = gauntlet_scores(results, _gauntlet(weighting="LOG_SAMPLE_SZ"))
    w_a, w_b = math.log2(100), math.log2(400)
    assert s["categories"]["reasoning"] == pytest.approx((0.5 * w_a + 0.2 * w_b) / (w_a + w_b))
    # Foundry's weight is max(log2(size), 1): a one-example task still weighs 1.
    g = parse_gauntlet({"weighting": "LOG_SAMPLE_SZ", "categories": [{"name": "k", "benchmarks": [
        {"name": "c", "num_fewshot": 0}, {"name": "a", "num_fewshot": 0, "random_baseline": 0.5}]}]})
    assert gauntlet_scores(results, g)["categories"]["k"] == pytest.approx((0.3 * 1 + 0.5 * w_a) / (1 + w_a))


def test_foundry_gauntlet_yaml_loads(tmp_path):
    # Shaped like Foundry's eval_gauntlet.yaml: an average names a category the file never
    # defines (Foundry's `programming` is commented out); Foundry ignores it, so do we.
    (tmp_path / "g.yaml").write_text("""\
eval_gauntlet:
  weighting: LOG_SAMPLE_SZ
  subtract_random_baseline: true
  rescale_accuracy: true
  averages:
    core_average:
    - world_knowledge
    - commonsense_reasoning
    - programming
  categories:
  - name: world_knowledge
    benchmarks:
    - name: jeopardy
      num_fewshot: 10
      random_baseline: 0
    - name: arc_easy
      num_fewshot: 10
      random_baseline: 0.25
  - name: commonsense_reasoning
    benchmarks:
    - name: copa
      num_fewshot: 0
      random_baseline: 0.5
  # - name: programming
  #   benchmarks:
  #   - name: human_eval
""")
    g = load_gauntlet(tmp_path / "g.yaml")
    assert g.weighting == "LOG_SAMPLE_SZ"
    assert g.benchmark_keys() == ["jeopardy/10-shot", "arc_easy/10-shot", "copa/0-shot"]
    results = {"jeopardy/10-shot": {"accuracy": 0.2, "n": 8}, "arc_easy/10-shot": {"accuracy": 0.5, "n": 8},
               "copa/0-shot": {"accuracy": 0.7, "n": 8}}
    s = gauntlet_scores(results, g)
    assert s["averages"]["core_average"] == pytest.approx((s["categories"]["world_knowledge"] + 0.4) / 2)
    del g.averages["core_average"]
    (tmp_path / "plain.yaml").write_text("categories:\n- {name: x, benchmarks: [{name: copa, num_fewshot: 0}]}\n")
    assert load_gauntlet(tmp_path / "plain.yaml").averages == {"default_average": ["x"]}  # Foundry's default


def test_gauntlet_benchmarks_must_be_evaluated_tasks(tmp_path):
    from lmforge.eval.icl import load_tasks

    write_jsonl(tmp_path / "mc.jsonl", [{"query": "q", "choices": ["a", "b"], "gold": 0}] * 4)
    tasks = load_tasks([{"label": "mc", "dataset_uri": str(tmp_path / "mc.jsonl"), "icl_task_type": "multiple_choice",
                         "num_fewshot": [0, 3]}])
    (tmp_path / "g.yaml").write_text("""\
eval_gauntlet:
  categories:
  - name: choice
    benchmarks:
    - {name: mc, num_fewshot: 3, random_baseline: 0.5}
    - name: mc
      num_fewshot: 5
      random_baseline: 0.5
    - {name: arc, num_fewshot: 0}
""")
    with pytest.raises(UserError) as e:
        load_gauntlet(tmp_path / "g.yaml", tasks=tasks)
    assert str(e.value).startswith(f"{tmp_path / 'g.yaml'}:line 6: categories[0].benchmarks[1] (choice): "
                                   "benchmark mc/5-shot is not among the ICL tasks: task 'mc' runs num_fewshot [0, 3]")
    (tmp_path / "g.yaml").write_text("categories:\n- name: choice\n  benchmarks:\n  - {name: arc, num_fewshot: 0}\n")
    with pytest.raises(UserError, match=r"g.yaml:line 4: .*no task is labelled 'arc' \(labels: mc\)"):
        load_gauntlet(tmp_path / "g.yaml", tasks=tasks)


def test_shipped_gauntlet_matches_shipped_tasks():
    g = load_gauntlet("default")
    tasks = yaml.safe_load(DEFAULT_TASKS.read_text())["icl_tasks"]
    available = {f"{t['label']}/{k}-shot" for t in tasks for k in t["num_fewshot"]}
    assert set(g.benchmark_keys()) <= available
    assert load_gauntlet(DEFAULT_GAUNTLET).benchmark_keys() == g.benchmark_keys()


@pytest.mark.parametrize("change, message", [
    ({"weighting": "HEAVY"}, "weighting 'HEAVY' is not one of EQUAL, SAMPLE_SZ, LOG_SAMPLE_SZ"),
    ({"averages": {"reasoning": ["reasoning"]}}, "averages.reasoning: an average cannot share a category's name"),
    ({"categories": []}, "categories must be a non-empty list"),
    ({"categories": [{"name": "x", "benchmarks": [{"name": "a", "num_fewshot": 0, "random_baseline": 1.0}]}],
      "averages": None}, "random_baseline must be a number in [0, 1)"),
    ({"categories": [{"name": "x", "benchmark": []}]}, "unknown key 'benchmark'"),
    ({"categories": [{"name": "x", "benchmarks": [{"name": "a", "num_fewshot": "3"}]}]}, "num_fewshot must be"),
    ({"rescale_accuracy": "yes"}, "rescale_accuracy must be true or false"),
])
def test_bad_gauntlet(change, message):
    doc = {"categories": [{"name": "reasoning", "benchmarks": [{"name": "a", "num_fewshot": 0}]}], **change}
    doc = {k: v for k, v in doc.items() if v is not None}
    with pytest.raises(UserError) as e:
        parse_gauntlet(doc, "g.yaml")
    assert message in str(e.value) and str(e.value).startswith("g.yaml")


def test_bad_gauntlet_files(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_gauntlet(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("eval_gauntlet: [unclosed\n")
    with pytest.raises(UserError, match="bad.yaml:line 2: not valid YAML"):
        load_gauntlet(tmp_path / "bad.yaml")
    (tmp_path / "bad.yaml").write_text("eval_gauntlet:\n  weighting: EQUAL\n  categories:\n  - name: x\n"
                                       "    benchmarks:\n    - {name: a, num_fewshot: 0, baseline: 0.5}\n")
    with pytest.raises(UserError) as e:
        load_gauntlet(tmp_path / "bad.yaml")
    assert str(e.value).startswith(f"{tmp_path / 'bad.yaml'}:line 6: categories[0].benchmarks[0]: "
                                   "unknown key 'baseline'")


# ----------------------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A saved tiny model with its tokenizer (random weights: the CLI's plumbing is under test)."""
    import random

    from lmforge.config.model import ModelConfig
    from lmforge.data.text.tokenizer import train_tokenizer
    from lmforge.models import build_model, save_pretrained

    root = tmp_path_factory.mktemp("ckpt")
    rng = random.Random(0)
    (root / "text.txt").write_text("\n".join(sentence(rng, 12) for _ in range(400)))
    train_tokenizer([str(root / "text.txt")], 300, str(root / "tok"))
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, vocab_size=320, max_seq_len=256)
    save_pretrained(build_model(cfg), cfg, root / "model", tokenizer_dir=root / "tok")
    return root / "model"


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """A tasks YAML (relative dataset_uri paths) with one task of each type, and a gauntlet."""
    import random

    root = tmp_path_factory.mktemp("suite")
    rng = random.Random(1)
    write_jsonl(root / "data" / "mc.jsonl", [{"query": sentence(rng, 5), "choices": [sentence(rng, 2), sentence(rng, 2)],
                                              "gold": i % 2} for i in range(10)])
    write_jsonl(root / "data" / "lm.jsonl", [{"context": sentence(rng, 6), "continuation": sentence(rng, 1)}
                                             for _ in range(10)])
    write_jsonl(root / "data" / "schema.jsonl", [{"context_options": [sentence(rng, 3), sentence(rng, 3)],
                                                  "continuation": sentence(rng, 2), "gold": i % 2} for i in range(10)])
    write_jsonl(root / "data" / "gen.jsonl", [{"context": f"Q: {sentence(rng, 4)}\nA:", "answer": "apple",
                                               "aliases": ["apple"]} for _ in range(10)])
    (root / "tasks.yaml").write_text(yaml.safe_dump({"icl_tasks": [
        {"label": "mc", "dataset_uri": "data/mc.jsonl", "num_fewshot": [0, 1], "icl_task_type": "multiple_choice"},
        {"label": "lm", "dataset_uri": "data/lm.jsonl", "num_fewshot": [0], "icl_task_type": "language_modeling"},
        {"label": "sc", "dataset_uri": "data/schema.jsonl", "num_fewshot": [0], "icl_task_type": "schema"},
        {"label": "qa", "dataset_uri": "data/gen.jsonl", "num_fewshot": [2],
         "icl_task_type": "generation_task_with_answers", "generation_kwargs": {"max_new_tokens": 4}},
    ]}))
    (root / "gauntlet.yaml").write_text(yaml.safe_dump({"eval_gauntlet": {
        "weighting": "EQUAL",
        "categories": [
            {"name": "choice", "benchmarks": [{"name": "mc", "num_fewshot": 1, "random_baseline": 0.5},
                                              {"name": "sc", "num_fewshot": 0, "random_baseline": 0.5}]},
            {"name": "recall", "benchmarks": [{"name": "lm", "num_fewshot": 0, "random_baseline": 0},
                                              {"name": "qa", "num_fewshot": 2, "random_baseline": 0}]},
        ],
        "averages": {"everything": ["choice", "recall"]},
    }}))
    return root


def lmforge(*args, timeout=240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny model on a shared CPU
    return subprocess.run([sys.executable, "-m", "lmforge", "eval", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=env)


@pytest.mark.e2e
def test_cli_json_matches_library(checkpoint, suite):
    p = lmforge("--checkpoint", checkpoint, "--tasks", suite / "tasks.yaml", "--gauntlet", suite / "gauntlet.yaml",
                "--limit", 6, "--batch-size", 3, "--device", "cpu", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert set(out["results"]) == {"mc/0-shot", "mc/1-shot", "lm/0-shot", "sc/0-shot", "qa/2-shot"}
    assert all(r["n"] == 6 for r in out["results"].values())

    from lmforge.data.text.tokenizer import load_tokenizer
    from lmforge.eval import evaluate_icl, gauntlet_scores, load_gauntlet, load_tasks
    from lmforge.models import load_pretrained

    model, _ = load_pretrained(checkpoint)
    results = evaluate_icl(model, load_tokenizer(checkpoint), load_tasks(suite / "tasks.yaml"), limit=6, batch_size=5)
    assert out["results"] == results
    scores = gauntlet_scores(results, load_gauntlet(suite / "gauntlet.yaml"))
    assert out["gauntlet"]["averages"]["everything"] == pytest.approx(scores["averages"]["everything"])
    assert out["gauntlet"]["missing"] == []


@pytest.mark.e2e
def test_cli_tables(checkpoint, suite):
    p = lmforge("--checkpoint", checkpoint, "--tasks", suite / "tasks.yaml", "--gauntlet", suite / "gauntlet.yaml",
                "--limit", 3)
    assert p.returncode == 0, p.stderr
    for text in ("In-context learning", "multiple_choice", "Gauntlet", "choice", "everything"):
        assert text in p.stdout
    assert "Traceback" not in p.stderr


@pytest.mark.e2e
def test_cli_bad_input(checkpoint, suite, tmp_path):
    def fails(*args) -> str:
        p = lmforge(*args)
        assert p.returncode == 2, (p.stdout, p.stderr)
        assert "Traceback" not in p.stderr and p.stderr.startswith("error: ")
        assert len(p.stderr.strip().splitlines()) == 1
        return p.stderr

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "mc.jsonl").write_text('{"query": "q", "choices": ["a", "b"], "gold": 0}\n'
                                                '{"query": "q", "choice": ["a", "b"], "gold": 1}\n')
    (tmp_path / "tasks.yaml").write_text("icl_tasks:\n- {label: mc, dataset_uri: data/mc.jsonl, "
                                         "icl_task_type: multiple_choice}\n")
    msg = fails("--checkpoint", checkpoint, "--tasks", tmp_path / "tasks.yaml")
    assert "mc.jsonl:line 2" in msg and "'choices'" in msg
    # A checkpoint folder without its tokenizer.
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("model.safetensors", "lmforge-model.json"):
        (bare / f).write_bytes((checkpoint / f).read_bytes())
    msg = fails("--checkpoint", bare, "--tasks", suite / "tasks.yaml")
    assert "no tokenizer" in msg

    # The rest through the same entry point, in-process (a subprocess each would only add seconds).
    from lmforge.cli.main import main

    cases = [
        (["--checkpoint", tmp_path / "nope", "--tasks", suite / "tasks.yaml"], "no such folder"),
        (["--checkpoint", checkpoint, "--tasks", tmp_path / "none.yaml"], "not found"),
        (["--checkpoint", checkpoint, "--tasks", suite / "tasks.yaml", "--limit", "0"], "--limit"),
        (["--checkpoint", checkpoint, "--tasks", suite / "tasks.yaml", "--gauntlet", tmp_path / "g.yaml"], "not found"),
        (["--checkpoint", checkpoint, "--tasks", "default", "--data-root", tmp_path], "not found"),
        (["--checkpoint", checkpoint, "--tasks", suite / "tasks.yaml", "--device", "cuda:0"], "--device"),
    ]
    # Foundry-format inputs that are wrong: one line naming the file, the line and the key.
    (tmp_path / "odd.yaml").write_text("icl_tasks:\n- label: mc\n  dataset_uri: data/mc.jsonl\n"
                                       "  icl_task_type: multiple_choice\n  num_fewshots: [1]\n")
    (tmp_path / "g2.yaml").write_text("eval_gauntlet:\n  categories:\n  - name: c\n    benchmarks:\n"
                                     "    - {name: mc, num_fewshot: 0}\n    - {name: sc, num_fewshot: 3}\n")
    cases += [
        (["--checkpoint", checkpoint, "--tasks", tmp_path / "odd.yaml"],
         f"{tmp_path / 'odd.yaml'}:line 5: icl_tasks[0] (mc): num_fewshots: unknown key"),
        (["--checkpoint", checkpoint, "--tasks", suite / "tasks.yaml", "--gauntlet", tmp_path / "g2.yaml"],
         f"{tmp_path / 'g2.yaml'}:line 6: categories[0].benchmarks[1] (c): benchmark sc/3-shot is not among"),
    ]
    for args, expected in cases:
        if "cuda:0" in args and torch.cuda.is_available():
            continue
        err = _run_main(main, ["eval", *map(str, args)])
        assert expected in err, (args, err)


@pytest.mark.integration
def test_cli_takes_a_run_folder_like_generate_and_export(checkpoint, suite, tmp_path, capsys):
    """A run's save folder (its final/ inside) is found by the same locator as generate and export."""
    import shutil

    from lmforge.cli.main import main

    run = tmp_path / "run"
    shutil.copytree(checkpoint, run / "final")
    results = []
    for path in (checkpoint, run):
        assert main(["eval", "--checkpoint", str(path), "--tasks", str(suite / "tasks.yaml"), "--limit", "3",
                     "--json"]) == 0
        results.append(json.loads(capsys.readouterr().out)["results"])
    assert results[0] == results[1] and results[0]


def _run_main(main, argv) -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        assert main(argv) == 2
    return buf.getvalue()


@pytest.mark.e2e
@pytest.mark.skipif(not SHARED_EVAL.is_dir(), reason="../shared/eval-data is not present")
def test_cli_default_suite_on_shared_data(checkpoint):
    p = lmforge("--checkpoint", checkpoint, "--data-root", SHARED_EVAL, "--gauntlet", "default", "--limit", 2,
                "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    g = load_gauntlet("default")
    assert set(g.benchmark_keys()) <= set(out["results"])
    assert out["gauntlet"]["missing"] == []
    assert isinstance(out["gauntlet"]["averages"]["core_average"], float)
