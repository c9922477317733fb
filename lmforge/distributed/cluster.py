"""Job files for clusters: a SLURM sbatch script and a Kubeflow PyTorchJob manifest.

Both start one `lmforge train` per node; each of those starts torchrun for its GPUs and joins
the c10d rendezvous on the first node (see ``lmforge.distributed.torchrun``). Nothing here
submits anything: the files are written and the user submits them.
"""

from __future__ import annotations

import re
import shlex

import yaml

from lmforge.goodput.cordon import k8s_affinity, slurm_exclude
from lmforge.process import NODE_ENV

RDZV_PORT = 29500

# The first comment of each job file: `lmforge launch` replaces such a file, nothing else.
SLURM_MARK = "# Written by `lmforge launch slurm`"
K8S_MARK = "# Written by `lmforge launch k8s`"


def _train_args(config_path: str, gpus_per_node: int, nodes: int, sets: list[str]) -> list[str]:
    args = ["train", "-f", config_path, "--nnodes", str(nodes), "--set", f"compute.gpus={gpus_per_node}"]
    for s in sets:
        args += ["--set", s]
    return args


def sbatch_script(*, name: str, config_path: str, nodes: int, gpus_per_node: int, python: str,
                  partition: str | None = None, time: str | None = None, sets: list[str] = (),
                  port: int = RDZV_PORT, cordoned: dict | None = None) -> str:
    """One task per node (srun); the first node of the allocation hosts the rendezvous; the run's
    cordoned nodes (`goodput.cordon`) are excluded."""
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={name}",
             f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1",
             f"#SBATCH --gpus-per-node={gpus_per_node}",
             "#SBATCH --output=%x-%j.out"]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if time:
        lines.append(f"#SBATCH --time={time}")
    lines += slurm_exclude(cordoned or {})
    train = " ".join(shlex.quote(a) for a in [python, "-m", "lmforge", *_train_args(config_path, gpus_per_node,
                                                                                       nodes, list(sets))])
    lines += [
        f"{SLURM_MARK}. Submit with: sbatch <this file>",
        "set -euo pipefail",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f'export LMFORGE_RDZV_ENDPOINT="$head_node:{port}"',
        "# One `lmforge train` per node; each starts torchrun for its GPUs (restarts: max_retries).",
        "srun --kill-on-bad-exit=1 bash -c "
        + shlex.quote(f'exec {train} --node-rank "$SLURM_NODEID" --rdzv-endpoint "$LMFORGE_RDZV_ENDPOINT"'),
        "",
    ]
    return "\n".join(lines)


def k8s_name(name: str) -> str:
    """A DNS-1123 name (lowercase letters, digits and '-')."""
    out = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    return (out or "lmforge")[:50].rstrip("-")


def pytorchjob_manifest(*, name: str, config_text: str, nodes: int, gpus_per_node: int, image: str,
                        namespace: str | None = None, sets: list[str] = (), cordoned: dict | None = None) -> str:
    """A ConfigMap holding the run config and a PyTorchJob (kubeflow.org/v1) with one pod per node.

    The training operator sets RANK (the pod's index), MASTER_ADDR and MASTER_PORT in every
    pod; they become --node-rank and --rdzv-endpoint. WORLD_SIZE/RANK are then unset so that
    `lmforge train` starts torchrun itself instead of taking the pod for a worker. Each pod names
    itself by its Kubernetes node (``LMFORGE_NODE``, what a cordon list holds), and a node affinity
    keeps the pods off the run's cordoned nodes.
    """
    kname = k8s_name(name)
    meta = {"name": kname} | ({"namespace": namespace} if namespace else {})
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{kname}-config"} | (
        {"namespace": namespace} if namespace else {}), "data": {"run.yaml": config_text}}
    train = " ".join(shlex.quote(a) for a in ["lmforge", *_train_args("/etc/lmforge/run.yaml", gpus_per_node,
                                                                        nodes, list(sets))])
    script = ('NODE_RANK="$RANK"; ENDPOINT="$MASTER_ADDR:$MASTER_PORT"; unset WORLD_SIZE RANK LOCAL_RANK; '
              f'exec {train} --node-rank "$NODE_RANK" --rdzv-endpoint "$ENDPOINT"')

    def replica(count: int) -> dict:
        spec = {"affinity": k8s_affinity(cordoned or {})} if cordoned else {}
        return {"replicas": count, "restartPolicy": "OnFailure", "template": {"spec": spec | {
            "containers": [{"name": "pytorch", "image": image, "command": ["bash", "-c", script],
                            "env": [{"name": NODE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
                            "resources": {"limits": {"nvidia.com/gpu": gpus_per_node}},
                            "volumeMounts": [{"name": "config", "mountPath": "/etc/lmforge"},
                                             {"name": "dshm", "mountPath": "/dev/shm"}]}],
            "volumes": [{"name": "config", "configMap": {"name": f"{kname}-config"}},
                        # NCCL and DataLoader workers need more shared memory than the 64 MB default.
                        {"name": "dshm", "emptyDir": {"medium": "Memory"}}]}}}

    specs = {"Master": replica(1)}
    if nodes > 1:
        specs["Worker"] = replica(nodes - 1)
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": meta,
           "spec": {"pytorchReplicaSpecs": specs}}
    return f"{K8S_MARK}. Apply with: kubectl apply -f <this file>\n" + yaml.safe_dump_all([config_map, job],
                                                                                      sort_keys=False)
