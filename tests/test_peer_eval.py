"""Proof with a peer: EleutherAI's lm-evaluation-harness scores an exported lmforge model (a
Qwen3-family one, through transformers) on a local JSONL task, and its log-likelihoods agree
with lmforge's own ICL scorer on the same prompts. Offline: no hub, no dataset download."""

from __future__ import annotations

import json

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

ROWS = [
    {"context": "def add(a, b):\n    return", "continuation": "a + b"},
    {"context": "import os\nimport", "continuation": "sys"},
    {"context": "class Stack:\n    def push(self, x):\n        self.items.", "continuation": "append(x)"},
    {"context": "for i in", "continuation": "range(10):"},
]


@pytest.mark.integration
def test_lm_eval_agrees_with_lmforge_loglikelihoods(tmp_path, tiny_data, monkeypatch):
    from lm_eval.tasks import TaskManager

    from lmforge.config.model import ModelConfig
    from lmforge.data.text.tokenizer import load_tokenizer
    from lmforge.eval.icl import load_tasks, score_task
    from lmforge.models import build_model, save_pretrained
    from lmforge.train.export import export

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=128,
                      vocab_size=512, qk_norm="head")
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    save_pretrained(model, cfg, tmp_path / "ours", tokenizer_dir=tiny_data.tokenizer)
    export(str(tmp_path / "ours"), str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]

    data = tmp_path / "peer.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "tasks").mkdir()
    # The scored continuation is " " + continuation on both sides: lmforge's language-modeling
    # tasks put their default continuation_delimiter " " there; lm-eval 0.4 scores
    # doc_to_target as given for loglikelihood tasks, so the space is written into it.
    (tmp_path / "tasks" / "peer.yaml").write_text(
        "task: lmforge_peer\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: loglikelihood\ndoc_to_text: '{{context}}'\ndoc_to_target: \"{{' ' + continuation}}\"\n"
        "target_delimiter: ''\n"
        "metric_list:\n  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n")
    out = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={tmp_path / 'hf'},dtype=float32", device="cpu", batch_size=2,
        tasks=["lmforge_peer"], task_manager=TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False),
        log_samples=True, bootstrap_iters=0)
    theirs = {s["doc"]["context"]: s["resps"][0][0][0] for s in out["samples"]["lmforge_peer"]}
    assert len(theirs) == len(ROWS)

    tok = load_tokenizer(tmp_path / "ours")
    task = load_tasks([{"label": "peer", "dataset_uri": str(data), "icl_task_type": "language_modeling",
                        "num_fewshot": [0]}])[0]
    ours = score_task(model, tok, task, 0)
    for row, result in zip(ROWS, ours):
        n = len(tok.encode(" " + row["continuation"]))
        mine = -result.scores[0] * n  # lmforge scores the mean NLL per continuation token
        assert mine == pytest.approx(theirs[row["context"]], abs=1e-4), row
