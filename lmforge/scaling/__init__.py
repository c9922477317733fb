"""Scaling-law ladders, the pure part: the ladder file (`config`), the plan (`plan`), the fit
(`fit`), the prediction (`predict`) and its table (`summary`). Free of torch; `runs.ladder` runs
the ladder and `cli.scaling` is the command (docs/scaling.md)."""
