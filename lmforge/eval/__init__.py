"""Evaluation: in-context-learning benchmarks (`icl`) and the gauntlet score (`gauntlet`)."""

from lmforge.eval.gauntlet import Gauntlet, gauntlet_scores, load_gauntlet
from lmforge.eval.icl import ICLTask, evaluate_icl, load_tasks

__all__ = ["ICLTask", "load_tasks", "evaluate_icl", "Gauntlet", "load_gauntlet", "gauntlet_scores"]
