"""Context extension: a model trained at 256 tokens continues at 1,024 with RoPE scaling (the
raw text packed again at the new length), beats the unextended model at 1,024, and exports
with its scaling, which transformers reads back to the same logits."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_run_config
from train_helpers import assert_one_line_error, cli, metrics, one_thread, train_in_process, write_config

SHAPE = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128, "max_seq_len": 256}
YARN = {"type": "yarn", "factor": 4.0, "original_max_seq_len": 256}


def held_out(model, batches) -> float:
    from lmforge.eval.heldout import heldout_loss

    return heldout_loss(model, batches, torch.device("cpu"))[0]


@pytest.mark.e2e
def test_a_256_token_model_extended_to_1024_beats_it_there_and_exports_its_scaling(tmp_path, tiny_data):
    from lmforge.config.load import build_config
    from lmforge.data.batch import StreamLayout
    from lmforge.plan.layout import Layout
    from lmforge.data.stream.run_data import resolve_data
    from lmforge.models import build_model
    from lmforge.train.export import export
    from lmforge.resolve.weights import fill_from_weights
    from lmforge.train.locate import load_model

    raw_text = str(tiny_data.raw)  # packed by the runs themselves: at 256, then again at 1,024
    base = tmp_path / "base"
    with one_thread():
        train_in_process(tiny_run_config(
            tiny_data, base, model=SHAPE, train_data=raw_text, training_duration="40ba", save_interval="40ba",
            **{"eval.interval": "100ba", "parameters.context_length": 256, "parameters.warmup": "4ba"}))

    long = tmp_path / "long"
    extend = tiny_run_config(
        tiny_data, long, model={"max_seq_len": 1024, "rope_scaling": YARN}, train_data=raw_text,
        custom_weights_path=str(base), task_type="continued_pretrain", training_duration="10ba",
        save_interval="10ba", **{"eval.interval": "100ba", "parameters.context_length": 1024,
                                 "parameters.global_batch_size": 4, "parameters.micro_batch_size": 2,
                                 "parameters.learning_rate": 1e-3, "parameters.warmup": "2ba"})
    del extend["tokenizer"]  # the weights' own (base/final)
    logs: list[str] = []
    with one_thread():
        result = train_in_process(extend, log=logs.append)
    assert any("preparing" in line and "seq 1024" in line for line in logs), logs  # packed again at 1,024
    losses = [r["train/loss"] for r in metrics(long) if "train/loss" in r]
    assert len(losses) == 10 and losses[-1] < losses[0]

    # Both models on the same held-out rows of 1,024 tokens; the unextended one reads positions
    # past its 256 (RoPE extrapolated), as it would if simply run longer.
    cfg = build_config(fill_from_weights(extend))
    data = resolve_data(cfg, 1024, log=lambda *_: None)
    rows = data.eval_sets(StreamLayout(seq_len=1024, layout=Layout(global_batch=2, micro_batch=2)), max_batches=2)[0]
    unextended, shape, _ = load_model(str(base / "final"))
    at_1024 = build_model(shape.model_copy(update={"max_seq_len": 1024}), init=False)
    at_1024.load_state_dict(unextended.state_dict())
    extended, long_shape, _ = load_model(result.final_dir)
    assert long_shape.rope_scaling.type == "yarn" and long_shape.max_seq_len == 1024
    with one_thread():
        assert held_out(extended, rows.batches()) < held_out(at_1024, rows.batches())

    # Hugging Face export: config.json carries the scaling; transformers computes the same logits
    # over all 1,024 positions.
    import transformers

    hf_dir = export(result.final_dir, str(tmp_path / "hf"))
    config = json.loads((hf_dir / "config.json").read_text())
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 4.0, 256)
    assert config["max_position_embeddings"] == 1024
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32).eval()
    ids = next(iter(rows.batches())).input_ids[:1]
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, extended(ids), rtol=1e-4, atol=1e-4)


def test_rope_scaling_a_trained_model_cannot_carry_is_one_line(tmp_path, tiny_data):
    """dynamic NTK (and longrope) have no fixed form to train or export: refused, with what to do."""
    cfg = write_config(tmp_path / "bad.yaml", tiny_run_config(
        tiny_data, tmp_path / "bad", model=SHAPE | {"rope_scaling": {"type": "dynamic", "factor": 2.0}}))
    proc = cli("train", "-f", cfg)
    assert_one_line_error(proc, "rope_scaling", "'dynamic' is not supported", "raise model.rope_theta")
    assert not (tmp_path / "bad").exists()
