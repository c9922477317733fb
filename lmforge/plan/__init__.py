"""The planner: every decision about a run before it spends anything, in one torch-free package.

flops (`flops`), device peaks (`hardware`), memory (`memory`), long context (`context`), MoE traffic
(`comm`), cost (`cost`), micro-batch and checkpointing (`micro_batch`), `model: auto` (`auto`), the
machine a run is planned for (`machine`), batch and speed (`batch`), the checks (`checks`), the
memory verdict and its remedy (`fit`), the run plan (`run`), the LR schedule (`schedule`), and the
estimate as a view of a plan (`estimate`). Commands reach it through `resolve` (`lmforge.resolve`).
"""
