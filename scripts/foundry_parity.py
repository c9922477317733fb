"""Cross-check `lmforge eval` against LLM Foundry's own ICL dataset and metric classes.

For each task and shot count this builds Foundry's dataloader (its few-shot draws, prompts,
tokenization, collation and category split, run from Foundry's source) and lmforge's sequences
for the same examples, and scores both with the same model: Foundry's batches go through the
Hugging Face export of the checkpoint and Foundry's metric classes, lmforge's through
`lmforge.eval.icl.score_task`. It prints, per task/shots, both accuracies and how many examples
got identical token sequences and identical predictions.

LLM Foundry is not an lmforge dependency (it pins its own torch and needs Composer's trainer).
Put its source and the three small packages its ICL modules import in a folder:

    pip install --no-deps --target /tmp/foundry llm-foundry==0.22.0 mosaicml==0.32.1 \\
        torchmetrics lightning-utilities catalogue
    python scripts/foundry_parity.py --foundry /tmp/foundry --checkpoint runs/quickstart/final \\
        --data-root ../shared/eval-data --limit 100

What runs from Foundry: `llmfoundry.eval.datasets` (through its `get_icl_task_dataloader`, the
task-config mapping of `build_icl_evaluators` redone here) and `llmfoundry.eval.metrics`.
What does not: Composer's package (it imports torchvision, which has no CPU build here). The few
Composer names Foundry's dataset module imports (`DataSpec`, `dist`, `get_file`) are replaced by
single-process stand-ins below, and the forward/generate step follows Composer's
`HuggingFaceModel.eval_forward` (labels shifted left; `generate` with the batch's
`generation_kwargs`, the prompt cut off, special tokens skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import shutil
import sys
import tempfile
import types
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TASKS = [  # Foundry task entries (relative dataset_uri resolve against --data-root)
    {"label": "copa", "dataset_uri": "commonsense_reasoning/copa.jsonl", "icl_task_type": "multiple_choice"},
    {"label": "piqa", "dataset_uri": "commonsense_reasoning/piqa.jsonl", "icl_task_type": "multiple_choice",
     "continuation_delimiter": "\nAnswer: "},
    {"label": "arc_easy", "dataset_uri": "world_knowledge/arc_easy.jsonl", "icl_task_type": "multiple_choice",
     "continuation_delimiter": "\nAnswer: "},
    {"label": "boolq", "dataset_uri": "reading_comprehension/boolq.jsonl", "icl_task_type": "multiple_choice",
     "continuation_delimiter": "\nAnswer: "},
    {"label": "winograd", "dataset_uri": "language_understanding/winograd_wsc.jsonl", "icl_task_type": "schema"},
    {"label": "winogrande", "dataset_uri": "language_understanding/winogrande.jsonl", "icl_task_type": "schema"},
    {"label": "lambada_openai", "dataset_uri": "language_understanding/lambada_openai.jsonl",
     "icl_task_type": "language_modeling"},
    {"label": "jeopardy", "dataset_uri": "world_knowledge/jeopardy_small.jsonl", "icl_task_type": "language_modeling",
     "continuation_delimiter": "\nAnswer: ", "has_categories": True},
    {"label": "triviaqa", "dataset_uri": "world_knowledge/triviaqa_small.jsonl",
     "icl_task_type": "generation_task_with_answers"},
]


# ----------------------------------------------------------------------------- Foundry, imported from its source


class _DataSpec:
    def __init__(self, dataloader, **kwargs):
        self.dataloader = dataloader


class _Dist:
    """Composer's `dist` for one process."""

    @staticmethod
    def get_local_rank():
        return 0

    get_global_rank = get_local_rank

    @staticmethod
    def get_world_size():
        return 1

    @staticmethod
    def barrier():
        pass

    @staticmethod
    def all_gather_object(obj):
        return [obj]

    @staticmethod
    def local_rank_zero_download_and_wait(path):
        return contextlib.nullcontext()

    @staticmethod
    def get_sampler(dataset, drop_last=False, shuffle=False):
        return torch.utils.data.SequentialSampler(dataset)


def _get_file(path, destination, overwrite=False):
    shutil.copyfile(path, destination)


def import_foundry(folder: str):
    """Foundry's ICL datasets and metrics, without running llmfoundry/__init__ (which imports
    every model, callback and Composer's trainer)."""
    root = Path(folder)
    if not (root / "llmfoundry" / "eval" / "datasets").is_dir():
        raise SystemExit(f"--foundry {folder}: no llmfoundry/eval/datasets in it (see this script's docstring)")
    sys.path.insert(0, str(root))

    def package(name, path=None, **attrs):
        mod = types.ModuleType(name)
        mod.__path__ = [str(path)] if path else []
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        return mod

    package("composer")
    package("composer.core", DataSpec=_DataSpec)
    package("composer.core.data_spec", _default_split_batch=None, _split_list=None)
    package("composer.utils", dist=_Dist, get_file=_get_file, MissingConditionalImportError=ImportError)
    package("llmfoundry", root / "llmfoundry")
    package("llmfoundry.utils", root / "llmfoundry" / "utils")
    from llmfoundry.utils.registry_utils import create_registry

    package("llmfoundry.registry", icl_datasets=create_registry("llmfoundry", "icl_datasets", generic_type=type))
    import datasets

    datasets.disable_caching()
    datasets.disable_progress_bars()
    from llmfoundry.eval.datasets import get_icl_task_dataloader
    from llmfoundry.eval.metrics import nlp

    return get_icl_task_dataloader, nlp


DEFAULT_METRIC = {"language_modeling": "InContextLearningLMAccuracy",
                  "multiple_choice": "InContextLearningMultipleChoiceAccuracy",
                  "schema": "InContextLearningMultipleChoiceAccuracy",
                  "generation_task_with_answers": "InContextLearningGenerationExactMatchAccuracy"}


def foundry_loaders(get_loader, cfg: dict, k: int, tokenizer, max_seq_len: int, batch_size: int, tmp: Path) -> dict:
    """{category or None: DataLoader}, built as Foundry's build_icl_evaluators builds them."""
    kwargs = copy.deepcopy(cfg)
    for key in ("label", "metric_names", "icl_task_type", "batch_size", "has_categories", "num_fewshot"):
        kwargs.pop(key, None)
    if "question_prelimiter" in kwargs:
        kwargs["prelimiter"] = kwargs.pop("question_prelimiter")
    kwargs.setdefault("max_seq_len", max_seq_len)
    kwargs["pad_tok_id"] = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    kwargs["num_fewshot"] = k
    out = get_loader(icl_task_type=cfg["icl_task_type"], dataset_uri=cfg["dataset_uri"], tokenizer=tokenizer,
                     batch_size=batch_size, has_categories=cfg.get("has_categories", False),
                     hf_loading_vars=cfg.get("hf_loading_vars", {}), hf_parsing_map=cfg.get("hf_parsing_map", {}),
                     destination_path=str(tmp / f"{cfg['label']}-{k}.jsonl"), kwargs=kwargs)
    return {c: spec.dataloader for c, spec in out.items()} if isinstance(out, dict) else {None: out.dataloader}


def foundry_batch_rows(batch: dict, task_type: str) -> list:
    """The token sequences of a collated Foundry batch, per example: for likelihood tasks a list
    of (context, continuation) per option, for generation the prompt ids."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if task_type == "generation_task_with_answers":
        return [ids[r][mask[r]].tolist() for r in range(len(ids))]
    pairs = []
    for r in range(len(ids)):
        real = ids[r][mask[r]].tolist()
        cont = batch["continuation_indices"][r].tolist()
        pairs.append((real[:cont[0]], [real[i] for i in cont]))
    if task_type == "language_modeling":
        return [[p] for p in pairs]
    return [pairs[a:b] for a, b in batch["choice_groupings"]]


def foundry_score(hf_model, hf_tok, batch: dict, metric) -> list[tuple[bool, object]]:
    """Composer's eval_forward + Foundry's metric update: (right, prediction) per example; the
    prediction is the chosen option (multiple choice, schema), the normalized answer
    (generation), or None (language modeling: right or wrong is all there is)."""
    batch = dict(batch)
    labels = batch.pop("labels")
    with torch.no_grad():
        if batch.get("mode") == "generate":
            out = hf_model.generate(batch["input_ids"], attention_mask=batch["attention_mask"],
                                    **batch.get("generation_kwargs", {}))
            new = out[:, batch["input_ids"].shape[1]:]
            texts = hf_tok.batch_decode(new, skip_special_tokens=True)
            if len(hf_tok(" a", add_special_tokens=False)["input_ids"]) != 1:
                texts = [" " + t for t in texts]
            result = metric.update(batch, texts, labels)
        else:
            labels = labels.clone()
            labels[:, :-1] = labels[:, 1:].clone()
            labels[:, -1] = -100
            # Right padding: columns past every row's last real token change no real position's
            # logits under causal attention, so they are dropped to save time.
            width = int(batch["attention_mask"].sum(1).max())
            logits = hf_model(input_ids=batch["input_ids"][:, :width],
                              attention_mask=batch["attention_mask"][:, :width]).logits
            pad = torch.zeros(logits.shape[0], batch["input_ids"].shape[1] - width, logits.shape[2])
            result = metric.update(batch, torch.cat([logits, pad], 1), labels)
    preds = result.get("selected_choice_idx") or result.get("cleaned_output") or [None] * len(result["result"])
    return [(bool(r), p) for r, p in zip(result["result"], preds)]


# ----------------------------------------------------------------------------- lmforge's side


def lmforge_rows(task, tokenizer, k: int, members: list[int], max_seq_len: int) -> list:
    from lmforge.eval.icl_prompts import (
        answer_budget, fewshot_choices, generation_prompt, likelihood_sequences, needs_prefix_space,
    )

    demos = fewshot_choices(task, k)
    if task.task_type == "generation_task_with_answers":
        budget = task.generation.get("max_new_tokens") or answer_budget(task, tokenizer, members)
        return [generation_prompt(task, tokenizer, i, demos[i], max_seq_len - budget) for i in members]
    prefix = needs_prefix_space(tokenizer)
    return [likelihood_sequences(task, tokenizer, i, demos[i], max_seq_len, prefix) for i in members]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--foundry", required=True, help="folder holding llmfoundry/ (pip install --no-deps --target)")
    ap.add_argument("--checkpoint", required=True,
                    help="a run folder (its latest checkpoint), a final/ folder or an export")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder, when the checkpoint has none beside it")
    ap.add_argument("--data-root", default=str(REPO.parent / "shared" / "eval-data"))
    ap.add_argument("--tasks", default=None,
                    help="a Foundry task YAML; --shots replaces its num_fewshot (default: DEFAULT_TASKS)")
    ap.add_argument("--shots", default="0,3")
    ap.add_argument("--limit", type=int, default=100, help="examples per task (per category for categories)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--show", action="store_true", help="print every example whose predictions differ")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    get_loader, nlp = import_foundry(args.foundry)

    import transformers

    from lmforge.cli.eval import _load_checkpoint
    from lmforge.eval.icl import score_task
    from lmforge.tasks.icl import load_tasks

    from lmforge.train.export import export

    # Both sides load lmforge's Hugging Face export of the checkpoint: the same weights file.
    hf_dir = Path(tempfile.mkdtemp(prefix="foundry-parity-")) / "hf"
    export(args.checkpoint, str(hf_dir), fmt="hf", tokenizer=args.tokenizer)
    model, tok = _load_checkpoint(str(hf_dir), "cpu")
    model.eval()
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    max_seq_len = model.cfg.max_seq_len
    entries = yaml.safe_load(Path(args.tasks).read_text())["icl_tasks"] if args.tasks else DEFAULT_TASKS
    shots = [int(s) for s in args.shots.split(",")]

    print(f"# {args.checkpoint}; first {args.limit} examples per task (per category); max_seq_len {max_seq_len}")
    print("| task | shots | n | lmforge | Foundry | same tokens | same predictions |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for entry in entries:
            task = load_tasks([{**entry, "num_fewshot": shots}], data_root=args.data_root)[0]
            cfg = {**entry, "dataset_uri": task.source}
            for k in shots:
                loaders = foundry_loaders(get_loader, cfg, k, hf_tok, max_seq_len, args.batch_size, Path(tmp))
                n = same_tokens = same_pred = ours_right = theirs_right = 0
                for category, loader in loaders.items():
                    members = task.partitions[category][:args.limit]
                    ours = score_task(model, tok, task, k, limit=max(members) + 1)
                    ours = {r.index: r for r in ours}
                    seqs = lmforge_rows(task, tok, k, members, max_seq_len)
                    metric = getattr(nlp, (cfg.get("metric_names") or [DEFAULT_METRIC[task.task_type]])[0])()
                    pos = 0
                    for batch in loader:
                        rows = foundry_batch_rows(batch, task.task_type)
                        results = foundry_score(hf_model, hf_tok, batch, metric)
                        for theirs_seq, (right, pred) in zip(rows, results):
                            if pos >= len(members):
                                break
                            i = members[pos]
                            n += 1
                            same_tokens += theirs_seq == seqs[pos]
                            mine = ours[i]
                            theirs_view = mine.prediction
                            if task.task_type == "generation_task_with_answers":  # compare as Foundry cleans
                                theirs_view = metric.normalize_answer(mine.prediction) if task.do_normalization \
                                    else mine.prediction.strip()
                            same = right == mine.correct and (pred is None or pred == theirs_view)
                            same_pred += same
                            ours_right += mine.correct
                            theirs_right += right
                            if not same and args.show:
                                print(f"  {task.label}/{k} {task.locations[i]}: lmforge {mine.prediction!r} "
                                      f"({mine.correct}), Foundry {pred!r} ({right})")
                            pos += 1
                        if pos >= len(members):
                            break
                print(f"| {task.label} | {k} | {n} | {ours_right / n:.3f} | {theirs_right / n:.3f} | "
                      f"{same_tokens}/{n} | {same_pred}/{n} |", flush=True)
    shutil.rmtree(hf_dir.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
