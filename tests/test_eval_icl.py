"""ICL scoring: each task type against a one-example-at-a-time reference, batching, limits,
categories, calibration, and the real benchmark files. Foundry's prompt and answer rules are
pinned in test_icl_rules.py."""

from __future__ import annotations

import random

import pytest
import torch

from eval_helpers import SHARED_EVAL, SHARED_TEXT, CharTokenizer, sentence, tiny_model, write_jsonl
from lmforge.errors import UserError
from lmforge.eval.icl import (
    TASK_TYPES, answer_matches, evaluate_icl, fewshot_indices, final_answer, load_tasks, score_task, summarize,
)
from lmforge.eval.icl_metrics import calibration_error

# ----------------------------------------------------------------------------- references
# Written apart from lmforge.eval: Foundry's prompt text for the character tokenizer (no special
# tokens; SentencePiece-like, so answers get no leading space), every option scored by its own
# forward pass on one unpadded sequence, generation token by token without a cache.


def ref_texts(task, i: int, k: int) -> list[tuple[str, str]]:
    """(context, answer) text per option of example i, by Foundry's layout (strip_dataset on)."""
    ex = task.examples[i]

    def demo(e):
        if task.task_type == "schema":
            return e["context_options"][e["gold"]], e["continuation"]
        if task.task_type == "multiple_choice":
            return e["query"], e["choices"][e["gold"]]
        if task.task_type == "language_modeling":
            return e["context"], e["continuation"]
        return e["context"], e["answer"]

    pre = task.prompt_string
    for j in fewshot_indices(task, i, k):
        c, a = demo(task.examples[j])
        pre += ("\n" if pre else "") + c + task.continuation_delimiter + a
    if task.task_type == "schema":
        head = ("\n" if pre else "")
        tail = task.continuation_delimiter.rstrip() if pre else ""
        return [(pre + head + c + tail, ex["continuation"]) for c in ex["context_options"]]
    context = (("\n" if pre else "") + demo(ex)[0] + task.continuation_delimiter).rstrip()
    answers = {"multiple_choice": ex.get("choices"), "language_modeling": [ex.get("continuation")]}.get(task.task_type)
    return [(pre + context, a) for a in (answers or [""])]


def ref_option(model, ctx: list[int], cont: list[int]) -> tuple[float, bool, float, float]:
    """(mean NLL, greedy match, min top-token probability, mean target probability)."""
    with torch.no_grad():  # one unpadded sequence, then token by token
        logits = model(torch.tensor([ctx + cont]))[0].float()
    nll, greedy, top, prob = [], True, [], []
    for j, target in enumerate(cont):
        lp = torch.log_softmax(logits[len(ctx) + j - 1], dim=-1)  # the position before token j
        nll.append(-lp[target].item())
        greedy = greedy and int(lp.argmax()) == target
        top.append(lp.exp().max().item())
        prob.append(lp[target].exp().item())
    return sum(nll) / len(nll), greedy, min(top), sum(prob) / len(prob)


def ref_generate(model, ids: list[int], max_new: int, tok) -> str:
    out: list[int] = []
    for _ in range(max_new):
        with torch.no_grad():
            t = int(model(torch.tensor([ids + out]))[0, -1].argmax())
        if t == tok.eos_id:
            break
        out.append(t)
    return " " + tok.decode(out)  # not a prefix-space tokenizer: composer adds the space back


def reference(model, tok, task, k: int, max_new: int = 6) -> list[tuple[bool, object, list[float], tuple | None]]:
    """(correct, prediction, scores, calibration) per example, one example and one option at a time."""
    rows = []
    for i, ex in enumerate(task.examples):
        texts = ref_texts(task, i, k)
        if task.task_type == "generation_task_with_answers":
            answer = final_answer(ref_generate(model, tok.encode(texts[0][0]), max_new, tok), task.stop_sequences)
            rows.append((answer_matches(answer, ex["aliases"]), answer, [], None))
            continue
        scored = [ref_option(model, tok.encode(c), tok.encode(a)) for c, a in texts]
        if task.task_type == "language_modeling":
            nll, greedy, top, _ = scored[0]
            rows.append((greedy, None, [nll], (top, greedy)))
            continue
        nlls = [s[0] for s in scored]
        pred = nlls.index(min(nlls))
        probs = [s[3] for s in scored]
        best = probs.index(max(probs))
        rows.append((pred == ex["gold"], pred, nlls, (max(probs) / sum(probs), best == ex["gold"])))
    return rows


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matmuls: a second thread only adds contention on a shared CPU (10x slower here).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok():
    return CharTokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model(tok.vocab_size, seed=0)


def _greedy_tokens(model, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            out.append(int(model(torch.tensor([ids + out]))[0, -1].argmax()))
    return out


@pytest.fixture(scope="module")
def task_files(tmp_path_factory, tok, model):
    """One small JSONL file per task type, written with a fixed seed."""
    root = tmp_path_factory.mktemp("icl")
    rng = random.Random(7)
    lm = []
    while len(lm) < 12:
        context = sentence(rng, 5)
        if len(lm) % 2 == 0:
            # The model's own greedy continuation, so some examples are right at 0 shots.
            g = tok.decode(_greedy_tokens(model, tok.encode(context), 3))
            if len(g) < 3 or g != g.strip():  # a special token, or spaces Foundry would strip
                continue
            lm.append({"context": context, "continuation": g, "category": "own"})
        else:
            lm.append({"context": context, "continuation": rng.choice(["zebra", "quartz"]), "category": "other"})
    mc = [{"query": sentence(rng, 4), "choices": [sentence(rng, rng.randint(1, 3)) for _ in range(rng.randint(2, 4))]}
          for _ in range(12)]
    for ex in mc:
        ex["gold"] = rng.randrange(len(ex["choices"]))
    schema = [{"context_options": [sentence(rng, rng.randint(2, 5)) for _ in range(rng.randint(2, 3))],
               "continuation": sentence(rng, 3)} for _ in range(12)]
    for ex in schema:
        ex["gold"] = rng.randrange(len(ex["context_options"]))
    gen = []
    for i in range(10):
        context = "Q: " + sentence(rng, 4) + "\nA:"
        out = ref_generate(model, tok.encode(context), 6, tok)
        # Half the aliases are what the model says, so accuracy is neither 0 nor 1.
        alias = out if i % 2 == 0 else "zebra quartz"
        gen.append({"context": context, "answer": sentence(rng, 2), "aliases": [alias, "never said"]})
    return {
        "language_modeling": write_jsonl(root / "lm.jsonl", lm),
        "multiple_choice": write_jsonl(root / "mc.jsonl", mc),
        "schema": write_jsonl(root / "schema.jsonl", schema),
        "generation_task_with_answers": write_jsonl(root / "gen.jsonl", gen),
    }


def _task(task_files, task_type, **options):
    entry = {"label": task_type[:6], "dataset_uri": str(task_files[task_type]), "num_fewshot": [0, 2],
             "icl_task_type": task_type, **options}
    if task_type == "language_modeling":
        entry.setdefault("continuation_delimiter", " ")
        entry.setdefault("has_categories", True)
    if task_type == "generation_task_with_answers":
        entry.setdefault("generation_kwargs", {"max_new_tokens": 6})
    if task_type != "generation_task_with_answers":
        entry.setdefault("metric_names", [{"language_modeling": "InContextLearningLMExpectedCalibrationError"}.get(
            task_type, "InContextLearningMCExpectedCalibrationError")])
    return load_tasks([entry])[0]


# ----------------------------------------------------------------------------- against the reference


@pytest.mark.integration
@pytest.mark.parametrize("task_type", TASK_TYPES)
def test_task_type_matches_reference(task_type, task_files, model, tok):
    task = _task(task_files, task_type)
    for k in task.num_fewshot:
        got = score_task(model, tok, task, k, batch_size=5)
        want = reference(model, tok, task, k)
        assert [r.correct for r in got] == [w[0] for w in want], (task_type, k)
        assert [r.prediction for r in got] == [w[1] for w in want], (task_type, k)
        for r, w in zip(got, want):
            assert r.scores == pytest.approx(w[2], abs=1e-4)
            if w[3] is not None:
                assert r.calibration[0] == pytest.approx(w[3][0], abs=1e-4) and r.calibration[1] == w[3][1]
        if task_type in ("multiple_choice", "schema"):  # lm-evaluation-harness's acc and acc_norm, by hand
            for i, r in enumerate(got):
                texts, gold = ref_texts(task, i, k), task.examples[i]["gold"]
                sums = [-ref_option(model, tok.encode(c), tok.encode(a))[0] * len(tok.encode(a)) for c, a in texts]
                per_char = [ll / len(a) for ll, (_, a) in zip(sums, texts)]
                assert (r.acc, r.acc_norm) == (sums.index(max(sums)) == gold, per_char.index(max(per_char)) == gold)
            result = summarize(task, got)
            assert result["acc"] == sum(r.acc for r in got) / len(got) and set(result["rules"]) == {
                "accuracy", "acc", "acc_norm"}
    if task_type in ("language_modeling", "generation_task_with_answers"):
        # Built so that half the examples are right at 0 shots: the test can fail both ways.
        zero = score_task(model, tok, task, 0)
        assert sum(r.correct for r in zero) == pytest.approx(len(zero) / 2, abs=1)


@pytest.mark.integration
def test_evaluate_icl_keys_categories_limit_and_mode(task_files, model, tok):
    tasks = [_task(task_files, t) for t in TASK_TYPES]
    model.train()
    results = evaluate_icl(model, tok, tasks, batch_size=4, limit=6)
    assert model.training  # mode restored
    model.eval()
    assert set(results) == {f"{t.label}/{k}-shot" for t in tasks for k in (0, 2)}
    for t in tasks:
        for k in (0, 2):
            r = results[f"{t.label}/{k}-shot"]
            assert r["n"] == 6 and r["size"] == len(t.examples) and 0.0 <= r["accuracy"] <= 1.0
            # A limit scores a prefix, with the few-shot draws the full run makes for it.
            full = score_task(model, tok, t, k)[:6]
            assert r["accuracy"] == pytest.approx(sum(x.correct for x in full) / 6)
            if t.task_type != "generation_task_with_answers":
                assert r["calibration_error"] == pytest.approx(calibration_error([x.calibration for x in full]))
    lm = results["langua/0-shot"]
    rows = score_task(model, tok, tasks[0], 0)[:6]

    def ece(category):
        return pytest.approx(calibration_error([x.calibration for x in rows if x.category == category]))

    assert lm["categories"] == {"other": {"accuracy": 0.0, "n": 3, "size": 6, "calibration_error": ece("other")},
                                "own": {"accuracy": 1.0, "n": 3, "size": 6, "calibration_error": ece("own")}}


@pytest.mark.parametrize("task_type", TASK_TYPES)
def test_batch_size_does_not_change_scores(task_type, task_files, model, tok):
    task = _task(task_files, task_type)
    one = score_task(model, tok, task, 2, batch_size=1)
    seven = score_task(model, tok, task, 2, batch_size=7)
    assert [(r.correct, r.prediction) for r in one] == [(r.correct, r.prediction) for r in seven]
    for a, b in zip(one, seven):
        assert a.scores == pytest.approx(b.scores, abs=1e-5)


@pytest.mark.integration
def test_generation_stops_only_on_foundry_criteria(tmp_path, tok, model):
    """Without early_stopping_criteria the whole budget is generated (newlines included); with
    them, the answer is cut at the first match, and the cut is the same as a full generation's."""
    rows = [{"context": "Q: " + sentence(random.Random(i), 3) + "\nA:", "answer": "ab", "aliases": ["xyz"]}
            for i in range(6)]
    path = write_jsonl(tmp_path / "g.jsonl", rows)
    entry = {"label": "g", "dataset_uri": str(path), "icl_task_type": "generation_task_with_answers",
             "generation_kwargs": {"max_new_tokens": 12}}
    plain = score_task(model, tok, load_tasks([entry])[0], 0)
    full = [ref_generate(model, tok.encode(r["context"]), 12, tok) for r in rows]
    assert [r.prediction for r in plain] == full
    stops = ["e", "a "]
    cut = score_task(model, tok, load_tasks([{**entry, "early_stopping_criteria": stops}])[0], 0)
    assert [r.prediction for r in cut] == [final_answer(f, stops) for f in full]
    # The default budget is the longest accepted answer in tokens: "xyz" is 3 characters.
    budget = score_task(model, tok, load_tasks([{**entry, "generation_kwargs": {}}])[0], 0)
    assert [r.prediction for r in budget] == [ref_generate(model, tok.encode(r["context"]), 3, tok) for r in rows]


def test_left_truncation_to_model_context(tmp_path, tok):
    rng = random.Random(3)
    rows = [{"context": sentence(rng, 40), "continuation": sentence(rng, 2)} for _ in range(4)]
    task = load_tasks([{"label": "long", "dataset_uri": str(write_jsonl(tmp_path / "long.jsonl", rows)),
                        "num_fewshot": [0], "icl_task_type": "language_modeling"}])[0]
    small = tiny_model(tok.vocab_size, seed=1, max_seq_len=64)
    got = score_task(small, tok, task, 0, batch_size=3)  # contexts are ~200 chars > 64
    for r, ex in zip(got, rows):
        cont = tok.encode(ex["continuation"])
        ctx = tok.encode(ex["context"])[-(64 - len(cont)):]
        assert r.scores == pytest.approx([ref_option(small, ctx, cont)[0]], abs=1e-4)
    with pytest.raises(UserError, match="leaves no room for context"):
        score_task(small, tok, task, 0, max_seq_len=4)  # no room left for any context


@pytest.mark.integration
def test_tasks_from_object_store(s3_env, tmp_path):
    import fsspec

    rows = [{"query": f"q{i}", "choices": ["a", "b"], "gold": i % 2} for i in range(4)]
    uri = f"s3://{s3_env.bucket}/eval/mc.jsonl"
    with fsspec.open(uri, "w") as f:
        f.write("".join(__import__("json").dumps(r) + "\n" for r in rows))
    task = load_tasks([{"label": "s3mc", "dataset_uri": uri, "num_fewshot": [1],
                        "icl_task_type": "multiple_choice"}])[0]
    assert task.examples == rows and task.source == uri
    with pytest.raises(UserError, match="not found"):
        load_tasks([{"label": "s3x", "dataset_uri": uri + ".missing", "icl_task_type": "multiple_choice"}])


# ----------------------------------------------------------------------------- the real benchmark files

needs_shared = pytest.mark.skipif(not SHARED_EVAL.is_dir(), reason="../shared/eval-data is not present")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    from lmforge.data.text.tokenizer import train_tokenizer

    if not SHARED_TEXT.is_file():
        pytest.skip("../shared/corpora/tinyshakespeare.txt is not present")
    out = tmp_path_factory.mktemp("bpe")
    sample = out / "sample.txt"
    sample.write_text(SHARED_TEXT.read_text()[:300_000])
    return train_tokenizer([str(sample)], 512, str(out / "tok"))


@pytest.fixture(scope="module")
def trained(bpe):
    """A tiny model trained for 60 steps on Shakespeare: it knows some English, no answers."""
    from lmforge.config.model import ModelConfig
    from lmforge.models import build_model

    ids = torch.tensor(bpe.encode(SHARED_TEXT.read_text()[:300_000]))
    torch.manual_seed(0)
    model = build_model(ModelConfig(d_model=64, n_layers=2, n_heads=4, vocab_size=bpe.vocab_size, max_seq_len=256))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        starts = torch.randint(0, len(ids) - 65, (16,))
        batch = torch.stack([ids[s:s + 65] for s in starts.tolist()])
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0  # it did learn something
    return model.eval()


SHARED_TASKS = [
    ("copa", "commonsense_reasoning/copa.jsonl", "multiple_choice", [0]),
    ("piqa", "commonsense_reasoning/piqa.jsonl", "multiple_choice", [0]),
    ("arc_easy", "world_knowledge/arc_easy.jsonl", "multiple_choice", [1]),
    ("winograd", "language_understanding/winograd_wsc.jsonl", "schema", [0]),
    ("lambada", "language_understanding/lambada_openai_small.jsonl", "language_modeling", [0]),
    ("triviaqa", "world_knowledge/triviaqa_small.jsonl", "generation_task_with_answers", [1]),
]


@pytest.mark.integration
@needs_shared
def test_shared_benchmarks_load_and_evaluate(trained, bpe):
    tasks = load_tasks([{"label": label, "dataset_uri": path, "icl_task_type": kind, "num_fewshot": shots}
                        for label, path, kind, shots in SHARED_TASKS], data_root=SHARED_EVAL)
    results = evaluate_icl(trained, bpe, tasks, batch_size=4, limit=6)
    assert set(results) == {f"{label}/{shots[0]}-shot" for label, _, _, shots in SHARED_TASKS}
    for r in results.values():
        assert r["n"] == 6 and 0.0 <= r["accuracy"] <= 1.0
    # Nobody learns trivia from 60 steps of Shakespeare.
    assert results["triviaqa/1-shot"]["accuracy"] == 0.0


@needs_shared
def test_shipped_task_yaml_resolves_against_data_root():
    tasks = load_tasks("default", data_root=SHARED_EVAL)
    assert {t.label for t in tasks} >= {"copa", "piqa", "arc_easy", "winograd", "lambada_openai", "triviaqa"}
    assert all(t.examples for t in tasks)


@needs_shared
def test_trained_model_scores_near_random_on_multiple_choice(trained, bpe):
    tasks = load_tasks([{"label": "copa", "dataset_uri": "commonsense_reasoning/copa.jsonl",
                         "icl_task_type": "multiple_choice"},
                        {"label": "winograd", "dataset_uri": "language_understanding/winograd_wsc.jsonl",
                         "icl_task_type": "schema"}], data_root=SHARED_EVAL)
    results = evaluate_icl(trained, bpe, tasks, batch_size=16, limit=100)
    for key in ("copa/0-shot", "winograd/0-shot"):
        assert results[key]["n"] == 100
        assert 0.3 <= results[key]["accuracy"] <= 0.7, (key, results[key])  # chance is 0.5
