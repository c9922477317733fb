"""`lmforge scaling run -f ladder.yaml` and `lmforge scaling show DIR`: scaling-law ladders
(docs/scaling.md)."""

from __future__ import annotations

import json
import os

from lmforge.cli.common import OneLineParser, add_command


def register(sub) -> None:
    group = add_command(sub, "scaling", "scaling-law ladders: small runs that predict a big one",
                        "Train a ladder of small models, fit Chinchilla's L(N, D) = E + A/N^α + B/D^β to their "
                        "held-out losses, and predict the target run's loss (with an interval) and the "
                        "compute-optimal size for its budget. See docs/scaling.md.")
    s = group.add_subparsers(dest="scaling_command", metavar="COMMAND", parser_class=OneLineParser)
    p = add_command(s, "run", "plan and train a ladder, fit the law, predict the target",
                    "Plans the ladder's runs within `budget` (measuring this machine's speed first), trains "
                    "them as ordinary registered runs (`lmforge runs list` shows them), fits the law and writes "
                    "prediction.json, target.yaml and report.html into the ladder's save_folder. Re-running the "
                    "same command skips completed runs and resumes unfinished ones.")
    p.add_argument("-f", "--file", metavar="YAML", required=True, help="ladder file (see docs/scaling.md)")
    p.add_argument("--budget", metavar="DUR", help="override `budget`: this machine's time (6min, 2h) or FLOPs (3e14flop)")
    p.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override any key of the ladder file, e.g. --set ladder.parallel=1 or --set "
                   "target.tokens=2M (repeatable; a re-run continues the ladder only with the same overrides)")
    p.add_argument("--dry-run", action="store_true", help="measure and plan, print the plan; train nothing")
    p.add_argument("--detach", action="store_true",
                   help="run the ladder in the background (output in <save_folder>/ladder.log) and return")
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    p.set_defaults(func=_run)
    p = add_command(s, "show", "a ladder's runs, law and prediction",
                    "Prints the ladder's runs (with the status of those still going), the fitted law, the "
                    "prediction and its warnings, and the target's actual loss once target.yaml has been trained.")
    p.add_argument("dir", metavar="DIR", help="the ladder's save_folder")
    p.add_argument("--json", action="store_true", help="print the prediction (or the plan) as JSON")
    p.set_defaults(func=_show)
    group.set_defaults(func=lambda args: (group.print_help(), 2)[1])


def _run(args) -> int:
    from lmforge.scaling.config import load_ladder

    cfg = load_ladder(args.file, args.set, args.budget)
    if args.detach:
        from lmforge.runs.ladder import LOG_FILE, LadderLock, detach, existing_plan

        existing_plan(cfg)  # a changed ladder file is refused here, not in the background's log
        LadderLock.probe(cfg.save_folder)  # as is a ladder another driver is running
        overrides = [a for item in args.set for a in ("--set", item)] + (["--budget", args.budget] if args.budget else [])
        pid = detach(args.file, cfg.save_folder, overrides)
        print(f"ladder {cfg.name} running in the background (pid {pid}); output: "
              f"{os.path.join(cfg.save_folder, LOG_FILE)}; progress: lmforge scaling show {cfg.save_folder}")
        return 0
    from lmforge.runs.ladder import format_plan, load_or_make_plan, run_ladder

    if args.dry_run:
        print(format_plan(load_or_make_plan(cfg, write=False)))
        return 0
    pred = run_ladder(cfg)
    _print(pred, cfg.save_folder, args.json)
    return 0


def _print(pred: dict, folder: str, as_json: bool) -> None:
    from lmforge.scaling.summary import format_prediction, format_runs

    if as_json:
        print(json.dumps(pred, indent=1, default=float))
        return
    print("\n".join(format_runs(pred["runs"]) + format_prediction(pred, pred["target"].get("actual"))))
    print(f"files: {os.path.join(folder, 'prediction.json')}, {os.path.join(folder, 'report.html')}")
    if pred["target"].get("actual") is None:
        print(f"next: lmforge train -f {os.path.join(folder, 'target.yaml')}   (then `lmforge scaling show {folder}` "
              "compares)")


def _show(args) -> int:
    from lmforge.runs.ladder import read_ladder, record_target, results, target_actual
    from lmforge.scaling.summary import format_prediction, format_runs

    plan, pred = read_ladder(args.dir)
    if pred is not None:  # a target trained since (without the supervisor that records it): recorded now
        line = record_target(pred["target"].get("save_folder") or os.path.join(args.dir, "target"))
        if line:
            print(line)
            plan, pred = read_ladder(args.dir)
    runs = results(args.dir, plan)
    if args.json:
        print(json.dumps(pred if pred is not None else {"plan": plan.to_dict(), "runs": runs}, indent=1,
                         default=float))
        return 0
    done = sum(r["status"] == "completed" for r in runs)
    print(f"ladder {plan.name} ({os.path.abspath(args.dir)}): {done} of {len(runs)} runs completed")
    if pred is None:
        print("\n".join(format_runs(runs)))
        print("not fitted yet: the fit follows the last run of `lmforge scaling run`")
        return 0
    fitted = {r["label"]: r for r in pred["runs"]}
    merged = [fitted.get(r["label"], {}) | {k: v for k, v in r.items() if v is not None} for r in runs]
    actual = target_actual(pred["target"].get("save_folder") or os.path.join(args.dir, "target"))
    print("\n".join(format_runs(merged) + format_prediction(pred, actual)))
    return 0
