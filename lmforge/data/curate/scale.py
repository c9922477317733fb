"""lmforge's curation steps as datatrove pipeline steps, for datatrove pipelines users compose.

`lmforge data prepare` / `data dedup` run on datatrove's executors themselves (``--executor``,
``--tasks``: ``lmforge.data.prepare.job``). For pipelines of your own, datatrove runs steps as many tasks
on a local process pool (``LocalPipelineExecutor``), a Slurm cluster (``SlurmPipelineExecutor``)
or Ray (``RayPipelineExecutor``). This module gives it lmforge's steps:

* ``CurationFilter`` — a datatrove filter step running lmforge's per-document checks (language,
  C4, FineWeb, Gopher, decontamination: ``curator.DocChecker``) with a ``CurateConfig``;
* ``minhash_stages`` — the four stages of datatrove's own MinHash dedup (signatures → buckets →
  clusters → filter), configured from a ``DedupConfig`` (shingle size; bands and rows from
  datasketch's choice for the threshold: ``lsh_params``, also used by ``crossdedup``) and
  lmforge's regex word splitter (no spaCy).

docs/curation.md shows a complete script.
"""

from __future__ import annotations

import re

from lmforge.config.curation import CurateConfig, DedupConfig
from lmforge.errors import UserError

try:
    from datatrove.pipeline.filters.base_filter import BaseFilter
    from datatrove.utils.word_tokenizers import WordTokenizer
except ImportError:  # the module stays importable; using it says what to install
    BaseFilter = WordTokenizer = object

_SENTENCE = re.compile(r"[^.!?\n]+(?:[.!?]+['\"”’)\]]*|\n|$)")


def _need_datatrove() -> None:
    if BaseFilter is object:
        raise UserError("scale-out needs datatrove: pip install 'lmforge[curate]'")


class RegexWordTokenizer(WordTokenizer):
    """Words as lmforge's filters split them (``filters.words_of``), for datatrove steps."""

    def __init__(self):
        _need_datatrove()
        super().__init__("en")

    def word_tokenize(self, text: str) -> list[str]:
        from lmforge.data.curate.filters import words_of

        return words_of(text)

    def sent_tokenize(self, text: str) -> list[str]:
        return [s.strip() for s in _SENTENCE.findall(text) if s.strip()]

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        return [m.span() for m in _SENTENCE.finditer(text) if m.group().strip()]


class CurationFilter(BaseFilter):
    """lmforge's per-document curation as a datatrove pipeline step (removed documents are
    counted in datatrove's stats under their reason and can go to an ``exclusion_writer``)."""

    name = "lmforge curation"

    def __init__(self, curate: CurateConfig | dict, exclusion_writer=None):
        _need_datatrove()
        super().__init__(exclusion_writer)
        from lmforge.data.curate import resolve_curation

        cfg, self._index = resolve_curation(curate)
        self._cfg_json = cfg.model_dump_json() if cfg else None
        self._checker = None

    def filter(self, doc) -> bool | tuple[bool, str]:
        if self._checker is None:  # built in the task's own process
            from lmforge.data.curate.curator import DocChecker

            self._checker = DocChecker(CurateConfig.model_validate_json(self._cfg_json), self._index) \
                if self._cfg_json else False
        if not self._checker:
            return True
        reason, text, tasks = self._checker.check(doc.text)
        if reason is not None:
            if tasks:
                doc.metadata["contaminated_tasks"] = ",".join(tasks)
            return False, reason
        doc.text = text
        return True


def lsh_params(cfg: DedupConfig) -> tuple[int, int]:
    """(bands, rows per band) datasketch would pick for ``cfg.threshold`` and ``cfg.num_perm``."""
    from datasketch.lsh import _optimal_param

    from lmforge.data.curate.dedup import LSH_WEIGHTS

    return _optimal_param(cfg.threshold, cfg.num_perm, *LSH_WEIGHTS)


def minhash_stages(input_reader, work_dir: str, output_writer, dedup: DedupConfig | dict | None = None,
                   tasks: int = 1) -> list[list]:
    """The four pipelines of datatrove's MinHash dedup, each to run on an executor after the last.

    ``input_reader``: a datatrove reader (e.g. ``JsonlReader(folder)``), used by stages 1 and 4;
    ``output_writer``: where stage 4 writes the kept documents.
    """
    _need_datatrove()
    from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,
                                                  MinhashDedupFilter, MinhashDedupSignature)
    from datatrove.utils.hashing import HashConfig

    cfg = dedup if isinstance(dedup, DedupConfig) else DedupConfig.model_validate(dedup or {})
    bands, rows = lsh_params(cfg)
    mh = MinhashConfig(n_grams=cfg.ngram, num_buckets=bands, hashes_per_bucket=rows,
                       hash_config=HashConfig(hash_fc="sha1", precision=64))
    sigs, buckets, clusters = f"{work_dir}/signatures", f"{work_dir}/buckets", f"{work_dir}/remove_ids"
    return [
        [input_reader, MinhashDedupSignature(output_folder=sigs, config=mh, language=RegexWordTokenizer())],
        [MinhashDedupBuckets(input_folder=sigs, output_folder=buckets, config=mh)],
        [MinhashDedupCluster(input_folder=buckets, output_folder=clusters, config=mh)],
        [input_reader, MinhashDedupFilter(input_folder=clusters), output_writer],
    ]
