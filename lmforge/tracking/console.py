"""The terminal view of a run: plain log lines, and on a TTY a live rich progress bar below them.

Plain lines (about every ``log_every`` steps, on the last step and on every eval) are what CI logs,
detached runs and the log of a foreground run (``runs logs``) hold; on a terminal they scroll above
a one-line bar that redraws in place (the supervisor's log keeps what a terminal keeps of it,
`runs.terminal_text`: the lines, and the bar's last frame). The ETA of both is the trainer's own:
the pace since the first logged step, on its training clock; for a wall-clock budget (no step
count), the time left of the budget, from the share done the trainer logs (``train/progress``).
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import TextIO

from lmforge.config.counts import human
from lmforge.plan.cost import eta_s
from lmforge.tracking.base import Tracker, scalar_metrics


def format_eta(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    return str(timedelta(seconds=int(seconds)))


def default_log_every(total_steps: int | None) -> int:
    """About 20 lines per run, but at least one every 100 steps."""
    if not total_steps:
        return 10
    return max(1, min(100, total_steps // 20))


def train_summary(m: dict[str, float], total_tokens: int | None = None, eta_s: float | None = None) -> list[str]:
    """The "tokens | loss | lr | ..." fields shown for a training step (only those present).

    With a price (``compute.price_per_gpu_hour``) the cost so far, and with an ETA the
    estimated cost of the rest at the current burn rate."""
    parts = []
    if "train/tokens" in m:
        tok = f"tok {human(m['train/tokens'])}"
        if total_tokens:
            tok += f"/{human(total_tokens)}"
        parts.append(tok)
    if "train/loss" in m:
        parts.append(f"loss {m['train/loss']:.4f}")
    if "train/rewards/accuracy" in m:  # preference tuning: how often the chosen answer wins, and by how much
        parts.append(f"acc {m['train/rewards/accuracy']:.2f} margin {m['train/rewards/margin']:.3g}")
    if "train/reward" in m:  # reinforcement learning: the completions' mean reward, the groups without a signal
        parts.append(f"reward {m['train/reward']:.3f} flat {100 * m['train/flat_groups']:.0f}% "
                     f"len {m['train/completion_length']:.1f}")
    if "train/lr" in m:
        parts.append(f"lr {m['train/lr']:.2e}")
    if "train/grad_norm" in m:
        parts.append(f"gnorm {m['train/grad_norm']:.3f}")
    if "throughput/tokens_per_s" in m:
        parts.append(f"{human(m['throughput/tokens_per_s'])} tok/s")
    if "throughput/mfu" in m:  # a fraction of peak
        parts.append(f"MFU {100 * m['throughput/mfu']:.1f}%")
    if "memory/max_allocated_gb" in m:
        parts.append(f"mem {m['memory/max_allocated_gb']:.1f}GB")
    if "cost/so_far" in m:
        from lmforge.plan.cost import cost_to_finish, format_cost

        rest = cost_to_finish(m.get("cost/per_hour"), eta_s)
        parts.append(f"cost {format_cost(m['cost/so_far'])}" + (f" (+{format_cost(rest)} to finish)" if rest else ""))
    return parts


def eval_summary(m: dict[str, float]) -> list[str]:
    parts = []
    if "eval/loss" in m:
        parts.append(f"loss {m['eval/loss']:.4f}")
    if "eval/perplexity" in m:
        parts.append(f"ppl {m['eval/perplexity']:.2f}")
    if "eval/bits_per_byte" in m:
        parts.append(f"bpb {m['eval/bits_per_byte']:.4f}")
    if "eval/rewards/accuracy" in m:  # preference tuning, as the training lines show it
        parts.append(f"acc {m['eval/rewards/accuracy']:.2f} margin {m.get('eval/rewards/margin', float('nan')):.3g}")
    if "eval/reward" in m:  # reinforcement learning: the greedy completions' reward on the held-out prompts
        parts.append(f"reward {m['eval/reward']:.3f} (greedy, {int(m.get('eval/prompts', 0))} prompts)")
    # Other eval metrics (e.g. ICL accuracies, each reward's) follow in name order.
    known = {"eval/loss", "eval/perplexity", "eval/bits_per_byte", "eval/rewards/accuracy", "eval/rewards/margin",
             "eval/reward", "eval/prompts"}
    for key in sorted(k for k in m if k.startswith("eval/") and k not in known):
        parts.append(f"{key[len('eval/'):]} {m[key]:.4g}")
    return parts


class ConsoleTracker(Tracker):
    """Progress bar (TTY) or log lines (not a TTY) from the metrics the trainer logs."""

    name = "console"

    def __init__(self, total_steps: int | None = None, total_tokens: int | None = None,
                 stream: TextIO | None = None, tty: bool | None = None,
                 log_every: int | None = None, run_name: str | None = None,
                 width: int | None = None) -> None:
        self.stream = stream or sys.stdout
        self.total_steps = total_steps
        self.total_tokens = total_tokens
        self.tty = self.stream.isatty() if tty is None else tty
        self.log_every = log_every or default_log_every(total_steps)
        self.run_name = run_name
        self.width = width  # None: the terminal's width
        self._printed: int | None = None  # the step of the last plain training line
        self._progress = None
        self._task = None

    # -- plain mode -----------------------------------------------------------------
    def _println(self, line: str) -> None:
        if self._progress is not None:
            # Printed above the live bar; markup off so generated text is shown verbatim, and soft-
            # wrapped (by the terminal, not cut into lines): a log keeps it as one line.
            self._progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            print(line, file=self.stream, flush=True)

    # -- live mode ------------------------------------------------------------------
    def _start_bar(self, timed: bool) -> None:
        """``timed``: a wall-clock budget: the bar is its share of time (a percentage), not steps."""
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
        from rich.table import Column

        console = Console(file=self.stream, force_terminal=True, width=self.width)
        # One line at any width: the fixed columns keep their width and the stats are cut to what is
        # left (a bar that wraps is redrawn from above, which leaves its first frame in a log,
        # `runs.terminal_text`). The ETA is the trainer's: rich's own goes blank when log updates are
        # more than 30 s apart.
        def fixed(width: int) -> Column:
            return Column(no_wrap=True, width=width)

        label = "step" if self.total_steps else "time" if timed else "tokens"
        total = self.total_steps or (100 if timed else self.total_tokens)
        count = TextColumn("{task.percentage:>3.0f}%", table_column=fixed(4)) if timed else \
            MofNCompleteColumn(table_column=fixed(2 * len(f"{total:,}") + 1) if total else Column(no_wrap=True))
        self._progress = Progress(
            TextColumn(label, table_column=fixed(len(label))),
            BarColumn(bar_width=20, table_column=fixed(20)),
            count,
            TextColumn("ETA {task.fields[eta]}", table_column=fixed(len("ETA 0:00:00"))),
            TextColumn("{task.fields[stats]}", table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1)),
            console=console,
            expand=True,
            refresh_per_second=4,
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=total, completed=0, stats="", eta="?")

    def _completed(self, step: int, m: dict) -> float:
        """Where the bar stands: the step, the percentage of a wall-clock budget, or the tokens."""
        if self.total_steps:
            return step
        if "train/progress" in m:
            return 100 * m["train/progress"]
        return m.get("train/tokens", 0.0)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        m = scalar_metrics(metrics)
        step = int(step)
        is_train = any(k.startswith(("train/", "throughput/")) for k in m)
        clock = m.get("time/elapsed_s")
        timed = not self.total_steps and "train/progress" in m  # a wall-clock budget
        eta = eta_s(m.get("train/progress"), clock) if is_train else None  # the trainer's clock, as the cost
        if self.tty and is_train:
            if self._progress is None:
                self._start_bar(timed)
            self._progress.update(self._task, completed=self._completed(step, m),
                                  stats=" | ".join(train_summary(m, self.total_tokens, eta)), eta=format_eta(eta),
                                  refresh=True)  # drawn now (a log step is rare enough), not at the next tick
        if is_train and self._plain_line_due(step, last=timed and m["train/progress"] >= 1.0):
            self._printed = step
            head = f"step {step}/{self.total_steps}" if self.total_steps else \
                f"step {step} ({100 * m['train/progress']:.0f}% of the time)" if timed else f"step {step}"
            parts = [head, *train_summary(m, self.total_tokens, eta)]
            if self.total_steps or timed:
                parts.append(f"ETA {format_eta(eta)}")
            self._println(" | ".join(parts))
        evals = eval_summary(m)
        if evals:
            self._println(" | ".join([f"eval step {step}", *evals]))

    def _plain_line_due(self, step: int, last: bool = False) -> bool:
        """The first step logged, the last one (``last``: a wall-clock budget's, which has no step
        count), and the first logged at or past each multiple of log_every. Not only steps that
        are multiples of it: the trainer logs every `log_interval` steps, and a log_interval of 5
        against a log_every of 2 would otherwise print only every 10th step (30 against 50: every 150th)."""
        if self._printed is None or step == self.total_steps or last:
            return True
        return step // self.log_every > self._printed // self.log_every

    def log_text(self, key: str, text: str, step: int) -> None:
        self._println(f"--- {key} at step {step} ---\n{text.rstrip()}\n---")

    def finish(self, status: str = "completed", error: str | None = None) -> None:
        if self._progress is not None:
            self._progress.stop()  # stops the refresh thread and leaves the last frame
            self._progress = None
        if status != "completed":
            self._println(f"run {self.run_name + ' ' if self.run_name else ''}{status}")
