"""Starting the ranks: `lmforge train` re-launches itself through torchrun when a run needs several.

- one machine, several GPUs: one rank per GPU (or ``compute.gpus``), NCCL;
- CPU, ``compute.ranks: N``: N gloo ranks (for tests and users without GPUs);
- several machines: ``compute.nodes``/``node_rank``/``rdzv_endpoint`` (or ``--nnodes``,
  ``--node-rank``, ``--rdzv-endpoint``) → torchrun's c10d rendezvous, one ``lmforge train`` per node;
- restarts: torchelastic restarts every worker after a failure (``--max-restarts``: what is left
  of ``max_retries``, see ``runs.supervisor``) and they autoresume from the latest complete checkpoint.

The process that needs torchrun becomes it (``runs.job.launch`` execs the command built here):
``python -m lmforge.distributed.torchrun`` is torchrun (``torch.distributed.run``), except that a
stop — SIGTERM or SIGINT, which torchrun passes on to every rank — ends it with status 128 + the
signal instead of a traceback.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time

from lmforge.errors import UserError


def resolve_device_kind(kind: str) -> str:
    if kind != "auto":
        return kind
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def procs_per_node(compute) -> int:
    """How many ranks this node runs; raises UserError for more GPUs than present."""
    if resolve_device_kind(compute.device) == "cuda":
        import torch

        present = torch.cuda.device_count()
        if compute.gpus == "auto":
            if present == 0:
                raise UserError("compute.device: cuda was asked for but no CUDA GPU is visible")
            return present
        if compute.gpus > present:
            raise UserError(f"compute.gpus: {compute.gpus} GPUs requested but only {present} present on this node")
        return compute.gpus
    return compute.ranks or 1


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UserError(f"compute.rdzv_endpoint: {endpoint!r} is not HOST:PORT (e.g. node0.cluster:29500)")
    return host, int(port)


def wait_for_endpoint(endpoint: str, timeout_s: float) -> None:
    """Nodes other than node 0 wait for the rendezvous to be reachable; a clear error, not a hang."""
    host, port = split_endpoint(endpoint)
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, timeout_s)):
                return
        except OSError as e:
            last = e
            time.sleep(0.5)
    raise UserError(f"compute.rdzv_endpoint: cannot reach the rendezvous at {endpoint} after {timeout_s:.0f}s "
                    f"({last.strerror if isinstance(last, OSError) and last.strerror else last}); start node 0 "
                    "first and check the host, port and firewall (compute.rdzv_timeout_s sets the wait)")


def check_world(cfg, nproc: int) -> None:
    """Mesh checks that need only sizes: fail before any process starts."""
    from lmforge.distributed.parallelize import check_mesh

    n_experts = 0 if cfg.model == "auto" else cfg.model.n_experts  # model: auto chooses a dense shape
    check_mesh(cfg.compute, nproc * cfg.compute.nodes, nproc, n_experts=n_experts)
    c = cfg.compute
    if c.nodes > 1:
        if not c.rdzv_endpoint:
            raise UserError(f"compute.nodes: {c.nodes} nodes need compute.rdzv_endpoint (HOST:PORT of node 0), "
                            "e.g. --rdzv-endpoint node0:29500")
        if c.node_rank >= c.nodes:
            raise UserError(f"compute.node_rank: {c.node_rank} is not below compute.nodes ({c.nodes})")
        split_endpoint(c.rdzv_endpoint)


def torchrun_command(cfg, nproc: int, argv: list[str], *, max_restarts: int) -> list[str]:
    c = cfg.compute
    cmd = [sys.executable, "-m", "lmforge.distributed.torchrun", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}"]
    if c.nodes == 1:
        cmd.append("--standalone")
    else:  # (check_world has validated the endpoint and node rank)
        cmd += [f"--nnodes={c.nodes}", f"--node-rank={c.node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={c.rdzv_endpoint}", f"--rdzv-id={cfg.name or 'lmforge'}",
                f"--rdzv-conf=join_timeout={c.rdzv_timeout_s}"]
    return cmd + ["-m", "lmforge", *argv]


def needs_launch(cfg) -> int | None:
    """Ranks per node when this command must start torchrun, else None (run in this process)."""
    if "WORLD_SIZE" in os.environ:  # already a torchrun worker
        return None
    nproc = procs_per_node(cfg.compute)
    check_world(cfg, nproc)
    if nproc == 1 and cfg.compute.nodes == 1:
        return None
    return nproc


class _QuietShutdown(logging.Filter):
    """Drops torchrun's warnings that it is stopping its workers ("Received 15 death signal",
    "Sending process … closing signal SIGTERM"): a stop, or the rank's own one-line error, has
    already said why; its other warnings (restarts, failures) pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return "death signal" not in msg and "closing signal" not in msg


def agent_main(argv: list[str]) -> int:
    """torchrun, quiet when stopped (its ranks checkpoint and exit; then it does too)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main

    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(_QuietShutdown())
    try:
        main(argv)
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


def exit_now(code: int) -> None:
    """End a launcher process whose work is done without the interpreter's teardown of torch
    (about a second of CPU): a stop is over only when every process of the run has exited."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(agent_main(sys.argv[1:]))
