"""The run's cordon list: the nodes a condition or a diagnostic sweep excluded, kept with the run.

``<save_folder>/cordon.json`` holds ``{"nodes": {name: {"reason", "time", "step"}}}``; node names
are `process.node_name` (``$LMFORGE_NODE``, else the host name). What reads it:

- the supervisor, when the run stopped to resume on fewer nodes: the node count it restarts with;
- a node's ``lmforge train`` on a cordoned node: it refuses to join, with the reason;
- ``lmforge launch slurm``: ``#SBATCH --exclude=…``; ``lmforge launch k8s``: a node affinity
  that keeps the pods off those Kubernetes nodes.
"""

from __future__ import annotations

import json
import os
import time

CORDON_FILE = "cordon.json"
K8S_HOST_LABEL = "kubernetes.io/hostname"


def read_cordon(save_folder: str | None) -> dict[str, dict]:
    """node → {"reason", "time", "step"} ({} without a list, or one that cannot be read)."""
    if not save_folder:
        return {}
    try:
        with open(os.path.join(save_folder, CORDON_FILE)) as f:
            nodes = json.load(f).get("nodes")
    except (OSError, ValueError, AttributeError):
        return {}
    return nodes if isinstance(nodes, dict) else {}


def add_to_cordon(save_folder: str, nodes: dict[str, str], step: int) -> dict[str, dict]:
    """Add ``nodes`` (name → reason) to the list; returns the whole list."""
    current = read_cordon(save_folder)
    for name, reason in nodes.items():
        current[name] = {"reason": reason, "time": round(time.time(), 3), "step": step}
    os.makedirs(save_folder, exist_ok=True)
    tmp = os.path.join(save_folder, CORDON_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"nodes": current}, f, indent=1)
    os.replace(tmp, os.path.join(save_folder, CORDON_FILE))
    return current


def slurm_exclude(nodes: dict[str, dict]) -> list[str]:
    """The sbatch lines that keep a job off the cordoned nodes."""
    return [f"#SBATCH --exclude={','.join(sorted(nodes))}"] if nodes else []


def k8s_affinity(nodes: dict[str, dict]) -> dict:
    """A pod's `affinity` that keeps it off the cordoned Kubernetes nodes ({} without any)."""
    if not nodes:
        return {}
    term = {"matchExpressions": [{"key": K8S_HOST_LABEL, "operator": "NotIn", "values": sorted(nodes)}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


def nodes_left(nodes: int, cordoned_now: list[str]) -> int:
    """How many nodes a run of ``nodes`` resumes on after the nodes just cordoned leave."""
    return nodes - len(set(cordoned_now))
