"""`lmforge launch slurm|k8s -f run.yaml --nodes N --gpus-per-node G`: write a job file, print how to submit it."""

from __future__ import annotations

import os
import sys

from lmforge.cli.common import OneLineParser, add_command, bounded
from lmforge.guard import check_output_file
from lmforge.config.limits import MAX_NODES
from lmforge.config.load import load_config
from lmforge.distributed.cluster import K8S_MARK, SLURM_MARK, k8s_name, pytorchjob_manifest, sbatch_script
from lmforge.errors import UserError


def register(subparsers) -> None:
    group = add_command(subparsers, "launch", "write a SLURM or Kubernetes job for a multi-node run",
                        "Write a job file that runs `lmforge train` on N nodes × G GPUs (torchrun, c10d "
                        "rendezvous on the first node) and print how to submit it. Nothing is submitted.")
    sub = group.add_subparsers(dest="launch_command", metavar="COMMAND", parser_class=OneLineParser)

    def common(p):
        p.add_argument("-f", "--file", required=True, metavar="YAML", help="run config")
        p.add_argument("--nodes", type=bounded(int, 1, MAX_NODES), required=True, metavar="N", help="number of nodes")
        p.add_argument("--gpus-per-node", type=bounded(int, 1, 1024), required=True, metavar="G", help="GPUs (ranks) per node")
        p.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                       help="config override passed on to `lmforge train` (repeatable)")
        p.add_argument("-o", "--output", metavar="FILE",
                       help="where to write the job file (replaces an earlier job file there, nothing else)")
        p.add_argument("--overwrite", action="store_true",
                       help="replace FILE even if lmforge did not write it (never the config, nor a file of a run)")

    p = add_command(sub, "slurm", "write an sbatch script (srun + torchrun rendezvous)")
    common(p)
    p.add_argument("--partition", help="SLURM partition")
    p.add_argument("--time", help="time limit, e.g. 24:00:00")
    p.set_defaults(func=run_slurm)

    p = add_command(sub, "k8s", "write a Kubeflow PyTorchJob manifest (+ a ConfigMap with the run config)")
    common(p)
    p.add_argument("--image", required=True, help="container image with lmforge installed")
    p.add_argument("--namespace", help="Kubernetes namespace")
    p.set_defaults(func=run_k8s)
    group.set_defaults(func=lambda args: group.print_help() or 2)


def _checked(args):
    """Load the config with the same overrides the job will use, so mistakes show up now."""
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise UserError("launch: --nodes and --gpus-per-node must be at least 1")
    if not os.path.exists(args.file):
        raise UserError(f"launch: config file {args.file} does not exist")
    cfg = load_config(args.file, sets=[*args.set, f"compute.nodes={args.nodes}", f"compute.gpus={args.gpus_per_node}"])
    from lmforge.plan.checks import check_mesh

    check_mesh(cfg.compute, args.nodes * args.gpus_per_node, args.nodes)
    name = cfg.name or os.path.splitext(os.path.basename(args.file))[0]
    return cfg, name


def _cordoned(cfg, name: str) -> dict:
    """The nodes the run (its save folder, here) has cordoned: the job keeps off them."""
    from lmforge.goodput.cordon import read_cordon
    from lmforge.resolve import resolve

    folder = resolve(cfg.model_copy(update={"name": name}), until="config").config.save_folder
    nodes = read_cordon(folder)
    if nodes:
        print(f"cordoned nodes kept out (from {folder}): {', '.join(sorted(nodes))}")
    return nodes


def _write(path: str, text: str, mode: int = 0o644) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def run_slurm(args) -> int:
    cfg, name = _checked(args)
    out = args.output or f"{name}.sbatch"
    check_output_file(out, "-o", args.overwrite, same_kind=lambda head: SLURM_MARK.encode() in head,
                      reads=[("the config", args.file)])
    _write(out, sbatch_script(name=name, config_path=os.path.abspath(args.file), nodes=args.nodes,
                              gpus_per_node=args.gpus_per_node, python=sys.executable, partition=args.partition,
                              time=args.time, sets=args.set, cordoned=_cordoned(cfg, name)), 0o755)
    print(f"wrote {out} ({args.nodes} node(s) × {args.gpus_per_node} GPU(s))")
    print(f"submit with:  sbatch {out}")
    return 0


def run_k8s(args) -> int:
    cfg, name = _checked(args)
    out = args.output or f"{k8s_name(name)}-pytorchjob.yaml"
    check_output_file(out, "-o", args.overwrite, same_kind=lambda head: K8S_MARK.encode() in head,
                      reads=[("the config", args.file)])
    with open(args.file) as f:
        config_text = f.read()
    _write(out, pytorchjob_manifest(name=name, config_text=config_text, nodes=args.nodes,
                                    gpus_per_node=args.gpus_per_node, image=args.image,
                                    namespace=args.namespace, sets=args.set, cordoned=_cordoned(cfg, name)))
    print(f"wrote {out} (PyTorchJob {k8s_name(name)}: {args.nodes} pod(s) × {args.gpus_per_node} GPU(s))")
    print(f"submit with:  kubectl apply -f {out}")
    return 0
