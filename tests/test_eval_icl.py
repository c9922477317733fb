"""ICL tasks: each type against a one-example-at-a-time reference, batching, few-shot, bad input."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from eval_helpers import SHARED_EVAL, SHARED_TEXT, CharTokenizer, sentence, tiny_model, write_jsonl
from lmforge.errors import UserError
from lmforge.eval.icl import (
    TASK_TYPES, answer_matches, evaluate_icl, fewshot_indices, fewshot_prefix, load_tasks, normalize_answer,
    score_task,
)

# ----------------------------------------------------------------------------- references
# Written independently of lmforge.eval.icl: prompts assembled by hand for the default
# delimiters, every continuation token scored by its own forward pass on one unpadded sequence.


def ref_prompt(task, index: int, k: int, context: str, answer: str, demo) -> tuple[str, str]:
    parts = [task.prompt_string] if task.prompt_string else []
    for j in fewshot_indices(task, index, k):
        c, a = demo(task.examples[j])
        parts.append(c + task.continuation_delimiter + a)
    parts.append(context)
    return "\n".join(parts), task.continuation_delimiter + answer


def ref_option(model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    with torch.no_grad():  # one unpadded sequence, then token by token
        logits = model(torch.tensor([ctx + cont]))[0].float()
    nll, greedy = [], True
    for j, target in enumerate(cont):
        lp = torch.log_softmax(logits[len(ctx) + j - 1], dim=-1)  # the position before token j
        nll.append(-lp[target].item())
        greedy = greedy and int(lp.argmax()) == target
    return sum(nll) / len(nll), greedy


def ref_generate(model, ids: list[int], max_new: int, tok, stops: list[str]) -> str:
    out: list[int] = []
    for _ in range(max_new):
        with torch.no_grad():
            t = int(model(torch.tensor([ids + out]))[0, -1].argmax())
        if t == tok.eos_id:
            break
        out.append(t)
        if any(s in tok.decode(out) for s in stops):
            break
    text = tok.decode(out)
    for s in stops:
        text = text.split(s)[0]
    return text


def reference(model, tok, task, k: int) -> list[tuple[bool, object, list[float]]]:
    """(correct, prediction, scores) per example, one example and one option at a time."""
    rows = []
    for i, ex in enumerate(task.examples):
        if task.task_type == "language_modeling":
            c, a = ref_prompt(task, i, k, ex["context"], ex["continuation"], lambda e: (e["context"], e["continuation"]))
            nll, greedy = ref_option(model, tok.encode(c), tok.encode(a))
            rows.append((greedy, None, [nll]))
        elif task.task_type in ("multiple_choice", "schema"):
            if task.task_type == "multiple_choice":
                demo = lambda e: (e["query"], e["choices"][e["gold"]])  # noqa: E731
                pairs = [(ex["query"], ch) for ch in ex["choices"]]
            else:
                demo = lambda e: (e["context_options"][e["gold"]], e["continuation"])  # noqa: E731
                pairs = [(opt, ex["continuation"]) for opt in ex["context_options"]]
            scores = []
            for context, answer in pairs:
                c, a = ref_prompt(task, i, k, context, answer, demo)
                scores.append(ref_option(model, tok.encode(c), tok.encode(a))[0])
            pred = scores.index(min(scores))
            rows.append((pred == ex["gold"], pred, scores))
        else:
            c, _ = ref_prompt(task, i, k, ex["context"], "", lambda e: (e["context"], e["answer"]))
            text = ref_generate(model, tok.encode(c), 6, tok, ["\n"])
            rows.append((answer_matches(text, ex["aliases"]), text, []))
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
            g = _greedy_tokens(model, tok.encode(context), 3)
            if min(g) < 3:  # a special token has no text; try another context
                continue
            lm.append({"context": context, "continuation": tok.decode(g), "category": "own"})
        else:
            lm.append({"context": context, "continuation": " " + rng.choice(["zebra", "quartz"]), "category": "other"})
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
        out = ref_generate(model, tok.encode(context), 6, tok, ["\n"])
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
        entry.setdefault("continuation_delimiter", "")  # continuations carry their own spacing
        entry.setdefault("has_categories", True)
    if task_type == "generation_task_with_answers":
        entry.setdefault("generation_kwargs", {"max_new_tokens": 6})
    return load_tasks([entry])[0]


# ----------------------------------------------------------------------------- against the reference


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
    if task_type in ("language_modeling", "generation_task_with_answers"):
        # Built so that half the examples are right at 0 shots: the test can fail both ways.
        zero = score_task(model, tok, task, 0)
        assert sum(r.correct for r in zero) == pytest.approx(len(zero) / 2, abs=1)


def test_evaluate_icl_keys_categories_and_mode(task_files, model, tok):
    tasks = [_task(task_files, t) for t in TASK_TYPES]
    model.train()
    results = evaluate_icl(model, tok, tasks, batch_size=4, limit=6)
    assert model.training  # mode restored
    model.eval()
    assert set(results) == {f"{t.label}/{k}-shot" for t in tasks for k in (0, 2)}
    for r in results.values():
        assert r["n"] == 6 and 0.0 <= r["accuracy"] <= 1.0
    lm = results["langua/0-shot"]
    assert set(lm["categories"]) == {"own", "other"}
    assert lm["categories"]["other"]["accuracy"] == 0.0
    assert lm["categories"]["own"]["accuracy"] == 1.0
    ref = reference(model, tok, tasks[1], 2)[:6]
    assert results["multip/2-shot"]["accuracy"] == pytest.approx(sum(w[0] for w in ref) / 6)


@pytest.mark.parametrize("task_type", TASK_TYPES)
def test_batch_size_does_not_change_scores(task_type, task_files, model, tok):
    task = _task(task_files, task_type)
    one = score_task(model, tok, task, 2, batch_size=1)
    seven = score_task(model, tok, task, 2, batch_size=7)
    assert [(r.correct, r.prediction) for r in one] == [(r.correct, r.prediction) for r in seven]
    for a, b in zip(one, seven):
        assert a.scores == pytest.approx(b.scores, abs=1e-5)


def test_left_truncation_to_model_context(tmp_path, tok):
    rng = random.Random(3)
    rows = [{"context": sentence(rng, 40), "continuation": " " + sentence(rng, 2)} for _ in range(4)]
    task = load_tasks([{"label": "long", "dataset_uri": str(write_jsonl(tmp_path / "long.jsonl", rows)),
                        "num_fewshot": [0], "icl_task_type": "language_modeling"}])[0]
    small = tiny_model(tok.vocab_size, seed=1, max_seq_len=64)
    got = score_task(small, tok, task, 0, batch_size=3)  # contexts are ~200 chars > 64
    for r, ex in zip(got, rows):
        cont = tok.encode(ex["continuation"])
        ctx = tok.encode(ex["context"])[-(64 - len(cont)):]
        assert r.scores == pytest.approx([ref_option(small, ctx, cont)[0]], abs=1e-4)


# ----------------------------------------------------------------------------- few-shot


def test_fewshot_sampling_is_deterministic_and_excludes_the_example(task_files):
    task = _task(task_files, "multiple_choice")
    n = len(task.examples)
    seen = set()
    for i in range(n):
        picks = fewshot_indices(task, i, n - 1)
        assert sorted(picks) == [j for j in range(n) if j != i]  # every other example, never itself
        three = fewshot_indices(task, i, 3)
        assert three == fewshot_indices(task, i, 3) and len(set(three)) == 3 and i not in three
        seen.add(tuple(three))
    assert len(seen) > n // 2  # the seed differs per example
    again = _task(task_files, "multiple_choice")
    assert [fewshot_prefix(again, i, 3) for i in range(n)] == [fewshot_prefix(task, i, 3) for i in range(n)]
    other_seed = _task(task_files, "multiple_choice", fewshot_random_seed=99)
    assert [fewshot_indices(other_seed, i, 3) for i in range(n)] != [fewshot_indices(task, i, 3) for i in range(n)]
    # Same choice in a fresh interpreter (no dependence on hash randomization).
    code = ("import sys; sys.path.insert(0, 'tests'); from lmforge.eval.icl import load_tasks, fewshot_indices;"
            f"t = load_tasks([{{'label': 'multip', 'dataset_uri': {str(task_files['multiple_choice'])!r},"
            "'num_fewshot': [0, 2], 'icl_task_type': 'multiple_choice'}])[0];"
            f"print([fewshot_indices(t, i, 3) for i in range({n})])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str([fewshot_indices(task, i, 3) for i in range(n)])


def test_prompt_layout_with_prompt_string(task_files):
    task = _task(task_files, "multiple_choice", prompt_string="Pick one.", example_delimiter="\n\n",
                 continuation_delimiter="\nAnswer: ")
    ex = task.examples
    demos = fewshot_indices(task, 0, 2)
    expected = "Pick one." + "".join(f"\n\n{ex[j]['query']}\nAnswer: {ex[j]['choices'][ex[j]['gold']]}" for j in demos)
    assert fewshot_prefix(task, 0, 2) == expected


def test_normalized_answer_matching():
    assert normalize_answer("  The  Eiffel-Tower!! ") == "eiffeltower"
    assert answer_matches(" The Sunset Boulevard, obviously", ["Sunset Blvd", "sunset boulevard"])
    assert not answer_matches(" Sunset", ["Sunset Boulevard"])
    assert answer_matches(" an apple a day", ["Apple"])
    assert not answer_matches(" Apple", ["apple"], normalize=False)


# ----------------------------------------------------------------------------- bad input


def _bad(tmp_path, rows_text: str, task_type="multiple_choice", **entry):
    path = tmp_path / "bad.jsonl"
    path.write_text(rows_text)
    spec = {"label": "bad", "dataset_uri": str(path), "num_fewshot": [0], "icl_task_type": task_type, **entry}
    with pytest.raises(UserError) as e:
        load_tasks([spec])
    return str(e.value)


def test_bad_task_files_name_file_line_and_field(tmp_path):
    good = '{"query": "q", "choices": ["a", "b"], "gold": 0}\n'
    msg = _bad(tmp_path, good + '{"query": "q", "choices": ["a", "b"]}\n')
    assert "bad.jsonl:line 2" in msg and "'gold'" in msg
    msg = _bad(tmp_path, good + "not json\n")
    assert "bad.jsonl:line 2" in msg and "JSON" in msg
    msg = _bad(tmp_path, good + '{"query": "q", "choices": ["a", "b"], "gold": 2}\n')
    assert "line 2" in msg and "gold" in msg and "out of range" in msg
    msg = _bad(tmp_path, '{"context_options": ["a"], "gold": 0}\n', task_type="schema")
    assert "line 1" in msg and "'continuation'" in msg
    msg = _bad(tmp_path, good, task_type="code_evaluation")
    assert "unknown icl_task_type" in msg and all(t in msg for t in TASK_TYPES)
    msg = _bad(tmp_path, good * 3, num_fewshot=[0, 3])
    assert "num_fewshot 3" in msg and "has 3" in msg
    msg = _bad(tmp_path, good, nonsense_key=1)
    assert "nonsense_key" in msg
    msg = _bad(tmp_path, "")
    assert "no examples" in msg
    with pytest.raises(UserError, match="not found"):
        load_tasks([{"label": "x", "dataset_uri": str(tmp_path / "missing.jsonl"), "icl_task_type": "schema"}])
    with pytest.raises(UserError, match="tasks file .* not found"):
        load_tasks(str(tmp_path / "nope.yaml"))
    (tmp_path / "t.yaml").write_text("icl_tasks: [{label: a, dataset_uri: bad.jsonl, icl_task_type: schema}, "
                                     "{label: a, dataset_uri: bad.jsonl, icl_task_type: schema}]\n")
    (tmp_path / "bad.jsonl").write_text('{"context_options": ["a", "b"], "continuation": "c", "gold": 1}\n')
    with pytest.raises(UserError, match="duplicate label 'a'"):
        load_tasks(tmp_path / "t.yaml")  # relative dataset_uri resolves next to the YAML


def test_tasks_from_object_store(s3_env, tmp_path):
    import fsspec

    rows = [{"query": f"q{i}", "choices": ["a", "b"], "gold": i % 2} for i in range(4)]
    uri = f"s3://{s3_env.bucket}/eval/mc.jsonl"
    with fsspec.open(uri, "w") as f:
        f.write("".join(__import__("json").dumps(r) + "\n" for r in rows))
    task = load_tasks([{"label": "s3mc", "dataset_uri": uri, "num_fewshot": [1], "icl_task_type": "multiple_choice"}])[0]
    assert task.examples == rows and task.source == uri
    with pytest.raises(UserError, match="not found"):
        load_tasks([{"label": "s3x", "dataset_uri": uri + ".missing", "icl_task_type": "multiple_choice"}])


# ----------------------------------------------------------------------------- the real benchmark files

needs_shared = pytest.mark.skipif(not SHARED_EVAL.is_dir(), reason="../shared/eval-data is not present")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    from lmforge.data.tokenizer import train_tokenizer

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
