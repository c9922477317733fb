"""From a run config's `tokenizer` / `train_data` / `eval` to ready-to-stream datasets.

`train_data` entries may be prepared MDS datasets or raw text (anything `data prepare` reads,
`builtin:python-stdlib` included). Raw text is tokenized and packed once into a cache keyed by
the inputs and settings (``$LMFORGE_HOME/cache/data/<key>``), and a requested tokenizer
(``tokenizer: {train: {vocab_size: N}}``) is trained once into ``cache/tokenizers/<key>``;
later runs reuse both.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import partial
from itertools import islice
from typing import Iterator

from lmforge.config.curation import CurateConfig
from lmforge.config.schema import RunConfig, TokenizerSpec
from lmforge.data.batch import Batch, EvalSet, StreamLayout
from lmforge.data.pieces import epoch_pieces, split_lines
from lmforge.data.prepare.prepare import input_warnings, summary_seq_len
from lmforge.data.prepare.prepared import SUMMARY_FILE, exists_at, is_prepared, join, prepared_summary
from lmforge.data.stream.tokens import DatasetSpec, StreamPhase, TokenStream, open_dataset
from lmforge.data.text.tokenizer import load_tokenizer
from lmforge.errors import UserError
from lmforge.home import cache_dir



@dataclass
class ResolvedDataset:
    name: str
    path: str  # a prepared dataset: MDS folder, or a folder with train/ and val/
    proportion: float | None
    summary: dict = field(default_factory=dict)
    _stored: tuple[int, int] | None = field(default=None, repr=False, compare=False)

    @property
    def seq_len(self) -> int | None:
        return summary_seq_len(self.summary)

    def split_stats(self, split: str) -> dict:
        return (self.summary.get("splits") or {}).get(split) or {}

    def has_split(self, split: str) -> bool:
        return exists_at(join(self.path, split, "index.json"))

    def stored(self) -> tuple[int, int]:
        """(stored samples, tokens per sample) of the train split, as the stream reads them (opened
        once: resolution asks several times)."""
        if self._stored is None:
            reader = open_dataset(self.path)
            self._stored = (len(reader), reader.sample_length(0))
        return self._stored


@dataclass
class ResolvedData:
    """Prepared pretraining data: the tokenizer, the datasets of the mix, the held-out sets.
    A `TrainingData` of kind ``"pretrain"``."""

    tokenizer_path: str
    train: list[ResolvedDataset]
    eval: list[tuple[ResolvedDataset, str]]  # (dataset, split) pairs to evaluate on
    kind: str = "pretrain"
    chat_template: str | None = None
    # A curriculum: the mix of each phase and where it ends on the global sample axis. Set by
    # `resolve` once the plan has put the ends on optimizer steps; None: one mix (`train`).
    phases: list[StreamPhase] | None = None

    def epoch_pieces(self, ctx: int) -> int:
        """Training samples of ``ctx`` tokens in one epoch: every piece of every dataset once
        (`data.pieces`; with data prepared at ``ctx``, its stored samples)."""
        return epoch_pieces([d.stored() for d in self.train], ctx)

    def split_lines(self, ctx: int) -> list[str]:
        """What the run says at its start where stored samples are longer than ``ctx``."""
        return split_lines([(d.name, d.seq_len or d.stored()[1]) for d in self.train], ctx)

    def train_stream(self, layout: StreamLayout) -> TokenStream:
        return _token_stream([DatasetSpec(d.name, d.path, d.proportion) for d in self.train], layout,
                             phases=self.phases)

    def eval_sets(self, layout: StreamLayout, max_batches: int) -> list[EvalSet]:
        # Each pass reads the same first micro-batches of the split: one micro-batch per rank per
        # "step", so every rank evaluates different samples.
        per_pass = layout.one_pass()
        sets = []
        for d, split in self.eval:
            name = "eval" if len(self.eval) == 1 else f"eval/{d.name}"
            spec = DatasetSpec(d.name, d.path, None)
            sets.append(EvalSet(name, partial(_first_batches, spec, per_pass, split, max_batches),
                                d.split_stats(split).get("bytes_per_token")))
        return sets


def _token_stream(specs: list[DatasetSpec], layout: StreamLayout, split: str = "train",
                  phases: list[StreamPhase] | None = None) -> TokenStream:
    return TokenStream(specs, seq_len=layout.seq_len, layout=layout.layout, rank=layout.rank, seed=layout.seed,
                       num_workers=layout.num_workers, split=split, pin_memory=layout.pin_memory, phases=phases,
                       document_eos=layout.document_eos)


def _first_batches(spec: DatasetSpec, layout: StreamLayout, split: str, n: int) -> Iterator[Batch]:
    stream = _token_stream([spec], layout, split)
    try:
        yield from islice(stream, n)
    finally:
        stream.close()


def _fingerprint(inputs: list[str]) -> str:
    """What identifies raw inputs for the cache key: `data prepare`'s own fingerprint of the files."""
    from lmforge.data.prepare.prepare import input_fingerprint
    from lmforge.data.text.sources import list_files

    return input_fingerprint(list_files(inputs))


def _key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def resolve_tokenizer(cfg: RunConfig, log=print) -> str:
    spec = cfg.tokenizer
    if isinstance(spec, TokenizerSpec) and spec.extend is not None:
        return _extended_tokenizer(cfg, log)
    if isinstance(spec, TokenizerSpec):
        raw = [d for d in cfg.train_data if not is_prepared(d.path)]
        if not raw:
            raise UserError("tokenizer.train: needs raw text in train_data to train on, but every "
                            "train_data entry is an already prepared dataset; give `tokenizer: PATH` instead")
        inputs = [d.path for d in raw]
        key = _key({"inputs": _fingerprint(inputs), "vocab": spec.train.vocab_size, "bos": spec.train.bos,
                    "fields": [d.text_field for d in raw]})
        out = os.path.join(cache_dir("tokenizers"), key)
        if os.path.exists(os.path.join(out, "tokenizer.json")):
            log(f"tokenizer: reusing {out}")
            return out
        from lmforge.data.text.tokenizer import train_tokenizer

        log(f"tokenizer: training a {spec.train.vocab_size}-token BPE on {', '.join(inputs)} → {out}")
        tmp = out + f".tmp-{os.getpid()}"
        train_tokenizer(inputs, spec.train.vocab_size, tmp, text_field=raw[0].text_field, add_bos=spec.train.bos)
        os.replace(tmp, out)
        return out
    if isinstance(spec, str):
        return spec
    # No tokenizer given: the one recorded by `data prepare` for the first prepared dataset.
    for d in cfg.train_data:
        if is_prepared(d.path):
            tok = (prepared_summary(d.path).get("tokenizer") or {}).get("path")
            if tok and os.path.exists(tok):
                return tok
    raise UserError("tokenizer: required (a tokenizer folder, or {train: {vocab_size: N}} to train one)")


def _extended_tokenizer(cfg: RunConfig, log=print) -> str:
    """`tokenizer: {extend: …}`: the weights' tokenizer plus merges learned on the raw train_data
    (`vocab_extension`), made once into ``cache/tokenizers/<key>``."""
    from lmforge.data.text.vocab_extension import extend_tokenizer

    spec = cfg.tokenizer.extend
    base = spec.base  # filled from custom_weights_path by `resolve` when left out
    if base is None:
        raise UserError("tokenizer.extend.base: not set (the tokenizer folder to extend)")
    raw = [d for d in cfg.train_data if not is_prepared(d.path)]
    if not raw:
        raise UserError("tokenizer.extend: needs raw text in train_data to learn new merges from, but every "
                        "train_data entry is an already prepared dataset")
    inputs = [d.path for d in raw]
    key = _key({"inputs": _fingerprint(inputs), "base": load_tokenizer(base).fingerprint,
                "extend": spec.vocab_size, "fields": [d.text_field for d in raw]})
    out = os.path.join(cache_dir("tokenizers"), key)
    if os.path.exists(os.path.join(out, "tokenizer.json")):
        log(f"tokenizer: reusing {out}")
        return out
    log(f"tokenizer: extending {base} to {spec.vocab_size} tokens with merges learned on {', '.join(inputs)} → {out}")
    extend_tokenizer(base, inputs, spec.vocab_size, out, text_field=raw[0].text_field)
    return out


def _prepare_cached(inputs: list[str], tokenizer_path: str, seq_len: int, eval_fraction: float,
                    text_field: str, log=print, curate: CurateConfig | None = None) -> str:
    from lmforge.data.prepare.prepare import prepare

    ident = {"inputs": _fingerprint(inputs), "tok": load_tokenizer(tokenizer_path).fingerprint,
             "seq": seq_len, "eval": eval_fraction, "field": text_field}
    if curate is not None and curate.active:  # curation settings are part of the key (absent: keys as before)
        ident["curate"] = curate.model_dump(mode="json")
    else:
        curate = None
    out = os.path.join(cache_dir("data"), _key(ident))
    if not os.path.exists(os.path.join(out, SUMMARY_FILE)):
        log(f"data: preparing {', '.join(inputs)} (seq {seq_len}, {eval_fraction:.1%} held out"
            f"{', curated' if curate else ''}) → {out}")
    # overwrite: the folder is ours, keyed by the settings; a stale one (e.g. eval task files edited
    # under the same path, which changes the decontamination index) is rebuilt.
    summary = prepare(inputs, tokenizer_path, out, seq_len, eval_fraction=eval_fraction,
                      workers=min(4, os.cpu_count() or 1), text_field=text_field, progress=None, curate=curate,
                      overwrite=True, flags=("eval.holdout_fraction", "parameters.context_length"))
    for line in input_warnings(summary):  # every run that reads this data: it is the data's, not one run's
        log(f"warning: data {', '.join(inputs)}: {line}")
    if curate is not None and not summary.get("already_prepared"):
        c = summary["curation"]
        log(f"data: curation kept {c['documents_kept']:,} of {c['documents_in']:,} documents"
            + (f" (removed: {', '.join(f'{k} {v}' for k, v in c['by_reason'].items())})" if c["by_reason"] else "")
            + (f"; contaminated tasks: {', '.join(f'{k} {v}' for k, v in c['contaminated_tasks'].items())}"
               if c["contaminated_tasks"] else ""))
    return out


def _curation_for(cfg: RunConfig, curate: CurateConfig | None) -> CurateConfig | None:
    """A dataset's curate settings, with decontamination defaulting to the run's own ICL tasks."""
    if curate is None or curate.decontaminate is None or curate.decontaminate.tasks:
        return curate
    d = curate.decontaminate.model_copy(update={"tasks": cfg.eval.icl_tasks,
                                                "data_root": curate.decontaminate.data_root or cfg.eval.data_root})
    return curate.model_copy(update={"decontaminate": d})


def resolve_data(cfg: RunConfig, seq_len: int, log=print) -> ResolvedData:
    """Tokenizer first (it may be trained on the raw data), then each dataset, then eval data."""
    tokenizer_path = resolve_tokenizer(cfg, log=log)
    train = []
    for d in cfg.train_data:
        if is_prepared(d.path):
            path = d.path
        else:
            path = _prepare_cached([d.path], tokenizer_path, seq_len, cfg.eval.holdout_fraction, d.text_field, log,
                                   curate=_curation_for(cfg, d.curate))
        train.append(ResolvedDataset(d.name, path, d.proportion, prepared_summary(path)))
    evals: list[tuple[ResolvedDataset, str]] = []
    if cfg.eval.data_path:
        p = cfg.eval.data_path
        if not is_prepared(p):
            p = _prepare_cached([p], tokenizer_path, seq_len, 0.0, cfg.train_data[0].text_field, log)
        ds = ResolvedDataset("eval", p, None, prepared_summary(p))
        evals.append((ds, "val" if ds.has_split("val") else "train"))
    else:
        evals = [(d, "val") for d in train if d.has_split("val")]
    return ResolvedData(tokenizer_path, train, evals)
