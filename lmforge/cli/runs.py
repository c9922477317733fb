"""`lmforge runs list | describe | logs | stop | delete | restart | compare`: the run registry."""

from __future__ import annotations

import json
import os
import sys
import time

from lmforge.cli.common import add_command, bounded
from lmforge.errors import UserError
from lmforge.runs.run import get_run, get_runs
from lmforge.config.counts import human
from lmforge.tracking.console import format_eta


def register(sub) -> None:
    p = add_command(sub, "runs", "list, follow, stop, delete and restart training runs",
                    description="Runs started by `lmforge train` (foreground or --detach) are kept in "
                    "$LMFORGE_HOME/runs.db.")
    rs = p.add_subparsers(dest="runs_command", metavar="ACTION", parser_class=type(p))
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    c = add_command(rs, "list", "a table of runs")
    c.add_argument("--status", help="only runs in this status (e.g. RUNNING, FAILED)")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.set_defaults(func=cmd_list)

    c = add_command(rs, "describe", "config summary, status, resumptions, events, latest metrics, paths")
    c.add_argument("name")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.set_defaults(func=cmd_describe)

    c = add_command(rs, "logs", "print a run's training output")
    c.add_argument("name")
    c.add_argument("-f", "--follow", action="store_true", help="keep printing until the run ends")
    c.add_argument("--resumption", type=bounded(int, 0), metavar="N", help="this resumption instead of the latest")
    c.set_defaults(func=cmd_logs)

    c = add_command(rs, "stop", "stop a run: checkpoint at the next step, then exit")
    c.add_argument("name")
    c.add_argument("--force", action="store_true", help="kill at once (no checkpoint)")
    c.add_argument("--no-wait", action="store_true", help="return without waiting for the run to stop")
    c.add_argument("--timeout", type=bounded(float, 0, 7 * 86400), default=600, help="seconds to wait for the run to stop")
    c.set_defaults(func=cmd_stop)

    c = add_command(rs, "delete", "remove a run from the registry")
    c.add_argument("name")
    c.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    c.add_argument("--force", action="store_true", help="also kill it if it is still active")
    c.add_argument("--purge", action="store_true", help="also delete its local save folder (checkpoints, logs)")
    c.set_defaults(func=cmd_delete)

    c = add_command(rs, "restart", "a new resumption in the background, from the latest checkpoint",
                    description="A new resumption in the background, from the latest checkpoint, with the run's "
                    "recorded command. A run still active, or COMPLETED (it has nothing left to train), is not "
                    "restarted: the command says why in one line and exits with status 2.")
    c.add_argument("name")
    c.set_defaults(func=cmd_restart)

    c = add_command(rs, "compare", "metric and config differences of two runs (the report is the graphical form)",
                    description="A and B are run names or save folders (local or object-store URIs).")
    c.add_argument("a", metavar="A")
    c.add_argument("b", metavar="B")
    c.set_defaults(func=cmd_compare)


# --------------------------------------------------------------------------- formatting

def status_text(run) -> str:
    return f"{run.status} ({run.reason})" if run.status == "FAILED" and run.reason == "lost" else run.status


REASON_WIDTH = 60  # `runs list` shows the start of a failed run's reason; `runs describe` all of it


def reason_text(run) -> str:
    """Why a failed run ended, cut to REASON_WIDTH ("lost" is in its status already)."""
    if run.status != "FAILED" or not run.reason or run.reason == "lost":
        return ""
    line = run.reason.splitlines()[0]
    return line if len(line) <= REASON_WIDTH else line[:REASON_WIDTH - 1] + "…"


def age(t: float | None) -> str:
    if not t:
        return "-"
    s = max(0, time.time() - t)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit}"
    return f"{s:.0f}s"


def progress_text(m: dict) -> str:
    if not m:
        return "-"
    p = m.get("progress")
    step = f"step {m['step']}" if m.get("step") is not None else ""
    return f"{100 * p:.0f}% {step}".strip() if p is not None else step or "-"


def _human(n) -> str:
    return human(n) if n is not None else "-"


def cmd_list(args) -> int:
    runs = get_runs(args.status)
    if args.json:
        print(json.dumps([_summary(r) for r in runs], indent=1, default=str))
        return 0
    if not runs:
        print("no runs" + (f" with status {args.status.upper()}" if args.status else ""))
        return 0
    rows = [("NAME", "TYPE", "STATUS", "MODEL", "PROGRESS", "LOSS", "TOK/S", "AGE", "REASON")]
    for r in runs:
        m = r.latest_metrics
        rows.append((r.name, r.run_type, status_text(r), r.model or "-", progress_text(m),
                     f"{m['loss']:.4f}" if m.get("loss") is not None else "-", _human(m.get("tokens_per_s")),
                     age(r.created_at), reason_text(r)))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())
    return 0


def _summary(run) -> dict:
    d = run.to_dict()
    d.pop("config", None)
    d.pop("events", None)
    return d


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _preference(m: dict) -> str:
    """A preference run's "accuracy 0.95  margin 1.2" (how often, by how much, the chosen answer wins)."""
    if m.get("accuracy") is None:
        return ""
    return f"  accuracy {m['accuracy']:.3f}  margin {m.get('margin', float('nan')):.4g}"


def _reward(m: dict) -> str:
    """A reinforcement learning run's "reward 0.62  flat 12%" (the completions' mean reward; the share of
    groups scored alike, which teach nothing)."""
    if m.get("reward") is None:
        return ""
    flat = f"  flat {100 * m['flat_groups']:.0f}%" if m.get("flat_groups") is not None else ""
    return f"  reward {m['reward']:.3f}{flat}"


def metrics_lines(run) -> list[str]:
    """`runs describe`'s latest metrics: training (with a preference run's accuracy and margin, a
    reinforcement learning run's reward), the last held-out evaluation, the cost."""
    m = run.latest_metrics
    if not m:
        return []
    mfu = f"{100 * m['mfu']:.1f}%" if m.get("mfu") is not None else "-"
    lines = [f"metrics    step {m.get('step')}  tokens {_human(m.get('tokens'))}  loss {m.get('loss', 0):.4f}"
             f"{_preference(m)}{_reward(m)}  {_human(m.get('tokens_per_s'))} tok/s  MFU {mfu}  progress "
             f"{progress_text(m)}  ETA {format_eta(m.get('eta_s')) if not run.is_terminal else '-'}"]
    ev = m.get("eval")
    if ev and ev.get("reward") is not None and ev.get("loss") is None:  # reinforcement learning: greedy completions
        each = "".join(f"  {k.removeprefix('reward/')} {v:.3f}" for k, v in sorted(ev.items())
                       if k.startswith("reward/"))
        lines.append(f"held-out   step {ev.get('step')}  reward {ev['reward']:.3f} (greedy){each}  "
                     f"({int(ev.get('prompts') or 0):,} prompts)")
    if ev and ev.get("loss") is not None:
        extra = "".join(f"  {name} {ev[key]:.4f}" for key, name in (("perplexity", "ppl"), ("bits_per_byte", "bpb"))
                        if ev.get(key) is not None)
        pairs = f"  ({int(ev['pairs']):,} pairs)" if ev.get("pairs") else ""
        rewards = {k.removeprefix("rewards/"): v for k, v in ev.items() if k.startswith("rewards/")}
        lines.append(f"held-out   step {ev.get('step')}  loss {ev['loss']:.4f}{extra}{_preference(rewards)}{pairs}")
    if m.get("cost") is not None:
        from lmforge.plan.cost import format_cost

        line = f"cost       {format_cost(m['cost'])} so far"
        if not run.is_terminal and m.get("cost_to_finish") is not None:
            line += f", ~{format_cost(m['cost_to_finish'])} to finish"
        price = (run.config.get("compute") or {}).get("price_per_gpu_hour")
        if price is not None:
            line += f"  ({format_cost(m.get('cost_per_hour'))} per hour at {price:g} per device-hour)"
        lines.append(line)
    return lines


def cmd_describe(args) -> int:
    run = get_run(args.name)
    if args.json:
        print(json.dumps(run.to_dict() | _goodput(run.save_folder), indent=1, default=str))
        return 0
    cfg = run.config
    print(f"run        {run.name} ({run.run_type})   run_uid {run.run_uid}")
    print(f"status     {run.status}" + (f" — {run.reason}" if run.reason else ""))
    print("lifecycle  " + " → ".join(f"{s['status']} {_when(s['time'])[11:]}" for s in run.lifecycle))
    print(f"model      {run.model}")
    print(f"data       {', '.join(d.get('path', '?') for d in cfg.get('train_data') or [])}")
    print(f"duration   {cfg.get('training_duration')}   max_retries {run.max_retries}   ranks {run.ranks or 1}")
    print(f"created    {_when(run.created_at)}   started {_when(run.started_at)}   "
          f"updated {_when(run.updated_at)}   ended {_when(run.completed_at)}")
    print(f"host       {run.host}   supervisor pid {run.supervisor_pid}   trainer pid {run.child_pid or '-'}")
    print(f"save       {run.save_folder}")
    print(f"logs       {run.log_dir}")
    ckpts = sorted(os.listdir(run.checkpoints_dir)) if os.path.isdir(run.checkpoints_dir) else []
    ckpts = [c for c in ckpts if c.startswith("step_")]
    print(f"checkpoints {', '.join(ckpts) or 'none'} ({run.checkpoints_dir})")
    for line in metrics_lines(run):
        print(line)
    _goodput_lines(run.save_folder)
    print("resumptions")
    for r in run.resumptions:
        code = f" exit {r['exit_code']}" if r["exit_code"] is not None else ""
        why = f" — {r['reason']}" if r["reason"] else ""
        print(f"  {r['idx']}  {r['status']:<10} {_when(r['started_at'])} → {_when(r['ended_at'])}{code}{why}")
        print(f"     log {r['log_path']}")
    print("events")
    for e in run.events:
        first, *rest = (e["message"] or "").splitlines() or [""]
        print(f"  {_when(e['time'])}  {e['type']:<8} {first}")
        for line in rest:
            print(f"  {'':19}  {'':8} {line}")
    return 0


def _goodput(save_folder: str) -> dict:
    """{"goodput": where the wall time went, "cordoned": the nodes cut out} from a local save folder."""
    from lmforge.goodput.cordon import read_cordon
    from lmforge.goodput.ledger import account, read_ledger

    local = save_folder and "://" not in save_folder
    return {"goodput": account(read_ledger(save_folder)) if local else None,
            "cordoned": read_cordon(save_folder) if local else {}}


def _goodput_lines(save_folder: str) -> None:
    from lmforge.goodput.ledger import format_goodput

    found = _goodput(save_folder)
    if found["goodput"] is not None:
        print(f"goodput    {format_goodput(found['goodput'])}")
    for node, why in found["cordoned"].items():
        print(f"cordoned   {node} at step {why.get('step')}: {why.get('reason')}")


def cmd_logs(args) -> int:
    run = get_run(args.name)
    path = run.log_path(args.resumption)
    out = sys.stdout.buffer
    offset = _copy(path, 0, out)
    if not args.follow:
        return 0
    # Follow: the latest resumption's file (a retry starts a new one) until the run ends.
    while True:
        time.sleep(0.5)
        run.refresh()
        offset = _copy(path, offset, out)
        if args.resumption is None and run.resumptions and run.resumptions[-1]["log_path"] != path:
            path = run.resumptions[-1]["log_path"]
            out.write(f"--- resumption {run.resumptions[-1]['idx']} ---\n".encode())
            offset = _copy(path, 0, out)
            continue
        if run.is_terminal:
            _copy(path, offset, out)
            return 0


def _copy(path: str, offset: int, out) -> int:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return offset
    if data:
        out.write(data)
        out.flush()
    return offset + len(data)


def cmd_stop(args) -> int:
    run = get_run(args.name)
    if run.is_terminal:
        print(f"run {run.name} already ended: {status_text(run)}" + (f" ({run.reason})" if run.reason and run.reason != "lost" else "")
              + "; nothing to stop")
        return 0
    try:
        run.stop(force=args.force, wait=not args.no_wait, timeout=args.timeout)
    except TimeoutError:
        raise UserError(f"run {run.name} did not stop within {args.timeout:g}s (still {run.status}); "
                        f"`lmforge runs stop {run.name} --force` kills it") from None
    print(f"run {run.name}: {run.status}" + (f" ({run.reason})" if run.reason else ""))
    return 0


def cmd_delete(args) -> int:
    run = get_run(args.name)
    if not run.is_terminal and not args.force:
        raise UserError(f"run {run.name} is {run.status}; stop it first (`lmforge runs stop {run.name}`) "
                        "or pass --force")
    if not args.yes:
        what = f"run {run.name}" + (f" and delete {run.save_folder}" if args.purge else " from the registry")
        if not sys.stdin.isatty():
            raise UserError(f"delete {run.name}: pass --yes to confirm (no terminal to ask on)")
        if input(f"remove {what}? [y/N] ").strip().lower() not in ("y", "yes"):
            print("not deleted")
            return 1
    run.delete(force=args.force, purge=args.purge)
    print(f"deleted run {run.name}" + (f" and {run.save_folder}" if args.purge else
                                        f" (files kept in {run.save_folder})"))
    return 0


def cmd_restart(args) -> int:
    run = get_run(args.name)
    n = len(run.resumptions)
    run.restart()
    print(f"{run.name}: restarted as resumption {n} ({run.status})")
    return 0


def cmd_compare(args) -> int:
    from lmforge.report.compare import format_compare
    from lmforge.report.load import load_run
    from lmforge.runs.registry import RegistryIndex

    a, b = load_run(args.a, index=RegistryIndex()), load_run(args.b, index=RegistryIndex())
    sys.stdout.write(format_compare(a, b))
    return 0
