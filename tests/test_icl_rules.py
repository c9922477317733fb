"""LLM Foundry's ICL rules, pinned one by one on small hand-made task files.

Each expectation here is written from Foundry's code (llmfoundry/eval/datasets and
llmfoundry/eval/metrics, read with the `fetch` tool), not from lmforge's: the few-shot draw,
stripping, prompt layout, how context and answer are tokenized (BOS, leading spaces), answer
normalization and the calibration error. The pinned few-shot literals were checked against
Foundry's own ``get_fewshot_sample_idxs``.
"""

from __future__ import annotations

import json
import random

import pytest

from eval_helpers import CharTokenizer, write_jsonl
from lmforge.errors import UserError
from lmforge.eval.icl import answer_matches, final_answer, load_tasks, normalize_answer
from lmforge.eval.icl_metrics import calibration_error
from lmforge.eval.icl_prompts import (
    answer_budget, fewshot_choices, fewshot_indices, generation_prompt, likelihood_sequences, needs_prefix_space,
    preamble_text, sample_fewshot, schema_texts,
)


def _task(tmp_path, rows, task_type="multiple_choice", name="t.jsonl", **entry):
    path = write_jsonl(tmp_path / name, rows)
    return load_tasks([{"label": "t", "dataset_uri": str(path), "icl_task_type": task_type, **entry}])[0]


# ----------------------------------------------------------------------------- few-shot choice


def foundry_rule(n: int, k: int, index: int, rng: random.Random) -> list[int]:
    """Foundry's draw, written out: sample k (capped at n-1) into a set; if the example itself was
    drawn, drop it and redraw single choices until one is new; the set's order is the result."""
    k = min(k, n - 1)
    picked = set(rng.sample(range(0, n), k))
    if index in picked:
        picked.remove(index)
        if len(picked) >= n - 1:
            return list(picked)
        again = rng.choice(range(0, n))
        while again in picked or again == index:
            again = rng.choice(range(0, n))
        picked.add(again)
    return list(picked)


def test_fewshot_draw_matches_foundry():
    # From Foundry's get_fewshot_sample_idxs, one Random(seed) consumed example after example.
    rng = random.Random(1234)
    assert [sample_fewshot(6, 3, i, rng) for i in range(6)] == [
        [3, 4, 5], [0, 4, 5], [0, 1, 5], [1, 4, 5], [0, 1, 5], [0, 3, 4]]
    rng = random.Random(7)  # large indices: the set's iteration order is not sorted order
    assert [sample_fewshot(1000, 5, i, rng) for i in range(3)] == [
        [154, 970, 331, 404, 666], [96, 548, 840, 74, 49], [931, 519, 596, 374, 59]]
    rng = random.Random(1234)  # more shots than other examples: capped
    assert [sample_fewshot(4, 5, i, rng) for i in range(4)] == [[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]]
    for seed, n, k in [(0, 2, 1), (1, 5, 4), (3, 20, 3), (99, 57, 10), (5, 300, 25)]:
        a, b = random.Random(seed), random.Random(seed)
        assert [sample_fewshot(n, k, i, a) for i in range(n)] == [foundry_rule(n, k, i, b) for i in range(n)]


def test_fewshot_generator_runs_through_the_dataset_in_order(tmp_path):
    rows = [{"query": f"q{i}", "choices": ["a", "b"], "gold": i % 2, "category": "xy"[i % 3 == 0]} for i in range(12)]
    task = _task(tmp_path, rows, num_fewshot=[3], fewshot_random_seed=11)
    rng = random.Random(11)
    want = {i: foundry_rule(12, 3, i, rng) for i in range(12)}
    assert fewshot_choices(task, 3) == want
    assert fewshot_choices(task, 3, limit=5) == {i: want[i] for i in range(5)}  # a limit is a prefix
    assert [fewshot_indices(task, i, 3) for i in range(12)] == [want[i] for i in range(12)]
    assert fewshot_choices(task, 0) == {i: [] for i in range(12)}  # no shots: the generator is not used
    # With categories every category is a dataset of its own: own generator, own pool.
    cat = _task(tmp_path, rows, num_fewshot=[2], has_categories=True, fewshot_random_seed=11)
    assert list(cat.partitions) == ["x", "y"]  # sorted
    got = fewshot_choices(cat, 2)
    for members in cat.partitions.values():
        rng = random.Random(11)
        for pos, i in enumerate(members):
            assert got[i] == [members[j] for j in foundry_rule(len(members), 2, pos, rng)]


# ----------------------------------------------------------------------------- data preparation


def test_strip_dataset_and_answer_sets(tmp_path):
    rows = [{"query": "Question: dry a towel?\n", "choices": [" hang it ", "soak it"], "gold": 0, "n": 3}]
    task = _task(tmp_path, rows * 2)
    # Top-level strings are stripped, lists and other values are not.
    assert task.examples[0] == {"query": "Question: dry a towel?", "choices": [" hang it ", "soak it"], "gold": 0,
                                "n": 3}
    assert task.raw[0]["query"].endswith("\n")
    kept = _task(tmp_path, rows * 2, strip_dataset=False)
    assert kept.examples[0]["query"].endswith("\n")
    gen = _task(tmp_path, [{"context": " Q: capital? ", "answer": " Paris ", "aliases": ["paris", "Paris"]}] * 2,
                "generation_task_with_answers", name="g.jsonl")
    # The answer set is collected before stripping: it holds the unstripped answer.
    assert gen.examples[0]["answer"] == "Paris" and gen.examples[0]["context"] == "Q: capital?"
    assert gen.examples[0]["aliases"] == [" Paris ", "paris", "Paris"]


def test_jsonl_is_split_on_newlines_only(tmp_path):
    # U+0085 (NEXT LINE) and U+2028 inside a JSON string: str.splitlines() would cut these lines.
    path = tmp_path / "nel.jsonl"
    path.write_text('{"context": "a\u0085b", "continuation": "c"}\n{"context": "d\u2028e", "continuation": "f"}\n\n',
                    encoding="utf-8")
    task = load_tasks([{"label": "x", "dataset_uri": str(path), "icl_task_type": "language_modeling"}])[0]
    assert [e["context"] for e in task.examples] == ["a\u0085b", "d\u2028e"]
    assert task.locations == [f"{path}:line 1", f"{path}:line 2"]


# ----------------------------------------------------------------------------- prompt text


MC = [{"query": f"Question: q{i}?\n", "choices": [f"yes {i}", f"no {i}"], "gold": i % 2} for i in range(4)]


def test_prompt_text_multiple_choice(tmp_path):
    task = _task(tmp_path, MC, prompt_string="Answer these.", example_delimiter="\n\n",
                 continuation_delimiter="\nAnswer: ", question_prelimiter="Q) ")
    demos = fewshot_indices(task, 0, 2)
    want = "Answer these." + "".join(f"\n\nQ) Question: q{j}?\nAnswer: {MC[j]['choices'][j % 2]}" for j in demos)
    assert preamble_text(task, demos) == want
    tok = CharTokenizer()
    (ctx, cont), _ = likelihood_sequences(task, tok, 0, demos, 10_000, needs_prefix_space(tok))
    # The example's text is right-stripped (the delimiter's space is dropped) ...
    assert tok.decode(ctx) == want + "\n\nQ) Question: q0?\nAnswer:"
    # ... and a character tokenizer is SentencePiece-like (" a" is two tokens): no space is added back.
    assert tok.decode(cont) == "yes 0"
    assert not needs_prefix_space(tok)


def test_prompt_text_schema_and_language_modeling(tmp_path):
    rows = [{"context_options": [f"A{i} went", f"B{i} went"], "continuation": f"home {i}.", "gold": i % 2}
            for i in range(4)]
    task = _task(tmp_path, rows, "schema", prelimiter="P: ", continuation_delimiter=" then ")
    demos = fewshot_indices(task, 1, 2)
    # A schema demonstration puts the prelimiter *before* the example delimiter.
    first, second = rows[demos[0]], rows[demos[1]]
    want = (f"P: {first['context_options'][first['gold']]} then {first['continuation']}"
            f"P: \n{second['context_options'][second['gold']]} then {second['continuation']}")
    assert preamble_text(task, demos) == want
    # After a preamble each option ends with the right-stripped delimiter; without one, no delimiter.
    assert schema_texts(task, task.examples[1], want) == ["P: \nA1 went then", "P: \nB1 went then"]
    assert schema_texts(task, task.examples[1], "") == ["P: A1 went", "P: B1 went"]
    lm = _task(tmp_path, [{"context": f"The {i}", "continuation": f" word{i} "} for i in range(3)],
               "language_modeling", name="lm.jsonl", continuation_delimiter="")
    assert preamble_text(lm, [2, 0]) == "The 2word2\nThe 0word0"  # stripped answers, no space restored


def test_prompt_text_generation_with_chain_of_thought(tmp_path):
    rows = [{"context": f"Question: {i}+{i}?", "chain_of_thought": f" {i} and {i} ", "answer": str(2 * i)}
            for i in range(5)]
    task = _task(tmp_path, rows, "generation_task_with_answers", cot_delimiter="The answer is ",
                 continuation_delimiter="\nA:", early_stopping_criteria=["\n\n", "Question:"], do_normalization=False)
    assert task.has_cot
    assert preamble_text(task, [3, 1]) == ("Question: 3+3?\nA:3 and 3The answer is 6"
                                           "\nQuestion: 1+1?\nA:1 and 1The answer is 2")
    tok = CharTokenizer()
    ids = generation_prompt(task, tok, 0, [3, 1], 10_000)
    assert tok.decode(ids).endswith("The answer is 2\nQuestion: 0+0?\nA:")
    # Budget: the longest accepted answer, with its unstripped chain of thought, plus 10 tokens.
    assert answer_budget(task, tok, list(range(5))) == len(" 4 and 4 The answer is 8") + 10
    assert final_answer(" 2 and 2 The answer is 4\n\nQuestion: next", task.stop_sequences, task.cot_delimiter) == "4"


# ----------------------------------------------------------------------------- tokens


@pytest.fixture(scope="module")
def bpe_variants(tmp_path_factory):
    """One BPE vocabulary in three tokenizer set-ups: BOS declared (add_bos_token), BOS added by the
    post-processor only (Llama 3 style), and no BOS at all (GPT-2 style)."""
    from lmforge.data.text.tokenizer import load_tokenizer, train_tokenizer

    root = tmp_path_factory.mktemp("bpe")
    rng = random.Random(0)
    words = "how do dry towel hang soak water it a the question answer".split()
    (root / "text.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(9)) for _ in range(300)))
    train_tokenizer([str(root / "text.txt")], 300, str(root / "bos"), add_bos=True)
    out = {"bos": load_tokenizer(str(root / "bos"))}
    for name, keep_bos in (("llama3", True), ("gpt2", False)):
        d = root / name
        d.mkdir()
        tj = json.loads((root / "bos" / "tokenizer.json").read_text())
        if not keep_bos:
            tj["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                                    "use_regex": True}
        (d / "tokenizer.json").write_text(json.dumps(tj))
        cfg = json.loads((root / "bos" / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": False}))
        out[name] = load_tokenizer(str(d))
    return out


@pytest.mark.parametrize("variant", ["bos", "llama3", "gpt2"])
def test_tokens_of_a_stripped_piqa_item(tmp_path, bpe_variants, variant):
    tok = bpe_variants[variant]
    backend = tok.backend
    rows = [{"query": "Question: how do I dry a towel?\n", "choices": ["hang it", "soak it in water"], "gold": 0},
            {"query": "Question: how do I soak it?\n", "choices": ["water", "dry it"], "gold": 0}]
    task = _task(tmp_path, rows, continuation_delimiter="\nAnswer: ")
    assert needs_prefix_space(tok)  # byte-level BPE: " a" is one token
    bos = backend.token_to_id("<|bos|>")
    start = [] if variant == "gpt2" else [bos]  # what the post-processor adds to a document

    def plain(text):
        return backend.encode(text, add_special_tokens=False).ids

    got = likelihood_sequences(task, tok, 0, [], 512, True)
    ctx = start + plain("Question: how do I dry a towel?\nAnswer:")
    assert got == [(ctx, plain(" hang it")), (ctx, plain(" soak it in water"))]
    # One shot: the preamble is tokenized on its own (with BOS), the example after it without.
    got = likelihood_sequences(task, tok, 0, [1], 512, True)
    ctx = start + plain("Question: how do I soak it?\nAnswer: water") + plain(
        "\nQuestion: how do I dry a towel?\nAnswer:")
    assert got[0] == (ctx, plain(" hang it"))
    for c, a in got:
        assert bos not in a and c.count(bos) == len(start)  # BOS once, first, and never scored
    # Contexts are cut from the left so that context + answer fit.
    short = likelihood_sequences(task, tok, 0, [1], 8, True)
    assert short[0] == (ctx[-(8 - len(plain(" hang it"))):], plain(" hang it"))


# ----------------------------------------------------------------------------- answers


def test_answer_normalization_foundry_cases():
    assert normalize_answer("  The  Eiffel-Tower!! ") == "eiffel tower"  # punctuation becomes a space
    assert normalize_answer("rock_and_roll") == "rock and roll"
    assert normalize_answer("\u2018Tis the Season\u2019") == "tis season"  # curly quotes are punctuation
    assert answer_matches(" Jean Paul Sartre, of course", ["Jean-Paul Sartre"])
    assert answer_matches(" The Sunset Boulevard, obviously", ["Sunset Blvd", "sunset boulevard"])
    assert not answer_matches(" Sunset", ["Sunset Boulevard"])
    assert answer_matches(" an apple a day", ["Apple"])
    # Without normalization both sides are still stripped, and case matters.
    assert answer_matches("  Paris is", [" Paris "], normalize=False)
    assert not answer_matches(" paris", ["Paris"], normalize=False)


def test_final_answer_stop_sequences_are_a_regex():
    assert final_answer(" Paris\n\nQuestion: more", ["\n\n", "Question:"]) == " Paris"
    assert final_answer(" Paris", ["."]) == ""  # "." is a pattern: it matches the first character
    assert final_answer(" 42 apples, 7 pears", ["[0-9]+ pears"]) == " 42 apples, "
    assert final_answer(" Paris\nmore", []) == " Paris\nmore"  # no criteria: nothing is cut
    assert final_answer("x The answer is 3 The answer is 4", [], "The answer is ") == "4"


def test_calibration_error_by_hand():
    # Buckets of width 0.1: {0.95, 0.91} -> bucket 9 (1 of 2 right, midpoint 0.95),
    # 0.15 -> bucket 1 (wrong, midpoint 0.15), 0.5 -> bucket 5 (right, midpoint 0.55).
    outcomes = [(0.95, True), (0.91, False), (0.15, False), (0.5, True)]
    assert calibration_error(outcomes) == pytest.approx(2 / 4 * 0.45 + 1 / 4 * 0.15 + 1 / 4 * 0.45)
    assert calibration_error([(1.0, True)]) == pytest.approx(0.05)  # confidence 1 falls in the top bucket


# ----------------------------------------------------------------------------- Foundry's task files


def test_foundry_task_yaml_shapes_load(tmp_path):
    """Entries shaped like Foundry's tasks_v0.3.yaml: question_prelimiter, cot_delimiter,
    do_normalization, early_stopping_criteria, has_categories, metric_names, batch_size."""
    data = tmp_path / "eval" / "local_data"
    write_jsonl(data / "symbolic_problem_solving" / "gsm.jsonl",
                [{"context": f"{i} apples?", "chain_of_thought": "count", "answer": str(i)} for i in range(4)])
    write_jsonl(data / "world_knowledge" / "jeopardy.jsonl",
                [{"context": f"HISTORY: {i}", "continuation": "x", "category": "history"} for i in range(3)])
    write_jsonl(data / "world_knowledge" / "mmlu.jsonl",
                [{"query": "q", "choices": ["a", "b"], "gold": 1, "category": c} for c in "ab" * 3])
    (tmp_path / "tasks.yaml").write_text("""\
icl_tasks:
-
  label: gsm8k
  dataset_uri: eval/local_data/symbolic_problem_solving/gsm.jsonl
  num_fewshot: [0]
  icl_task_type: generation_task_with_answers
  cot_delimiter: "The answer is "
  continuation_delimiter: "\\n\\nA:"
  question_prelimiter: ""
  do_normalization: false
  early_stopping_criteria:
  - "\\n\\n"
  - "Question:"
-
  label: jeopardy
  dataset_uri: eval/local_data/world_knowledge/jeopardy.jsonl
  num_fewshot: [3]
  icl_task_type: language_modeling
  continuation_delimiter: "\\nAnswer: "
  has_categories: true
  batch_size: 4
-
  label: mmlu
  dataset_uri: eval/local_data/world_knowledge/mmlu.jsonl
  num_fewshot: [5]
  icl_task_type: multiple_choice
  has_categories: true
  metric_names: [InContextLearningMultipleChoiceAccuracy, InContextLearningMCExpectedCalibrationError]
""")
    gsm, jeopardy, mmlu = load_tasks(tmp_path / "tasks.yaml", data_root=data)
    assert (gsm.cot_delimiter, gsm.prelimiter, gsm.do_normalization) == ("The answer is ", "", False)
    assert gsm.stop_sequences == ["\n\n", "Question:"] and gsm.has_cot
    assert jeopardy.partitions == {"history": [0, 1, 2]}  # 3 shots from a 3-example category: capped at 2
    assert fewshot_indices(jeopardy, 0, 3) == [1, 2]
    assert list(mmlu.partitions) == ["a", "b"] and mmlu.metrics == ["accuracy", "calibration_error"]


@pytest.mark.integration
def test_hugging_face_datasets(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    folder = tmp_path / "hfdata"
    write_jsonl(folder / "train.jsonl", [{"q": f"What is {i}?", "extra": "Think.", "a": str(i)} for i in range(3)])
    entry = {"label": "hf", "dataset_uri": f"hf://{folder}", "icl_task_type": "generation_task_with_answers",
             "hf_loading_vars": {"split": "train", "cache_dir": str(tmp_path / "cache")},
             "hf_parsing_map": {"context": ["q", "extra"], "answer": ["a"]}}
    task = load_tasks([entry])[0]
    assert [e["context"] for e in task.examples] == ["What is 0? Think.", "What is 1? Think.", "What is 2? Think."]
    assert task.examples[2]["aliases"] == ["2"]
    # Foundry's long-context tasks name a Hub dataset: offline, that is one clear line.
    hub = {**entry, "dataset_uri": "hf://mosaicml/long_context_eval", "hf_parsing_map": {},
           "hf_loading_vars": {"name": "kv_pairs", "context_length": 2048, "section": "end", "split": "test"}}
    with pytest.raises(UserError, match="cannot load Hugging Face dataset 'mosaicml/long_context_eval'.*network"):
        load_tasks([hub])
    with pytest.raises(UserError, match="hf_parsing_map names column 'nope'"):
        load_tasks([{**entry, "hf_parsing_map": {"context": ["nope"], "answer": ["a"]}}])


@pytest.mark.parametrize("entry, message", [
    ({"cot_delimiter": "x"}, "cot_delimiter: applies only to generation_task_with_answers tasks"),
    ({"nonsense_key": 1}, "nonsense_key: unknown key; valid keys for multiple_choice"),
    ({"question_prelimiter": "b", "prelimiter": "a"}, "give prelimiter or question_prelimiter"),
    ({"metric_names": ["InContextLearningLMAccuracy"]}, "not available for multiple_choice"),
    ({"metric_names": ["InContextLearningCodeEvalAccuracy"]}, "not available"),
    ({"generation_kwargs": {"num_beams": 4}}, "beam search is not supported"),
    ({"generation_kwargs": {"top_k": 0}}, "top_k must be a positive integer"),
    ({"generation_kwargs": {"repetition_penalty": 1.2}}, "'repetition_penalty' is not supported"),
    ({"strip_dataset": "yes"}, "strip_dataset: expected true or false"),
    ({"icl_task_type": "code_evaluation"}, "code_evaluation (running generated code) is not supported"),
    ({"num_fewshot": [0, -1]}, "num_fewshot: expected a non-negative integer"),
])
def test_bad_task_entries_name_file_line_and_key(tmp_path, entry, message):
    import yaml

    write_jsonl(tmp_path / "mc.jsonl", MC)
    spec = {"label": "mc", "dataset_uri": "mc.jsonl", "icl_task_type": "multiple_choice", **entry}
    (tmp_path / "tasks.yaml").write_text(yaml.safe_dump({"icl_tasks": [spec]}, sort_keys=False))
    with pytest.raises(UserError) as e:
        load_tasks(tmp_path / "tasks.yaml")
    msg = str(e.value)
    assert message in msg, msg
    key = next(iter(entry))
    line = next(n for n, text in enumerate((tmp_path / "tasks.yaml").read_text().splitlines(), 1)
                if text.lstrip(" -").startswith(f"{key}:"))
    assert msg.startswith(f"{tmp_path / 'tasks.yaml'}:line {line}: icl_tasks[0] (mc): ")


def test_bad_task_data_name_file_line_and_field(tmp_path):
    def bad(text: str, task_type="multiple_choice", **entry) -> str:
        (tmp_path / "bad.jsonl").write_text(text)
        with pytest.raises(UserError) as e:
            load_tasks([{"label": "bad", "dataset_uri": str(tmp_path / "bad.jsonl"), "icl_task_type": task_type,
                         **entry}])
        return str(e.value)

    good = '{"query": "q", "choices": ["a", "b"], "gold": 0}\n'
    where = f"{tmp_path / 'bad.jsonl'}:line 2: "
    assert bad(good + '{"query": "q", "choices": ["a", "b"]}\n').startswith(where + "missing field 'gold'")
    assert bad(good + "not json\n").startswith(where + "not valid JSON")
    assert "out of range" in bad(good + '{"query": "q", "choices": ["a", "b"], "gold": 2}\n')
    assert bad(good + '{"query": "q", "choices": ["a"], "gold": 0}\n', has_categories=True).startswith(
        f"{tmp_path / 'bad.jsonl'}:line 1: field 'category' is required")
    assert "field 'answer'" in bad('{"context": "c", "aliases": ["a"]}\n', "generation_task_with_answers")
    assert "no examples" in bad("")
    (tmp_path / "bad.jsonl").write_bytes(good.encode() + b'{"query": "\xff"}\n')
    with pytest.raises(UserError, match="bad.jsonl:line 2: not UTF-8"):
        load_tasks([{"label": "b", "dataset_uri": str(tmp_path / "bad.jsonl"), "icl_task_type": "multiple_choice"}])
