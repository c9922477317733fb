"""Data curation: dedup, quality and language filters, decontamination, and corpus statistics.

Modules: ``text`` (normalization, hashed word n-grams), ``dedup`` (exact + MinHash LSH),
``filters`` (C4, FineWeb, Gopher rules), ``language`` (fastText lid.176), ``decontaminate`` (n-gram
overlap with ICL tasks), ``curator`` (per-document checks, accounting), ``crossdedup`` (dedup
across work units and tasks, in stages), ``pipeline`` (the per-chunk work, in-process or in worker
processes), ``scale`` (the steps for users' own datatrove pipelines). The jobs that run these rules
(`data prepare`, `data dedup`, `data stats`) live in ``lmforge.data.prepare``; nothing here imports them.
The settings are ``lmforge.config.curation.CurateConfig``.
"""

from __future__ import annotations

from lmforge.config.curation import CurateConfig
from lmforge.errors import UserError


def resolve_curation(curate, where: str = "curate"):
    """A CurateConfig (or mapping, or None) → (config or None when nothing is on, decontamination index)."""
    if curate is None:
        return None, None
    if not isinstance(curate, CurateConfig):
        from pydantic import ValidationError

        from lmforge.config.load import format_error

        try:
            curate = CurateConfig.model_validate(curate)
        except ValidationError as e:
            msg = format_error(e, CurateConfig)
            for lead in ("unknown config key '", "missing required config key '"):
                if msg.startswith(lead):
                    raise UserError(lead + f"{where}." + msg[len(lead):]) from None
            raise UserError(f"{where}.{msg}") from None
    if not curate.active:
        return None, None
    index = None
    if curate.decontaminate is not None:
        d = curate.decontaminate
        if not d.tasks:
            raise UserError(f"{where}.decontaminate.tasks: no ICL tasks to decontaminate against (set "
                            "eval.icl_tasks in the run, or give a tasks YAML / 'default')")
        from lmforge.data.curate.decontaminate import load_index

        index = load_index(d.tasks, d.ngram, d.data_root)
    return curate, index
