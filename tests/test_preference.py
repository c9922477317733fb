"""Preference tuning (task_type preference): pairs kept together with only their answers scored;
DPO, IPO, SimPO and ORPO against TRL's own code and against the papers' formulas on an
independent model (transformers' Llama, each answer padded on its own row); a tiny run that
learns a synthetic preference and resumes exactly; LoRA with the base as its reference; two FSDP
ranks against one; bad input as one line."""

from __future__ import annotations

import json
import math
import random
import shutil
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO
from lmforge.config.model import ModelConfig
from lmforge.config.schema import RunConfig
from lmforge.data.rows.preference import fit_pair, load_pairs, read_pairs
from lmforge.data.rows.sft import tokenize_example
from lmforge.data.text.tokenizer import load_tokenizer
from lmforge.distributed.dist import DistInfo
from lmforge.models import build_model, save_pretrained
from lmforge.models.preference_loss import PairLogps, pair_terms
from train_helpers import (assert_one_line_error, cli, final_weights, lmforge, metrics, set_dotted,
                           train_in_process, train_losses, write_config)

ONE_RANK = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
SMALL = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=128, vocab_size=512)


def digit_pairs(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """The synthetic task: a number word, its digit chosen over a wrong digit. Each word's nine
    wrong digits: seven in training, two held out (so every held-out pair is unseen)."""
    rng = random.Random(seed)
    train, held = [], []
    for a, word in enumerate(WORDS):
        wrong = [d for d in range(10) if d != a]
        rng.shuffle(wrong)
        for k, d in enumerate(wrong):
            (held if k < 2 else train).append({"prompt": f"# {word}", "chosen": f" {a}\n", "rejected": f" {d}\n"})
    return train, held


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from more threads, and on the shared cores lose a lot (and the
    ranks of the FSDP comparison run with one: the same float reductions)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok(tiny_data):
    return load_tokenizer(tiny_data.tokenizer)


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_data):
    """The starting weights: a freshly initialized tiny model with the session's tokenizer."""
    folder = tmp_path_factory.mktemp("pref-base") / "base"
    torch.manual_seed(0)
    save_pretrained(build_model(SMALL.model_copy(update={"max_seq_len": 64})), SMALL, folder,
                    tokenizer_dir=tiny_data.tokenizer)
    return folder


def pref_config(tmp_path, weights, name="dpo", **extra) -> dict:
    train, held = digit_pairs()
    cfg = {"name": f"pref-{name}-{abs(hash(str(tmp_path))) % 10**8}", "custom_weights_path": str(weights),
           "task_type": "preference", "train_data": str(write_jsonl(tmp_path / "train.jsonl", train)),
           "training_duration": "20ba", "save_interval": "10ba", "save_folder": str(tmp_path / name),
           "log_interval": 1,
           "parameters": {"global_batch_size": 8, "micro_batch_size": 4, "learning_rate": 3e-3,
                          "context_length": 64, "warmup": "2ba", "precision": "fp32"},
           # every held-out pair each time (a budget sized to these short runs would read fewer)
           "eval": {"data_path": str(write_jsonl(tmp_path / "val.jsonl", held)), "interval": "10ba",
                    "max_batches": 20, "prompts": []},
           "experiment_tracker": {"mlflow": None, "console": True}}
    set_dotted(cfg, extra)
    return cfg


# --------------------------------------------------------------------------- rows and batches

ROWS = [
    {"prompt": "def add(a, b):\n", "chosen": "    return a + b\n", "rejected": "    return a - b\n"},
    {"prompt": [{"role": "user", "content": "import?"}, {"role": "assistant", "content": "import os"},
                {"role": "user", "content": "and?"}],
     "chosen": [{"role": "assistant", "content": "import sys"}],
     "rejected": [{"role": "assistant", "content": "import nothing"}]},
    {"chosen": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}],
     "rejected": [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "5"}]},
]


def test_pairs_stay_together_and_only_answers_are_scored(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    rows = load_pairs([str(path)], tok, 128, packing=True, seed=3)
    assert rows.pairs == 3 and len(rows) == 2 and rows.truncated == 0
    scored = {}
    for r in range(len(rows)):
        docs, trained, tokens = rows.doc_ids[r], rows.trained[r], rows.tokens[r]
        held = int(rows.pair_mask[r].sum())
        assert rows.pair_mask[r].tolist() == [True] * held + [False] * (rows.pair_mask.shape[1] - held)
        assert (docs[trained] < 2 * held).all() and not trained[docs == 2 * held].any()  # padding is never scored
        for k in range(held):
            chosen, rejected = (tokens[docs == d] for d in (2 * k, 2 * k + 1))
            answers = [tok.decode(tokens[(docs == d) & trained].tolist()) for d in (2 * k, 2 * k + 1)]
            # the two sequences of a pair share their prompt, token for token, and differ after it
            first = int(trained[docs == 2 * k].nonzero()[0])
            assert torch.equal(chosen[:first], rejected[:first])
            scored[answers[0]] = answers[1]
    eos = tok.eos_token
    assert scored == {"    return a + b\n" + eos: "    return a - b\n" + eos,  # strings: prompt + answer + eos
                      "import sys" + eos: "import nothing" + eos,  # the prompt's own assistant turn is context
                      "4" + eos: "5" + eos}  # whole conversations: the shared first message is the prompt
    # without packing: one pair per row, in its own two documents
    unpacked = load_pairs([str(path)], tok, 128, packing=False, seed=3)
    assert len(unpacked) == 3 and unpacked.pair_mask.shape[1] == 1 and int(unpacked.doc_ids.max()) == 2
    # a pair longer than the context with a short prompt: the answers are cut from the end, the prompt never
    (c, r, where), = read_pairs([str(write_jsonl(tmp_path / "long.jsonl", [
        {"prompt": "x = ", "chosen": "1 " * 40, "rejected": "2 " * 3}]))])
    c, r = tokenize_example(c, tok), tokenize_example(r, tok)
    fit = fit_pair(c, r, 32, len(tok.prefix_ids))
    fc, fr = fit.chosen, fit.rejected
    assert fit.cut == "answers" and len(fc[0]) + len(fr[0]) == 32 and len(fr[0]) == len(r[0])  # the longer gave way
    assert fc[0] == c[0][:len(fc[0])] and any(fc[1])


def _fit(tok, row: dict, seq_len: int):
    from lmforge.data.rows.preference import pair_segments

    c, r = pair_segments(row, "row")
    c, r = tokenize_example(c, tok), tokenize_example(r, tok)
    return c, r, fit_pair(c, r, seq_len, len(tok.prefix_ids))


def test_a_long_prompt_is_cut_from_the_left_and_a_pair_a_cut_makes_equal_is_dropped(tok):
    """Prompt first, from the left (TRL's keep-end): the text nearest the answers stays, BOS too, the
    answers whole; a cut that leaves chosen and rejected the same drops the pair (a constant loss)."""
    c, r, fit = _fit(tok, {"prompt": "".join(f"line {i}\n" for i in range(60)), "chosen": " yes\n",
                           "rejected": " no\n"}, 64)
    assert fit.cut == "prompt" and not fit.dropped and len(fit.chosen[0]) + len(fit.rejected[0]) <= 64
    first = len(tok.prefix_ids)
    for whole, kept in ((c, fit.chosen), (r, fit.rejected)):
        assert kept[0][:first] == whole[0][:first]  # BOS (if the tokenizer adds one) stays
        assert whole[0][-len(kept[0]) + first:] == kept[0][first:]  # the end of the prompt and the whole answer
        assert tok.decode(kept[0]).endswith("line 59\n" + kept_answer(kept, tok))
    # answers that differ only in their last words: a context that cuts those words makes them equal
    shared = "".join(f" {w}" for w in WORDS * 4)
    _, _, fit = _fit(tok, {"prompt": "# say", "chosen": shared + " yes", "rejected": shared + " no"}, 48)
    assert fit.dropped == "chosen and rejected are identical after the cut" and fit.chosen is None
    # a context too short for any prompt and one answer token each
    _, _, fit = _fit(tok, {"prompt": "# one two three", "chosen": " 1", "rejected": " 2"}, 3)
    assert fit.dropped.startswith("its prompt leaves no room for both answers")


def kept_answer(seq, tok) -> str:
    ids, trained = seq
    return tok.decode([t for t, on in zip(ids, trained) if on])


def test_fitting_is_counted_and_named_and_only_no_pair_left_is_refused(tmp_path, tok):
    from lmforge.data.rows.preference import fit_summary
    from lmforge.errors import UserError

    long_prompt = {"prompt": "".join(f"line {i}\n" for i in range(60)), "chosen": " yes\n", "rejected": " no\n"}
    shared = "".join(f" {w}" for w in WORDS * 4)
    equal = {"prompt": "# say", "chosen": shared + " yes", "rejected": shared + " no"}
    fine = {"prompt": "# one", "chosen": " 1\n", "rejected": " 2\n"}
    path = write_jsonl(tmp_path / "t.jsonl", [fine, long_prompt, equal, long_prompt, fine])
    rows = load_pairs([str(path)], tok, 48, packing=True, seed=0)
    assert rows.pairs == 4 and rows.truncated == 2 and rows.prompts_cut == [f"{path}:2", f"{path}:4"]
    assert rows.dropped == [(f"{path}:3", "chosen and rejected are identical after the cut")]
    assert fit_summary(rows) == (f"2 cut to fit the context length, 2 of them in the prompt, from the left ({path}:2, "
                                 f"{path}:4); 1 dropped (chosen and rejected are identical after the cut: {path}:3)")
    with pytest.raises(UserError, match=r"t2.jsonl: no pair fits within context_length 48 \(.*t2.jsonl:1: chosen and"):
        load_pairs([str(write_jsonl(tmp_path / "t2.jsonl", [equal]))], tok, 48, packing=True, seed=0)


def test_answer_sums_and_step_zero(tmp_path, tok):
    """Per-answer sums come from the packed rows; with the policy equal to the reference (step 0)
    the DPO loss is ln 2, every reward 0 and the accuracy 0.5 (a tie counts half)."""
    from lmforge.data.rows.preference import PreferenceData
    from lmforge.train.objective import Preference, model_forward
    from lmforge.train.reference import REFERENCE_FILE, attach_reference

    torch.manual_seed(0)
    model = build_model(SMALL)
    rows = load_pairs([str(write_jsonl(tmp_path / "p.jsonl", ROWS))], tok, 128, packing=True, seed=3)
    data = attach_reference(model, PreferenceData(tok.path, rows, None), _layout(2), str(tmp_path), ONE_RANK,
                            _nullcontext, weights="init-0", resuming=False, log=lambda *_: None)
    assert (tmp_path / REFERENCE_FILE).is_file() and not (tmp_path / ".reference").exists()
    # a file an earlier version tagged by its own rule (`legacy_weights_tag`) is read, not recomputed
    said: list[str] = []
    again = attach_reference(model, PreferenceData(tok.path, rows, None), _layout(2), str(tmp_path), ONE_RANK,
                             _nullcontext, weights="by-content", legacy_weights="init-0", resuming=True,
                             log=said.append)
    assert torch.equal(again.rows.ref_logps, data.rows.ref_logps) and "read from" in said[0], said
    objective = Preference(_run_config(), model)
    batch = data.rows.batch(list(range(len(data.rows))))
    out = objective(model_forward(model), batch)
    pairs = float(objective.units(batch))
    assert pairs == 3
    assert out.loss_sum.item() / pairs == pytest.approx(math.log(2), abs=1e-6)
    assert out.stats["rewards/chosen"].abs().item() < 1e-6 and out.stats["rewards/rejected"].abs().item() < 1e-6
    assert out.stats["rewards/accuracy"].item() / pairs == 0.5


@pytest.mark.integration
def test_an_interrupted_precomputation_continues(tmp_path, tok, monkeypatch):
    """Chunks finished before an interruption are read back, not computed again, and the result
    is the uninterrupted one's."""
    from lmforge.data.rows.preference import PreferenceData
    from lmforge.train import reference
    from lmforge.train.reference import attach_reference

    torch.manual_seed(0)
    model = build_model(SMALL)
    train, _ = digit_pairs()
    rows = load_pairs([str(write_jsonl(tmp_path / "p.jsonl", train[:24]))], tok, 64, packing=False, seed=0)
    data = PreferenceData(tok.path, rows, None)

    def attach(folder, log=lambda *_: None):
        return attach_reference(model, data, _layout(2), str(folder), ONE_RANK, _nullcontext, weights="w",
                                resuming=False, log=log, chunk_rows=8)

    whole = attach(tmp_path / "whole").rows.ref_logps
    real_chunk, calls = reference._chunk, []

    def interrupted(*args):
        calls.append(args[2])
        if len(calls) == 3:
            raise KeyboardInterrupt  # the process stops in the third chunk
        return real_chunk(*args)

    monkeypatch.setattr(reference, "_chunk", interrupted)
    with pytest.raises(KeyboardInterrupt):
        attach(tmp_path / "run")
    assert len(list((tmp_path / "run" / ".reference").iterdir())) == 2
    monkeypatch.setattr(reference, "_chunk", real_chunk)
    log: list[str] = []
    again = attach(tmp_path / "run", log.append).rows.ref_logps
    assert any("2 chunk(s) of the train rows read back" in line for line in log), log
    assert torch.equal(again, whole) and whole.shape == (24, 1, 2)


def test_the_reference_is_tagged_by_the_starting_weights_content(tmp_path, base):
    """The tag of the starting weights: their files' sha256 — the same from a copy elsewhere (fresh
    times), from the digests an export records, and different once a weight changes; a tokenizer
    edit (a chat template added) does not count."""
    from safetensors.torch import load_file, save_file

    from lmforge.checksums import write_export_digests
    from lmforge.train.reference import weights_tag

    tag = weights_tag(str(base), 0)
    copy = tmp_path / "copy"
    shutil.copytree(base, copy, copy_function=shutil.copy)
    assert weights_tag(str(copy), 0) == tag == weights_tag(str(copy), 7)  # (the seed is for fresh models only)
    (copy / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    write_export_digests(str(copy))  # now the folder records its digests: they are what is read
    assert weights_tag(str(copy), 0) == tag
    sd = load_file(copy / "model.safetensors")
    sd["norm.weight"] = sd["norm.weight"] + 1
    save_file(sd, copy / "model.safetensors")
    write_export_digests(str(copy))
    assert weights_tag(str(copy), 0) != tag and weights_tag(None, 3) == "init-3"


def _layout(micro_batch: int):
    from lmforge.data.batch import StreamLayout
    from lmforge.plan.layout import Layout

    return StreamLayout(seq_len=128, layout=Layout(global_batch=micro_batch, micro_batch=micro_batch))


def _nullcontext():
    from contextlib import nullcontext

    return nullcontext()


def _run_config(**preference) -> RunConfig:
    return RunConfig(model=SMALL, train_data="unused.jsonl", training_duration="1ba", task_type="preference",
                     preference=preference)


# --------------------------------------------------------------------------- the losses, checked

LOSSES = [("dpo", {"label_smoothing": 0.1}), ("ipo", {}), ("simpo", {}), ("orpo", {})]


@pytest.mark.integration  # importing TRL's trainers takes seconds
@pytest.mark.parametrize("loss,settings", LOSSES, ids=[name for name, _ in LOSSES])
def test_losses_equal_trl(loss, settings):
    """Each loss and its rewards against TRL's own implementation, called on the same per-pair
    log-probs (DPO and IPO through TRL's CPO loss, which takes log-ratios as it takes log-probs)."""
    pytest.importorskip("trl")
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    g = torch.Generator().manual_seed(1)
    n = 16
    tokens_c, tokens_r = torch.randint(1, 30, (n,), generator=g).float(), torch.randint(1, 30, (n,), generator=g).float()
    p = PairLogps(-tokens_c * (0.5 + torch.rand(n, generator=g)), -tokens_r * (0.5 + torch.rand(n, generator=g)),
                  tokens_c, tokens_r, -tokens_c * (0.5 + torch.rand(n, generator=g)),
                  -tokens_r * (0.5 + torch.rand(n, generator=g)))
    cfg = _run_config(loss=loss, **settings).preference.resolved(lora=False)
    ours = pair_terms(loss, p, beta=cfg.beta, label_smoothing=cfg.label_smoothing, gamma=cfg.gamma or 0.0)
    trl_self = SimpleNamespace(beta=cfg.beta, label_smoothing=cfg.label_smoothing, simpo_gamma=cfg.gamma,
                               alpha=0.0, accelerator=SimpleNamespace(device="cpu"),
                               loss_type={"dpo": "sigmoid", "ipo": "ipo", "simpo": "simpo"}.get(loss))
    mean_c, mean_r = p.chosen / p.chosen_tokens, p.rejected / p.rejected_tokens
    if loss == "dpo":
        losses, rc, rr = CPOTrainer.cpo_loss(trl_self, p.chosen - p.ref_chosen, p.rejected - p.ref_rejected)
    elif loss == "ipo":  # on the answers' per-token mean log-ratios
        losses, _, _ = CPOTrainer.cpo_loss(trl_self, (p.chosen - p.ref_chosen) / p.chosen_tokens,
                                           (p.rejected - p.ref_rejected) / p.rejected_tokens)
        rc, rr = cfg.beta * (p.chosen - p.ref_chosen), cfg.beta * (p.rejected - p.ref_rejected)
    elif loss == "simpo":
        losses, rc, rr = CPOTrainer.cpo_loss(trl_self, mean_c, mean_r)
    else:  # ORPO: the chosen answer's mean NLL minus TRL's λ·log σ(log odds)
        or_terms, rc, rr, _, _ = ORPOTrainer.odds_ratio_loss(trl_self, mean_c, mean_r)
        losses = -mean_c - or_terms
    torch.testing.assert_close(ours.loss, losses.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.chosen_reward, rc.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.rejected_reward, rr.float(), rtol=1e-5, atol=1e-6)


def paper_loss(loss: str, c, r, nc, nr, rc, rr, beta, label_smoothing, gamma) -> float:
    """One pair's loss as the papers write it, from its answers' summed log-probs and lengths."""
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    if loss == "dpo":  # Rafailov et al. 2023 eq. 7, with Mitchell's label smoothing
        z = beta * ((c - rc) - (r - rr))
        return -(1 - label_smoothing) * math.log(sig(z)) - label_smoothing * math.log(sig(-z))
    if loss == "ipo":  # Azar et al. 2023 eq. 17, length-normalized log-ratios
        return ((c - rc) / nc - (r - rr) / nr - 1 / (2 * beta)) ** 2
    if loss == "simpo":  # Meng et al. 2024 eq. 6
        return -math.log(sig(beta * c / nc - beta * r / nr - gamma))
    pc, pr = math.exp(c / nc), math.exp(r / nr)  # Hong et al. 2024 eqs. 2-7: mean per-token probabilities
    return -c / nc - beta * math.log(sig(math.log(pc / (1 - pc)) - math.log(pr / (1 - pr))))


@pytest.mark.integration
def test_objective_equals_an_independent_computation(tmp_path, tok):
    """The objective's loss, rewards and accuracy on packed rows equal the papers' formulas on
    log-probs that transformers' Llama computes from the same weights, each answer padded on a
    row of its own (TRL's `get_batch_logps` when TRL is installed); the reference comes from the
    precomputation (`train.reference`) on the starting weights."""
    import transformers
    from lmforge.data.rows.preference import PreferenceData
    from lmforge.models.hf import to_hf_config, to_hf_state_dict
    from lmforge.train.objective import Preference, model_forward
    from lmforge.train.reference import attach_reference

    torch.manual_seed(0)
    model = build_model(SMALL)
    train, _ = digit_pairs()
    rows_in = ROWS[:1] + train[:5]
    path = write_jsonl(tmp_path / "p.jsonl", rows_in)
    rows = load_pairs([str(path)], tok, 128, packing=True, seed=3)
    data = attach_reference(model, PreferenceData(tok.path, rows, None), _layout(1), str(tmp_path), ONE_RANK,
                            _nullcontext, weights="init-0", resuming=False, log=lambda *_: None)

    def hf_of(m):
        hf = transformers.LlamaForCausalLM(to_hf_config(SMALL)).eval()
        hf.load_state_dict(to_hf_state_dict(m.state_dict(), SMALL), strict=False)
        return hf

    reference = hf_of(model)
    with torch.no_grad():  # the policy: the starting weights moved
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    policy = hf_of(model)
    seqs = [(tokenize_example(c, tok), tokenize_example(r, tok)) for c, r, _ in read_pairs([str(path)])]

    def logps(hf, which):
        """Each pair's answer log-prob sum and length, from padded rows of single answers."""
        batch = [s[which] for s in seqs]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width), -100)
        attention = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (x, scored) in enumerate(batch):
            ids[i, :len(x)] = torch.tensor(x)
            labels[i, :len(x)] = torch.where(torch.tensor(scored), torch.tensor(x), -100)
            attention[i, :len(x)] = 1
        with torch.no_grad():
            logits = hf(input_ids=ids, attention_mask=attention).logits.float()
        try:
            from trl.experimental.orpo import ORPOTrainer
            sums = ORPOTrainer.get_batch_logps(logits, labels)
        except ImportError:
            lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0]
            sums = (lp * (labels[:, 1:] != -100)).sum(-1)
        return sums.tolist(), (labels[:, 1:] != -100).sum(-1).tolist()

    (c, nc), (r, nr) = logps(policy, 0), logps(policy, 1)
    rc, rr = logps(reference, 0)[0], logps(reference, 1)[0]
    batches = [data.rows.batch([i]) for i in range(len(data.rows))]  # one row per micro-batch
    for loss in ("dpo", "ipo", "simpo", "orpo"):
        settings = {"label_smoothing": 0.1} if loss == "dpo" else {}
        pref = _run_config(loss=loss, **settings).preference.resolved(lora=False)
        objective = Preference(_run_config(loss=loss, **settings), model)
        outs = [objective(model_forward(model), b) for b in batches]
        expected = [paper_loss(loss, c[i], r[i], nc[i], nr[i], rc[i], rr[i], pref.beta, pref.label_smoothing,
                               pref.gamma) for i in range(len(seqs))]
        assert sum(o.loss_sum.item() for o in outs) == pytest.approx(sum(expected), rel=1e-4), loss
        if loss == "dpo":
            chosen_rewards = [pref.beta * (c[i] - rc[i]) for i in range(len(seqs))]
            rejected_rewards = [pref.beta * (r[i] - rr[i]) for i in range(len(seqs))]
            wins = sum(a > b for a, b in zip(chosen_rewards, rejected_rewards))
            assert sum(o.stats["rewards/chosen"].item() for o in outs) == pytest.approx(sum(chosen_rewards), rel=1e-4)
            assert sum(o.stats["rewards/rejected"].item() for o in outs) == pytest.approx(sum(rejected_rewards),
                                                                                       rel=1e-4)
            assert sum(o.stats["rewards/accuracy"].item() for o in outs) == wins


# --------------------------------------------------------------------------- runs

@pytest.mark.integration
def test_dpo_run_learns_held_out_pairs_and_resumes_exactly(tmp_path, base):
    """A tiny full fine-tuning run on the synthetic task: the held-out accuracy goes from 0.5 (a
    tie: the policy is the reference) to at least 0.9; killed after its first checkpoint, the
    re-run reads the stored reference back and ends on the same weights."""
    from lmforge.errors import UserError
    from lmforge.train.reference import REFERENCE_FILE

    raw = pref_config(tmp_path, base)
    log: list[str] = []
    train_in_process(raw, log=log.append)
    folder = tmp_path / "dpo"
    rows = metrics(folder)
    first = next(m for m in rows if m.get("step") == 1 and "train/loss" in m)
    assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-5) and first["train/rewards/accuracy"] == 0.5
    evals = [m for m in rows if "eval/rewards/accuracy" in m]
    assert evals[-1]["step"] == 20 and evals[-1]["eval/rewards/accuracy"] >= 0.9, evals
    assert evals[-1]["eval/pairs"] == 20 and evals[-1]["eval/rewards/margin"] > 0
    assert any("reference: log-probs of 90 pairs computed" in line for line in log), log
    assert "Preference accuracy" in (folder / "report.html").read_text()
    weights, losses = final_weights(folder), train_losses(folder)

    shutil.rmtree(folder / "checkpoints" / "step_00000020")
    shutil.rmtree(folder / "final")
    log.clear()
    train_in_process(raw, log=log.append)
    assert any("reference: log-probs of 90 pairs read from" in line for line in log), log
    again = final_weights(folder)
    assert all(torch.equal(weights[k], again[k]) for k in weights)
    assert train_losses(folder) == losses  # steps 11-20 again, the same losses

    # the run and its base moved elsewhere (fresh file times): the reference is the base's content, so
    # the moved run resumes with it
    moved = tmp_path / "moved"
    shutil.copytree(base, moved / "base", copy_function=shutil.copy)
    shutil.move(folder, moved / "dpo")
    folder = moved / "dpo"
    shutil.rmtree(folder / "checkpoints" / "step_00000020")
    shutil.rmtree(folder / "final")
    raw = raw | {"custom_weights_path": str(moved / "base"), "save_folder": str(folder)}
    log.clear()
    train_in_process(raw, log=log.append)
    assert any(f"reference: log-probs of 90 pairs read from {folder}" in line for line in log), log
    assert all(torch.equal(weights[k], v) for k, v in final_weights(folder).items())

    # other starting weights (the same folder trained again, say) are named as such
    shutil.rmtree(folder / "final")
    torch.manual_seed(1)
    save_pretrained(build_model(SMALL.model_copy(update={"max_seq_len": 64})), SMALL, moved / "base",
                    tokenizer_dir=base)
    with pytest.raises(UserError, match=f"{REFERENCE_FILE}: made from other starting weights"):
        train_in_process(raw)
    # a checkpoint without its reference cannot resume: the starting weights are gone
    (folder / REFERENCE_FILE).unlink()
    with pytest.raises(UserError, match=f"{REFERENCE_FILE}: missing"):
        train_in_process(raw)


@pytest.mark.integration
def test_lora_uses_the_base_as_reference_and_exports(tmp_path, base):
    """With LoRA the reference is the base with its adapters off (nothing precomputed or stored):
    step 1 is exactly ln 2; the run exports merged (HF) and as a PEFT adapter whose named base
    transformers can load."""
    from lmforge.train.export import export
    from lmforge.train.reference import REFERENCE_FILE

    raw = pref_config(tmp_path, base, "lora", training_duration="4ba", save_interval="4ba",
                      lora={"rank": 4, "dropout": 0.0}, **{"parameters.learning_rate": 1e-2, "eval.interval": "4ba"})
    log: list[str] = []
    train_in_process(raw, log=log.append)
    folder = tmp_path / "lora"
    assert any("reference: the base with its LoRA adapters off" in line for line in log), log
    assert not (folder / REFERENCE_FILE).exists()
    losses = train_losses(folder)
    assert losses[1] == pytest.approx(math.log(2), abs=1e-6) and losses[4] < losses[1]
    assert (folder / "final" / "adapter" / "adapter_model.safetensors").is_file()
    export(str(folder / "checkpoints" / "step_00000004"), str(tmp_path / "peft"), fmt="peft")
    export(str(folder), str(tmp_path / "hf"))
    assert (tmp_path / "peft" / "adapter_config.json").is_file() and (tmp_path / "hf" / "config.json").is_file()
    # The base is an lmforge folder, which transformers cannot load: the adapter names the base's Hugging
    # Face form written beside it, and PEFT alone (from the adapter's folder) gives the merged model's logits.
    peft = pytest.importorskip("peft")
    import transformers

    adapter = folder / "final" / "adapter"
    named = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert named == str(adapter / "base") and (adapter / "base" / "config.json").is_file()
    ids = torch.tensor([[5, 17, 42, 99, 3, 250]])
    with torch.no_grad():
        with_adapter = peft.AutoPeftModelForCausalLM.from_pretrained(str(adapter)).eval()(ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()(ids).logits
    torch.testing.assert_close(with_adapter, merged, atol=1e-5, rtol=1e-5)


@pytest.mark.e2e
@pytest.mark.parametrize("reference", ["precomputed", "live"])
def test_two_fsdp_ranks_equal_one(tmp_path, base, monkeypatch, reference):
    """Two gloo ranks with FSDP2 follow the same steps, rewards and held-out metrics as one
    process, to the same weights: full fine-tuning with the reference precomputed (the rows split
    over the ranks; held-out rows that do not split evenly), and LoRA with the sharded base, its
    adapters off, as the reference."""
    def config(name, **extra):
        # one pair per row, and 21 held-out rows: the ranks hold 11 and 10 of them (as many forwards each)
        lora = {"lora": {"rank": 4, "dropout": 0.0}, "parameters.learning_rate": 1e-2} if reference == "live" else {}
        cfg = pref_config(tmp_path, base, name, training_duration="3ba", save_interval="3ba",
                          **{"eval.interval": "3ba", "parameters.micro_batch_size": 2, "sft.packing": False},
                          **lora, **extra)
        write_jsonl(tmp_path / "val.jsonl", digit_pairs()[1] + digit_pairs()[0][:1])
        return cfg

    train_in_process(config("one"))
    monkeypatch.setenv("LMFORGE_NO_SUPERVISOR", "1")  # torchrun's two ranks only, no supervising parent
    lmforge("finetune", "-f", write_config(tmp_path / "fsdp.yaml", config(
        "fsdp", **{"compute.ranks": 2, "compute.data_parallel": "fsdp"})), check=True)
    one, two = ({m["step"]: m for m in metrics(tmp_path / n) if "train/loss" in m} for n in ("one", "fsdp"))
    assert sorted(two) == [1, 2, 3] and one[3]["train/loss"] != one[1]["train/loss"]
    for step in one:
        for key in ("train/loss", "train/rewards/chosen", "train/rewards/rejected", "train/rewards/accuracy"):
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-4, abs=1e-6), (step, key)
    eval_one, eval_two = (next(m for m in metrics(tmp_path / n) if "eval/loss" in m) for n in ("one", "fsdp"))
    assert eval_two["eval/pairs"] == eval_one["eval/pairs"] == 21
    assert eval_two["eval/loss"] == pytest.approx(eval_one["eval/loss"], rel=1e-4)
    wa, wb = final_weights(tmp_path / "one"), final_weights(tmp_path / "fsdp")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-3, atol=1e-5)


@pytest.mark.integration
def test_a_run_names_its_cut_and_dropped_pairs_first_and_ends_with_its_preference_metrics(tmp_path, base):
    """What `lmforge finetune` prints: among the first lines, the pairs cut to fit (the prompt from the
    left) and dropped (chosen = rejected after the cut), by file:line; at the end, the held-out
    preference accuracy and margin beside the loss (once); `runs describe` shows them too."""
    shared = "".join(f" {w}" for w in WORDS * 4)
    rows = digit_pairs()[0][:15] + [
        {"prompt": "".join(f"# line {i}\n" for i in range(40)) + "# two", "chosen": " 2\n", "rejected": " 3\n"},
        {"prompt": "# say", "chosen": shared + " yes", "rejected": shared + " no"}]
    raw = pref_config(tmp_path, base, training_duration="2ba", save_interval="2ba", **{"eval.interval": "2ba"})
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    out = cli("finetune", "-f", write_config(tmp_path / "dpo.yaml", raw), "--no-supervisor", check=True).stdout
    lines = out.splitlines()
    data = next(i for i, ln in enumerate(lines) if ln.startswith("data: "))
    assert data < next(i for i, ln in enumerate(lines) if ln.startswith("run pref-dpo")), lines[:12]
    assert lines[data].startswith("data: 16 pairs in ") and lines[data].endswith(
        f"; 20 held-out pairs; 1 cut to fit the context length, 1 of them in the prompt, from the left ({train}:16); "
        f"1 dropped (chosen and rejected are identical after the cut: {train}:17)"), lines[data]
    end = next(i for i, ln in enumerate(lines) if ln.startswith("completed after 2 steps"))
    last = [m for m in metrics(tmp_path / "dpo") if "eval/rewards/accuracy" in m][-1]
    final_eval = [ln for ln in lines[:end] if ln.startswith("eval step 2 | ")]  # the run's last lines: once
    assert final_eval == [f"eval step 2 | loss {last['eval/loss']:.4f} | acc {last['eval/rewards/accuracy']:.2f} "
                          f"margin {last['eval/rewards/margin']:.3g} | pairs 20 | rewards/chosen "
                          f"{last['eval/rewards/chosen']:.4g} | rewards/rejected {last['eval/rewards/rejected']:.4g}"]
    assert not any(ln.startswith("  eval/") for ln in lines[end:]), lines[end:]  # not again in the summary
    # `runs describe`: what the supervisor keeps of metrics.jsonl (`MetricsTail`, `summarize`) as it prints it
    from lmforge.cli.runs import metrics_lines
    from lmforge.runs.progress import MetricsTail, metrics_path, summarize

    tail = MetricsTail(metrics_path(str(tmp_path / "dpo")))
    stored = summarize(tail.poll(), raw, tail.latest_eval)
    described = metrics_lines(SimpleNamespace(latest_metrics=stored, is_terminal=True, config=raw))
    train = [m for m in metrics(tmp_path / "dpo") if "train/loss" in m][-1]
    assert f"  accuracy {train['train/rewards/accuracy']:.3f}  margin " in described[0], described
    assert described[1].startswith(f"held-out   step 2  loss {last['eval/loss']:.4f}  accuracy "
                                   f"{last['eval/rewards/accuracy']:.3f}  margin "), described
    assert described[1].endswith("(20 pairs)") and "progress 100% step 2" in described[0], described


# --------------------------------------------------------------------------- bad input

BAD = [
    ("missing", {"rows": [{"prompt": "# one", "chosen": " 1\n"}]}, ["train.jsonl:2", "'rejected'"]),
    ("identical", {"rows": [{"prompt": "# one", "chosen": " 1\n", "rejected": " 1\n"}]},
     ["train.jsonl:2", "identical"]),
    ("empty-prompt", {"rows": [{"prompt": " ", "chosen": " 1\n", "rejected": " 2\n"}]},
     ["train.jsonl:2", "field 'prompt' is empty"]),
    ("no-prompt-messages", {"rows": [{"prompt": [], "chosen": [{"role": "assistant", "content": "1"}],
                                      "rejected": [{"role": "assistant", "content": "2"}]}]},
     ["train.jsonl:2", "'prompt' is an empty list"]),
    ("nothing-fits", {"rows": [], "context": 4}, ["no pair fits within context_length 4", "train.jsonl:1"]),
    ("beta", {"preference": {"beta": 0}}, ["preference.beta", "greater than 0"]),
    ("reference-free", {"preference": {"loss": "simpo", "reference": "precomputed"}},
     ["preference", "simpo is reference-free"]),
    ("live-without-lora", {"preference": {"reference": "live"}}, ["preference.reference: live", "lora"]),
]


@pytest.mark.parametrize("case,change,needles", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line(tmp_path, base, case, change, needles):
    raw = pref_config(tmp_path, base)
    if "context" in change:
        raw["parameters"]["context_length"] = change["context"]
    if "rows" in change:
        write_jsonl(tmp_path / "train.jsonl", digit_pairs()[0][:1] + change["rows"])
    else:
        raw["preference"] = change["preference"]
    proc = cli("finetune", "-f", write_config(tmp_path / "bad.yaml", raw), "--no-supervisor")
    assert_one_line_error(proc, *needles)
    assert not (tmp_path / "dpo" / "checkpoints").exists()


def test_example_data_is_what_its_generator_writes(tmp_path):
    """examples/data/preference is the output of examples/preference_pairs.py, and the example
    configs read."""
    import subprocess
    import sys

    from lmforge.config.load import build_config, read_yaml

    subprocess.run([sys.executable, str(REPO / "examples" / "preference_pairs.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True)
    for name in ("train.jsonl", "val.jsonl"):
        assert (tmp_path / name).read_text() == (REPO / "examples" / "data" / "preference" / name).read_text()
    cfg = read_yaml(str(REPO / "examples" / "preference.yaml")) | {"model": "llama-tiny", "tokenizer": "tok"}
    assert build_config(cfg).task_type == "preference"
    (pair,) = read_pairs([str(REPO / "examples" / "data" / "preference" / "val.jsonl")])[:1]
    assert pair[0] != pair[1]
