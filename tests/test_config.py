"""Config: schema, durations, overrides, defaults, and one-line errors for bad input."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import tiny_run_config
from lmforge.config.durations import parse_duration
from lmforge.config.load import build_config, load_config
from lmforge.config.model import resolve_model
from lmforge.errors import UserError
from train_helpers import assert_one_line_error, cli, lmforge, write_config


@pytest.mark.parametrize("text,value,unit", [
    ("200B tok", 200e9, "tok"), ("2_000_000tok", 2e6, "tok"), ("10K tok", 1e4, "tok"), ("500ba", 500, "ba"),
    ("2ep", 2, "ep"), ("10000sp", 1e4, "sp"), ("30min", 1800, "s"), ("1.5h", 5400, "s"), ("90s", 90, "s"),
    ("1M tok", 1e6, "tok"),
])
def test_durations(text, value, unit):
    d = parse_duration(text)
    assert (d.value, d.unit) == (value, unit)


@pytest.mark.parametrize("text", ["10 parsecs", "abc", "0tok", "-5ba", "5", "10Qtok"])
def test_bad_durations(text):
    with pytest.raises(ValueError):
        parse_duration(text)


BASE = {"model": "llama-tiny", "train_data": "x", "training_duration": "10ba"}


def test_a_warmup_of_none_is_accepted_and_a_bad_duration_says_its_value_once():
    """`warmup: 0ba` (no warmup) is a valid choice; a zero duration elsewhere is refused, the value
    quoted once ("must be positive, got '0ba'", not "… (got '0ba')" after it)."""
    cfg = build_config(BASE | {"parameters": {"warmup": "0ba"}})
    assert (cfg.parameters.warmup.value, cfg.parameters.warmup.unit) == (0, "ba")
    assert build_config(BASE | {"parameters": {"warmup": "0s"}}).parameters.warmup.value == 0
    with pytest.raises(UserError) as e:
        build_config(BASE | {"parameters": {"warmup": "-1ba"}})
    assert "parameters.warmup" in str(e.value)
    with pytest.raises(UserError) as e:
        build_config(BASE | {"training_duration": "0ba"})
    assert str(e.value) == "training_duration: duration must be positive, got '0ba'"
    with pytest.raises(UserError) as e:  # a value the message does not quote is still shown
        build_config(BASE | {"log_interval": 0})
    assert "(got 0)" in str(e.value)


def test_train_data_forms_and_mix():
    assert [d.path for d in build_config(BASE).train_data] == ["x"]
    cfg = build_config(BASE | {"train_data": {"web": {"path": "a", "proportion": 0.7}, "code": "b"}})
    assert [(d.name, d.path, d.proportion) for d in cfg.train_data] == [("web", "a", 0.7), ("code", "b", None)]
    cfg = build_config(BASE | {"train_data": ["a", "b"]})
    assert [d.name for d in cfg.train_data] == ["d0", "d1"]


def test_model_preset_with_overrides_and_custom_shape():
    cfg = build_config(BASE | {"model": {"preset": "llama-125m", "n_layers": 3}})
    assert (cfg.model.preset, cfg.model.d_model, cfg.model.n_layers) == ("llama-125m", 768, 3)
    cfg = build_config(BASE | {"model": {"d_model": 96, "n_layers": 2, "n_heads": 3}})
    assert cfg.model.preset is None and cfg.model.dim_head == 32


@pytest.mark.parametrize("model, label", [
    ("moe-tiny", "moe-tiny"),
    ({"preset": "moe-tiny", "vocab_size": 4096, "max_seq_len": 1024}, "moe-tiny"),  # set by tokenizer / run
    ({"preset": "moe-tiny", "n_experts": 0, "top_k": 0, "ffn_hidden": 512}, "moe-tiny (modified)"),
    ({"preset": "llama-125m", "n_layers": 3}, "llama-125m (modified)"),
    ({"d_model": 96, "n_layers": 2, "n_heads": 3}, "custom"),
])
def test_a_shape_is_named_by_its_preset_only_while_it_is_that_preset(model, label):
    """Logs, `runs list` and `estimate` name the shape: a dense twin written from moe-tiny's
    preset was listed as "moe-tiny"."""
    assert resolve_model(model).label() == label


def test_overrides_and_set(tmp_path):
    path = write_config(tmp_path / "run.yaml", BASE)
    cfg = load_config(str(path), overrides={"training_duration": "5ba", "model": "llama-125m"},
                      sets=["parameters.learning_rate=3e-4", "compute.compile=true", "eval.prompts=[a, b]"])
    assert str(cfg.training_duration) == "5ba" and cfg.model.preset == "llama-125m"
    assert cfg.parameters.learning_rate == 3e-4 and cfg.compute.compile is True
    assert cfg.eval.prompts == ("a", "b")
    assert cfg.name == "run"  # default name: the config file's name, so re-running resumes


@pytest.mark.parametrize("data,needle", [
    (BASE | {"parameters": {"learning_rat": 1}}, "unknown config key 'parameters.learning_rat' (did you mean 'learning_rate'?)"),
    (BASE | {"trainng_duration": "1ba"}, "did you mean 'training_duration'"),
    (BASE | {"model": "llama-tinyy"}, "unknown preset 'llama-tinyy' (did you mean 'llama-tiny'?); valid presets: llama-tiny"),
    (BASE | {"training_duration": "10 parsecs"}, "training_duration: unknown unit 'parsecs'"),
    (BASE | {"parameters": {"learning_rate": "fast"}}, "parameters.learning_rate"),
    (BASE | {"compute": {"data_parallel": "zero"}}, "compute.data_parallel"),
    (BASE | {"model": {"preset": "llama-tiny", "d_modl": 3}}, "model.d_modl"),
    ({"model": "llama-tiny", "train_data": "x"}, "missing required config key 'training_duration'"),
])
def test_config_errors_are_one_line_naming_the_key(data, needle):
    with pytest.raises(UserError) as e:
        build_config(data)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg


def test_defaults_scale_with_model_size():
    from lmforge.config.defaults import default_batch_tokens, default_learning_rate

    assert default_learning_rate(125e6) == pytest.approx(6e-4)
    assert default_learning_rate(7e9) == pytest.approx(1.2e-4)
    assert default_learning_rate(1e9) < default_learning_rate(125e6) < default_learning_rate(10e6)
    assert default_batch_tokens(125e6) == 524288 and default_batch_tokens(7e9) == 2097152


def test_dry_run_prints_resolved_config_and_plan(tmp_path):
    cfg = write_config(tmp_path / "big.yaml", {"model": "llama-1b", "train_data": "s3://bucket/data",
                                                "tokenizer": {"train": {"vocab_size": 32000}},
                                                "training_duration": "20B tok"})
    proc = cli("train", "-f", cfg, "--dry-run", "--json", check=True)  # in this process: no start-up
    out = json.loads(proc.stdout)
    params = out["config"]["parameters"]
    assert params["learning_rate"] == pytest.approx(2.2e-4, rel=0.05)
    assert params["context_length"] == 2048 and params["global_batch_size"] == 512
    assert out["config"]["name"] == "big" and out["config"]["model"]["vocab_size"] == 32000
    assert out["plan"]["flops"]["training"] == pytest.approx(6 * out["plan"]["params"]["active"] * 20e9, rel=0.01)
    # The time estimate uses the peak the run's MFU counts against, of the precision it trains in
    # here (fp32 on a CPU without AMX, where a bf16 peak — 2× with AVX512-BF16 — halved the estimate).
    assert params["precision"] in ("fp32", "bf16")
    assert out["plan"]["cluster"]["precision"] == params["precision"]
    text = cli("train", "-f", cfg, "--dry-run", check=True).stdout
    assert yaml.safe_load(text.split("---")[0])["parameters"]["global_batch_size"] == 512
    assert "steps:" in text


# --- bad input through the real CLI: one line, exit 2, no traceback, nothing overwritten -----------

@pytest.fixture
def good(tmp_path, tiny_data):
    return tiny_run_config(tiny_data, tmp_path / "run", training_duration="2ba", **{"eval.prompts": []})


def _cli(tmp_path, cfg, *extra):
    """`lmforge train` on a config refused before any process starts, in this process (no start-up)."""
    return cli("train", "-f", write_config(tmp_path / "bad.yaml", cfg), *extra)


def _run(tmp_path, cfg, *extra):
    """`lmforge train` on a config its training process refuses: a real process tree."""
    return lmforge("train", "-f", write_config(tmp_path / "bad.yaml", cfg), *extra)


def test_cli_unknown_key(tmp_path, good):
    assert_one_line_error(_cli(tmp_path, good | {"save_foldr": "x"}), "did you mean 'save_folder'")


def test_cli_wrong_type(tmp_path, good):
    good["parameters"]["seed"] = "seventeen"
    assert_one_line_error(_cli(tmp_path, good), "parameters.seed")


def test_cli_unknown_preset(tmp_path, good):
    assert_one_line_error(_cli(tmp_path, good | {"model": "gpt-5"}), "unknown preset", "llama-1b", "moe-9b")


def test_cli_unknown_duration_unit(tmp_path, good):
    assert_one_line_error(_cli(tmp_path, good | {"training_duration": "3 fortnights"}), "training_duration")


@pytest.mark.e2e
def test_cli_batch_not_divisible(tmp_path, good):
    good["parameters"].update(global_batch_size=10, micro_batch_size=4)
    assert_one_line_error(_run(tmp_path, good), "global_batch_size (10)", "micro_batch_size (4)")


@pytest.mark.e2e
def test_cli_context_longer_than_data(tmp_path, good):
    good["parameters"]["context_length"] = 128  # the tiny dataset has 64-token samples
    assert_one_line_error(_run(tmp_path, good), "context_length (128)", "64")


@pytest.mark.e2e
def test_cli_missing_train_data(tmp_path, good):
    assert_one_line_error(_run(tmp_path, good | {"train_data": str(tmp_path / "nope")}), "nope")


@pytest.mark.e2e
def test_cli_bad_set_and_missing_file(tmp_path, good):
    assert_one_line_error(_cli(tmp_path, good, "--set", "noequals"), "--set")
    assert_one_line_error(lmforge("train", "-f", tmp_path / "absent.yaml"), "absent.yaml")
    assert_one_line_error(lmforge("train", "--bogus-flag"), "--bogus-flag")


@pytest.mark.e2e
def test_cli_save_folder_of_another_run_is_refused(tmp_path, good):
    """A run of another name is never replaced, --overwrite included (issue 59); --overwrite replaces a
    run of the same name whose model or data changed."""
    lmforge("train", "-f", write_config(tmp_path / "a.yaml", good), check=True)
    run_json = (tmp_path / "run" / "run.json").read_bytes()
    weights = (tmp_path / "run" / "final" / "model.safetensors").read_bytes()
    other = good | {"name": "someone-else"}
    assert_one_line_error(_cli(tmp_path, other), f"holds run {good['name']!r}", "not 'someone-else'")
    assert_one_line_error(_cli(tmp_path, other, "--overwrite"), f"holds run {good['name']!r}",
                          "--overwrite replaces only a run of the same name")
    # refused by preflight, before the run is registered or any process starts
    assert "no run named 'someone-else'" in lmforge("runs", "describe", "someone-else").stderr
    assert (tmp_path / "run" / "run.json").read_bytes() == run_json
    assert (tmp_path / "run" / "final" / "model.safetensors").read_bytes() == weights
    # the same name with another model: refused as another run's checkpoints, replaced with --overwrite
    wider = json.loads(json.dumps(good))
    wider["model"]["d_model"] = 32
    assert_one_line_error(_run(tmp_path, wider), "holds checkpoints of a different run", "--overwrite")
    assert (tmp_path / "run" / "final" / "model.safetensors").read_bytes() == weights
    lmforge("train", "-f", tmp_path / "bad.yaml", "--overwrite", check=True)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["identity"]["model"]["d_model"] == 32


@pytest.mark.e2e
def test_cli_corrupt_checkpoint_on_resume(tmp_path, good):
    good["training_duration"] = "4ba"
    good["save_interval"] = "2ba"
    path = write_config(tmp_path / "a.yaml", good)
    lmforge("train", "-f", path, check=True)
    # Every checkpoint truncated (a damaged newest one alone falls back to the previous: test_bad_input)
    for f in (tmp_path / "run" / "checkpoints").glob("step_*/*.distcp"):
        f.write_bytes(f.read_bytes()[:100])  # truncated shard
    good["training_duration"] = "6ba"  # ask for more steps so it must resume
    write_config(path, good)
    proc = lmforge("train", "-f", path)
    assert_one_line_error(proc, "step_00000004", "--no-autoresume")
    # --no-autoresume starts fresh and keeps the old checkpoints aside
    lmforge("train", "-f", path, "--no-autoresume", check=True)
    assert list((tmp_path / "run").glob("checkpoints.old-*"))
