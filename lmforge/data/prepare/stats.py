"""`lmforge data stats`: what a corpus (raw text) or a prepared dataset holds.

Documents, bytes, tokens and bytes per token, the document-length distribution (in tokens when
a tokenizer is known, else in bytes), the exact- and near-duplicate rates (the share of
documents that `data dedup` would remove), and the language mix (fastText lid.176 on up to
``LANGUAGE_SAMPLE`` documents, an even spread over the corpus). A prepared dataset is read back
from its MDS shards and cut into documents at its EOS tokens; its documents are decoded with the
dataset's own tokenizer for the duplicate and language statistics.
"""

from __future__ import annotations

import base64
from html import escape
import io
import os

import numpy as np

from lmforge.errors import UserError

LANGUAGE_SAMPLE = 2000
MARK = "lmforge data stats"  # in every plot file (PNG metadata, HTML title): `--plot` may replace such a file
BINS = 30


def _raw_documents(inputs: list[str], text_field: str, max_docs: int | None):
    from lmforge.data.text.sources import SourceStats, list_files, no_documents_message, read_source

    stats = SourceStats()
    docs = []
    for src in list_files(inputs, stats):
        for text in read_source(src, text_field, stats):
            docs.append(text)
            if max_docs and len(docs) >= max_docs:
                return docs
    if not docs:
        raise UserError(no_documents_message(inputs, stats))
    return docs


def _prepared_documents(path: str, max_docs: int | None):
    """(summary, document texts, token lengths, tokenizer path, stored tokens) of a prepared dataset's
    train split: its documents are the EOS-ended runs of its samples' tokens (whole documents; a
    packing unit's last document, cut where its last full sample ended, has no EOS in them)."""
    import tempfile

    from lmforge.data.mds import MDSReader
    from lmforge.data.prepare.prepare import read_summary
    from lmforge.data.text.tokenizer import load_tokenizer

    summary = read_summary(path)
    tok_info = summary.get("tokenizer") or {}
    eos = tok_info.get("eos_id")
    if "://" in path:
        raise UserError(f"{path}: `data stats` reads local prepared datasets (download it first)")
    with tempfile.TemporaryDirectory() as cache:
        reader = MDSReader(os.path.join(path, "train"), cache_dir=cache)
        flat = np.concatenate([reader.get_tokens(i) for i in range(len(reader))]).astype(np.int64)
    ends = np.flatnonzero(flat == eos) + 1
    starts = np.concatenate([[0], ends[:-1]])
    if max_docs:
        starts, ends = starts[:max_docs], ends[:max_docs]
    lengths = (ends - starts).astype(np.int64)
    tok = load_tokenizer(tok_info["path"]) if tok_info.get("path") and os.path.exists(tok_info["path"]) else None
    texts = [tok.decode(flat[a:b - 1].tolist()) for a, b in zip(starts, ends)] if tok else None
    return summary, texts, lengths, tok_info.get("path"), int(len(flat))


def _histogram(values: np.ndarray) -> dict:
    v = np.asarray(values, np.float64)
    lo, hi = max(1.0, v.min()), max(2.0, v.max())
    edges = np.unique(np.geomspace(lo, hi + 1, BINS + 1).round())  # log bins: lengths span decades
    counts, edges = np.histogram(v, bins=edges)
    return {"edges": edges.tolist(), "counts": counts.tolist()}


def _duplicates(texts: list[str]) -> dict:
    from lmforge.config.curation import DedupConfig
    from lmforge.data.curate.dedup import Deduplicator, signatures

    out = {}
    cfg = DedupConfig(near=False)
    keys, _ = signatures(texts, cfg)
    d = Deduplicator(cfg)
    out["exact_rate"] = round(sum(d.check(i, k, None)[0] is not None for i, k in enumerate(keys)) / len(texts), 6)
    try:
        cfg = DedupConfig()
        keys, sigs = signatures(texts, cfg)
        d = Deduplicator(cfg)
        out["near_rate"] = round(sum(d.check(i, k, s)[0] is not None
                                     for i, (k, s) in enumerate(zip(keys, sigs))) / len(texts), 6)
        out["near_threshold"] = cfg.threshold
    except UserError:  # datasketch not installed: exact only
        out["near_rate"] = None
    return out


def _languages(texts: list[str]) -> tuple[dict, int]:
    try:
        from lmforge.data.curate.language import LanguageID

        lid = LanguageID()
    except UserError:
        return {}, 0
    step = max(1, len(texts) // LANGUAGE_SAMPLE)
    sample = texts[::step][:LANGUAGE_SAMPLE]
    counts: dict[str, int] = {}
    for t in sample:
        lang, _ = lid.best(t)
        counts[lang] = counts.get(lang, 0) + 1
    mix = {k: round(v / len(sample), 4) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}
    return mix, len(sample)


def corpus_stats(sources: list[str] | str, *, tokenizer: str | None = None, text_field: str = "text",
                 max_docs: int | None = None) -> dict:
    from lmforge.data.prepare.prepared import is_prepared

    sources = [sources] if isinstance(sources, str) else list(sources)
    if max_docs is not None and max_docs < 1:
        raise UserError(f"--max-docs {max_docs}: expected a positive integer")
    out: dict = {"source": sources}
    if len(sources) == 1 and is_prepared(sources[0]) and os.path.isdir(os.path.join(sources[0], "train")):
        summary, texts, lengths, tok_path, stored = _prepared_documents(sources[0], max_docs)
        train = (summary.get("splits") or {}).get("train") or {}
        whole = {"documents": int(len(lengths)), "tokens": int(lengths.sum()), "stored_tokens": stored,
                 "dropped_tokens": train.get("dropped_tokens")}
        # The counts the dataset's card (its marker) says — every document tokenized, whole or cut where a
        # packing unit's last full sample ended — beside what its samples hold (`whole`, `stat_rows`).
        recorded = not max_docs and train.get("documents") is not None and train.get("tokens") is not None
        out |= {"kind": "prepared", "tokenizer": tok_path,
                "documents": int(train["documents"]) if recorded else whole["documents"],
                "tokens": int(train["tokens"]) if recorded else whole["tokens"], "in_samples": whole,
                "bytes": train.get("bytes"), "bytes_per_token": train.get("bytes_per_token"), "length_unit": "tokens"}
        if summary.get("curation"):
            out["curation"] = summary["curation"]
    else:
        texts = _raw_documents(sources, text_field, max_docs)
        nbytes = np.array([len(t.encode("utf-8", "replace")) for t in texts], np.int64)
        out |= {"kind": "raw", "documents": len(texts), "bytes": int(nbytes.sum())}
        if tokenizer:
            from lmforge.data.text.tokenizer import load_tokenizer

            tok = load_tokenizer(tokenizer)
            lengths = np.array([len(e.ids) + 1 for e in tok.backend.encode_batch(texts)], np.int64)  # + EOS
            out |= {"tokenizer": tokenizer, "tokens": int(lengths.sum()),
                    "bytes_per_token": round(out["bytes"] / int(lengths.sum()), 6), "length_unit": "tokens"}
        else:
            lengths = nbytes
            out |= {"tokens": None, "bytes_per_token": None, "length_unit": "bytes"}
    q = np.percentile(lengths, [50, 90, 99]) if len(lengths) else [0, 0, 0]
    out["doc_length"] = {"mean": round(float(lengths.mean()), 2), "p50": float(q[0]), "p90": float(q[1]),
                         "p99": float(q[2]), "max": int(lengths.max()), "histogram": _histogram(lengths)}
    if texts:
        out["duplicates"] = _duplicates(texts)
        out["languages"], out["language_sample"] = _languages(texts)
    return out


def stat_rows(s: dict) -> list[tuple[str, str]]:
    """(what, value) of the statistics, one short value per row (the terminal table and the HTML page)."""
    def fmt(v):
        return "-" if v is None else f"{v:,}" if isinstance(v, int) else f"{v:.3f}" if isinstance(v, float) else str(v)

    rows = [(k.replace("_", " "), fmt(s.get(k))) for k in ("documents", "bytes", "tokens", "bytes_per_token")]
    packed = s.get("in_samples")
    if packed:  # a prepared dataset: what its samples hold of those documents and tokens
        rows.append(("whole documents in the samples", fmt(packed["documents"])))
        rows.append(("tokens stored in the samples", fmt(packed["stored_tokens"])))
        if packed.get("dropped_tokens") is not None:
            rows.append(("tokens dropped (a packing unit's tail)", fmt(packed["dropped_tokens"])))
    d, unit = s["doc_length"], s["length_unit"]
    unit = f"{unit}, whole documents" if packed else unit
    rows += [(f"doc length {k} ({unit})", f"{d[k]:,.0f}") for k in ("mean", "p50", "p90", "p99", "max")]
    dup = s.get("duplicates") or {}
    rows.append(("exact-duplicate rate", "-" if dup.get("exact_rate") is None else f"{dup['exact_rate']:.2%}"))
    rows.append((f"exact-or-near duplicate rate (Jaccard ≥ {dup.get('near_threshold', '-')})",
                 "-" if dup.get("near_rate") is None else f"{dup['near_rate']:.2%}"))
    for lang, share in list((s.get("languages") or {}).items())[:6]:  # one row each: a list would wrap mid-item
        rows.append((f"language {lang} (of {s['language_sample']:,} sampled)", f"{share:.0%}"))
    return rows


def print_stats(s: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title=f"{s['kind']} corpus {' '.join(s['source'])}", title_justify="left", show_header=False)
    t.add_column("what", no_wrap=True)
    t.add_column("value", justify="right", no_wrap=True)
    for what, value in stat_rows(s):
        t.add_row(what, value)
    console.print(t)
    d, unit = s["doc_length"], s["length_unit"]
    h = d["histogram"]
    peak = max(h["counts"]) or 1
    console.print(f"document length histogram ({unit}, log bins):", highlight=False)
    for lo, hi, c in zip(h["edges"][:-1], h["edges"][1:], h["counts"]):
        if c:
            console.print(f"  {lo:>9,.0f} – {hi:<9,.0f} {'█' * max(1, round(30 * c / peak))} {c:,}", highlight=False)
    if s.get("plot"):
        console.print(f"plots: {s['plot']}", highlight=False)


def _log_axis(ax, lo: float, hi: float) -> tuple[float, float]:
    """A log length axis at least a decade wide (one document's axis was a sliver whose every tick
    read 3.89038×10^5), labelled 1, 2, 5 × 10^k in short numbers (200K) where it spans few decades."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    def short(x, _=None) -> str:
        for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if x >= scale:
                return f"{x / scale:g}{unit}"
        return f"{x:g}"

    if hi / lo < 10:
        mid = (lo * hi) ** 0.5
        lo, hi = mid / 10 ** 0.5, mid * 10 ** 0.5
    ax.set_xscale("log")
    ax.set_xlim(lo, hi)
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if hi / lo < 1e3 else (1.0,)))
    ax.xaxis.set_major_formatter(FuncFormatter(short))
    ax.xaxis.set_minor_formatter(NullFormatter())
    return lo, hi


def _figure(s: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    h = s["doc_length"]["histogram"]
    ax = axes[0]
    edges = np.asarray(h["edges"], np.float64)
    lo, hi = _log_axis(ax, edges[0], edges[-1])
    # A bin narrower than 1/80 of the axis (one document's is a single length) is drawn that wide.
    centers = np.sqrt(edges[:-1] * edges[1:])
    half = np.maximum(np.sqrt(edges[1:] / edges[:-1]), (hi / lo) ** (1 / 160))
    ax.bar(centers / half, h["counts"], width=centers * half - centers / half, align="edge", edgecolor="white")
    ax.set_xlabel(f"document length ({s['length_unit']})")
    ax.set_ylabel("documents")
    ax.set_title(f"{s['documents']:,} document{'' if s['documents'] == 1 else 's'}")
    ax = axes[1]
    dup = s.get("duplicates") or {}
    names = ["exact", "exact or near"]
    vals = [dup.get("exact_rate") or 0, dup.get("near_rate") or 0]
    bars = ax.bar(names, [100 * v for v in vals], color=["#4c72b0", "#dd8452"])
    ax.bar_label(bars, labels=[f"{v:.2%}" for v in vals])  # a rate of 0 is a bar of no height: say it
    ax.set_ylim(0, max(1.0, 125 * max(vals)))
    ax.set_ylabel("% of documents")
    ax.set_title("duplicate rate")
    ax = axes[2]
    langs = list((s.get("languages") or {}).items())[:10]
    if langs:
        ax.barh([k for k, _ in langs][::-1], [100 * v for _, v in langs][::-1], color="#55a868")
        ax.set_xlabel(f"% of {s['language_sample']:,} sampled documents")
    ax.set_title("language mix")
    fig.suptitle(f"{s['kind']} corpus {' '.join(s['source'])}")
    fig.tight_layout()
    return fig


def plot_format(path: str) -> str:
    """``.png`` or ``.html``: the kinds of file `write_plots` writes; else one line."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".png", ".html"):
        raise UserError(f"--plot {path}: expected a .png or .html file name")
    return ext


def write_plots(s: dict, path: str) -> str:
    """The plots as a PNG, or an HTML page with the PNG and the numbers (one self-contained file), in
    a folder that exists (`guard.check_output_file` saw to it)."""
    ext = plot_format(path)
    fig = _figure(s)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": MARK})
    import matplotlib.pyplot as plt

    plt.close(fig)
    from pathlib import Path

    from lmforge.data.remote import write_local_atomic  # written beside it and renamed: never half a file

    if ext == ".png":
        write_local_atomic(Path(path), buf.getvalue())
        return path
    img = base64.b64encode(buf.getvalue()).decode()
    rows = "".join(f"<tr><td>{escape(k)}</td><td class='num'>{escape(v)}</td></tr>" for k, v in stat_rows(s))
    html = (f"<!doctype html><meta charset='utf-8'><title>{MARK}</title>"
            "<style>body{font-family:system-ui,sans-serif;margin:24px} table{border-collapse:collapse}"
            "td{border:1px solid #ddd;padding:3px 8px} td.num{text-align:right}</style>"
            f"<h2>{escape(s['kind'])} corpus {escape(' '.join(s['source']))}</h2>"
            f"<img style='max-width:100%;height:auto' src='data:image/png;base64,{img}'><table>{rows}</table>")
    write_local_atomic(Path(path), html.encode("utf-8"))
    return path
