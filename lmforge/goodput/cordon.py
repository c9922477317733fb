"""The run's cordon list: the nodes a condition or a diagnostic sweep excluded, kept with the run.

``<save_folder>/cordon.json`` holds ``{"nodes": {name: {"reason", "time", "step"}}}``; node names
are `process.node_name` (``$LMFORGE_NODE``, else the host name). What reads it:

- the ranks, when the run stopped to resume on fewer nodes: the layout it resumes on (`resume_layout`),
  which node 0's supervisor restarts with and every other node left rejoins;
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


def resume_layout(node_ranks: dict[str, int], cordoned: list[str], *, min_nodes: int, too_few_nodes: str) -> dict:
    """Where the run resumes after a goodput action, decided by its ranks (the same on each) and read
    by every node's `lmforge train`: node 0's supervisor restarts with ``nodes``, every other node
    left rejoins the rendezvous with ``nodes`` and its new node rank.

    ``node_ranks``: each node of the stopped attempt → its node rank. Returns ``{"nodes": N,
    "node_ranks": {node: rank}}`` — the nodes left, renumbered in their order (node 0 stays 0) — or
    ``{"nodes": 0, "stop": why}`` when the run stops with its checkpoint: node 0 is cordoned (it runs
    the supervisor and hosts the rendezvous: docs/goodput.md), or fewer than ``min_nodes`` are left
    and ``too_few_nodes`` is stop. With ``wait``, the run asks for as many nodes as before: the
    rendezvous waits for replacements, which join with the node ranks after the nodes left."""
    gone = set(cordoned)
    left = sorted((r, n) for n, r in node_ranks.items() if n not in gone)
    head = next((n for n, r in node_ranks.items() if r == 0), None)
    if head in gone:
        return {"nodes": 0, "stop": f"node 0 ({head}) is cordoned: it runs the supervisor and hosts the "
                                    "rendezvous; start the run again without it (lmforge launch slurm|k8s keeps "
                                    "cordoned nodes out)"}
    nodes = len(left)
    if nodes < min_nodes:
        if too_few_nodes != "wait":
            return {"nodes": 0, "stop": f"{nodes} node(s) left after cordoning {', '.join(sorted(gone))}, fewer than "
                                        f"goodput.min_nodes ({min_nodes}); the run stops with its checkpoint"}
        nodes = len(node_ranks)  # the rendezvous waits (compute.rdzv_timeout_s) for replacements to join
    return {"nodes": nodes, "node_ranks": {n: i for i, (_, n) in enumerate(left)}}
