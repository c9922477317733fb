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
signal instead of a traceback, and that, given ``--status-file`` (a run without a supervisor), it
ends the ranks at a failure that this node's first rank reported there as not to be retried (bad
input), with the rank's own exit status, where torchrun would restart them (the supervisor does
the same for its runs).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import warnings

from lmforge.config.schema import parse_endpoint
from lmforge.errors import UserError
from lmforge.process import name_process, node_name, process_alive, read_status

# A rank forked from the fork server runs this module again as multiprocessing's `__mp_main__` (it is the
# agent's __main__), after the server imported it by its name: runpy warns of the second copy, harmlessly.
warnings.filterwarnings("ignore", message=r"'lmforge\.distributed\.torchrun' found in sys\.modules",
                        category=RuntimeWarning)

STATUS_FLAG = "--status-file"
REJOIN_FLAG = "--rejoin"
EVENTS_FLAG = "--events-file"
PRELOAD_FLAG = "--forkserver-preload"
FORKSERVER_AT = "LMFORGE_FORKSERVER_AT"  # when this node's fork server started (`process.attempt_started_at`)
_WORKER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")


# Device files a GPU torch can drive: NVIDIA's driver, or ROCm's (which torch also calls "cuda").
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd")


def resolve_device_kind(kind: str) -> str:
    if kind != "auto":
        return kind
    if not any(os.path.exists(f) for f in GPU_DEVICE_FILES):
        return "cpu"  # no GPU driver: torch would say the same, without a second of importing it here
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
    try:
        return parse_endpoint(endpoint)
    except ValueError as e:
        raise UserError(f"compute.rdzv_endpoint: {e}") from None


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
    """The planner's checks that need only sizes (`plan.checks.check_launch`): fail before any process starts."""
    from lmforge.plan.checks import check_launch

    check_launch(cfg, nproc * cfg.compute.nodes, device_type=resolve_device_kind(cfg.compute.device))
    cfg.compute.check_nodes()


def torchrun_command(cfg, nproc: int, argv: list[str], *, max_restarts: int, status_file: str | None = None,
                     rejoin: list[str] | None = None, events_file: str | None = None,
                     preload: tuple[str, ...] = ()) -> list[str]:
    """The torchrun command for ``nproc`` ranks of ``argv``; ``status_file``: where this node's first
    rank reports (`process.speaks_for_node`; the wrapper watches it, and removes it at the end);
    ``rejoin``: a node other than node 0, the `lmforge` arguments it rejoins with after a goodput
    action (`rejoin`); ``events_file``: where the wrapper records a rank it saw fail (``rank_failed``:
    the supervisor names the cause from it, whichever node it was on); ``preload``: the modules a rank
    imports, imported once per node by a fork server the ranks are forked from (`agent_main`)."""
    c = cfg.compute
    cmd = [sys.executable, "-m", "lmforge.distributed.torchrun"]
    if status_file:
        cmd.append(f"{STATUS_FLAG}={status_file}")
    if events_file:
        cmd.append(f"{EVENTS_FLAG}={events_file}")
    if preload:
        cmd.append(f"{PRELOAD_FLAG}={','.join(preload)}")
    if rejoin is not None:
        cmd.append(f"{REJOIN_FLAG}=" + json.dumps({"argv": rejoin, "endpoint": c.rdzv_endpoint,
                                                   "timeout_s": c.rdzv_timeout_s}, separators=(",", ":")))
    cmd += [f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}"]
    if c.nodes == 1:
        cmd.append("--standalone")
    else:  # (check_world has validated the endpoint and node rank)
        # No --node-rank: the c10d rendezvous ignores it (with a warning on every start) and
        # orders the nodes itself (by host name), so rank 0 may be on any node.
        cmd += [f"--nnodes={c.nodes}", "--rdzv-backend=c10d",
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
    "Sending process … closing signal SIGTERM", "Closing process … via signal SIGTERM"): a stop, or the rank's own one-line error, has
    already said why; its other warnings (restarts, failures) pass — but not its error line about
    a rank that failed (its exit code) when that rank reported a final failure (``status_file``),
    whose own line says what was wrong."""

    def __init__(self, status_file: str | None = None, events_file: str | None = None):
        super().__init__()
        self.status_file, self.events_file = status_file, events_file

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if "death signal" in msg or "closing signal" in msg or "Terminating process" in msg or (
                msg.startswith("Closing process") and "via signal" in msg):  # its processes' context
            return False
        if m := _WORKER_FAILED.search(msg):  # one line per rank that failed: no traceback of torchrun's own
            record.exc_info, record.exc_text = None, None
            if self.events_file:
                from lmforge.distributed.elastic import append_event

                with contextlib.suppress(OSError):
                    append_event(os.path.dirname(self.events_file) or ".", {
                        "event": "rank_failed", "node": node_name(), "local_rank": int(m.group(2)),
                        "exit_code": int(m.group(1)), "pid": int(m.group(3))})
        return not (self.status_file and "failed (exitcode" in msg
                    and read_status(self.status_file).get("status") == "failed")


class _StopAtFinalFailure:
    """Watches the status file of this node's first rank: at a failure it reported as final
    (status "failed": bad input, or a run that diverged), stop torchrun — a SIGTERM to this
    process, which torchrun turns into stopping its ranks — before ``--max-restarts`` repeats the
    same failure and torchrun ends in a ChildFailedError traceback. ``exit_code`` is the rank's.
    The rank prints its error line, reports, and exits: the stop waits for that process to end,
    so that nothing it still writes is cut off. At a goodput action (status "reshape") torchrun
    only ends: its noise is silenced, and ``stderr`` keeps the real one for what follows (`rejoin`)."""

    def __init__(self, path: str, poll_s: float = 0.1, exit_wait_s: float = 30.0):
        self.path, self.poll_s, self.exit_wait_s, self.exit_code = path, poll_s, exit_wait_s, None
        self.stderr: int | None = None  # the silenced stderr, duplicated
        threading.Thread(target=self._watch, name="lmforge-status", daemon=True).start()

    def _watch(self) -> None:
        while (status := read_status(self.path)).get("status") not in ("failed", "reshape"):
            time.sleep(self.poll_s)
        # From here on torchrun only stops, and what it says is noise: with several nodes, a
        # node that stopped first takes the rendezvous store with it, and the others' torchrun
        # prints the lost connection (C++ warnings, a traceback). The ranks keep their own stderr.
        self.stderr = _silence_stderr()
        if status.get("status") == "reshape":
            return
        deadline = time.monotonic() + self.exit_wait_s
        while process_alive(status.get("pid"), None) and time.monotonic() < deadline:  # (a zombie is not)
            time.sleep(self.poll_s)
        self.exit_code = int(status.get("exit_code") or 1)
        os.kill(os.getpid(), signal.SIGTERM)


def _silence_stderr() -> int:
    """Sends this process's stderr to /dev/null; returns a duplicate of what it was."""
    sys.stderr.flush()
    kept = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    return kept


def _pop_flag(argv: list[str], flag: str) -> str | None:
    """The value of the wrapper's own ``flag=VALUE`` at the head of ``argv`` (removed), or None."""
    if argv and argv[0].startswith(flag + "="):
        return argv.pop(0).split("=", 1)[1]
    return None


def start_fork_server(modules: list[str]) -> None:
    """A process that imports ``modules`` (torch and lmforge's trainer: seconds) once, now — beside
    torchrun's own start and rendezvous — and forks this node's ranks from then on: the first start pays
    the imports once per node instead of once per rank, and a restart (torchrun's, after a rank failed)
    pays none. (multiprocessing's fork server: a single-threaded process, safe to fork from.)"""
    import multiprocessing.forkserver as forkserver

    os.environ[FORKSERVER_AT] = f"{time.time():.3f}"  # (the server, and so every rank it forks, inherits it)
    os.environ["LMFORGE_FORKSERVER_PARENT"] = str(os.getpid())
    forkserver.set_forkserver_preload(["lmforge.distributed.fork_server", *modules])  # (first: it dies with us)
    forkserver.ensure_running()


def run_module(module: str, *argv: str) -> None:
    """A rank forked from the fork server: ``python -m module argv`` in this process. Like a rank
    torchrun starts as a program, it leads a session of its own (its data workers in it; the hang
    watchdog finds its peers so), and its output is line-buffered; `ps` shows it as
    ``lmforge-r<RANK>.<restart>`` (its command line is the server's)."""
    import runpy

    os.setsid()
    name_process(f"lmforge-r{os.environ.get('RANK', '?')}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True)
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _launch(argv: list[str], forked: bool) -> None:
    """torchrun's `run` for ``argv``; ``forked``: the ranks are `run_module` forked from the fork server
    (started by `start_fork_server`) instead of new Python processes."""
    import uuid

    from torch.distributed.run import config_from_args, elastic_launch, parse_args

    args = parse_args(argv)
    if args.standalone:  # (as torchrun's own `run` does)
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, cmd, cmd_args = config_from_args(args)
    if forked:
        from lmforge.distributed import torchrun as named  # (this module runs as __main__: pickled by its name)

        config.start_method = "forkserver"
        cmd, cmd_args = named.run_module, [args.training_script, *args.training_script_args]
    elastic_launch(config=config, entrypoint=cmd)(*cmd_args)


def agent_main(argv: list[str]) -> int:
    """torchrun, quiet when stopped (its ranks checkpoint and exit; then it does too); on a node other
    than node 0, after a goodput action, the node rejoins the resumed run (`rejoin`). With
    ``--forkserver-preload`` the ranks are forked from a fork server (`start_fork_server`)."""
    status_file = _pop_flag(argv, STATUS_FLAG)
    events_file = _pop_flag(argv, EVENTS_FLAG)
    preload = _pop_flag(argv, PRELOAD_FLAG)
    rejoin_with = _pop_flag(argv, REJOIN_FLAG)
    if preload:
        start_fork_server(preload.split(","))
    from torch.distributed.elastic.multiprocessing.api import SignalException

    # Each rendezvous round gets the ranks a store of its own (hosted by rank 0), not the store torchrun
    # shares across rounds: there, keys of the last round's ranks outlive them, and after a rank died on
    # one node of several, the restarted ranks read a dead peer's address (gloo: "connectFullMesh
    # failed ... Connection refused") until no restart is left (pytorch/pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api",
                 "torch.multiprocessing.spawn"):
        logging.getLogger(name).addFilter(_QuietShutdown(status_file, events_file))
    watcher = _StopAtFinalFailure(status_file) if status_file else None
    final: dict = {}
    try:
        try:
            _launch(argv, forked=bool(preload))
        except Exception:  # noqa: BLE001 - e.g. ChildFailedError: no restart left (max_retries: 0) before
            # the watcher saw the report; or the rendezvous lost: another node, stopped first, hosted it
            if isinstance(sys.exc_info()[1], SignalException):
                raise
            final = read_status(status_file) if status_file else {}
            if final.get("status") != "failed":
                raise
            return int(final.get("exit_code") or 1)
        final = read_status(status_file) if status_file else {}
    except SignalException as e:
        # A stop: the user's, or the watcher's at a reported failure — which can also land while
        # torchrun's own end (a ChildFailedError) is being handled above, hence out here.
        if watcher is not None and watcher.exit_code is not None:
            return watcher.exit_code  # the rank has printed why
        final = read_status(status_file) if status_file else {}
        if final.get("status") == "failed":
            return int(final.get("exit_code") or 1)
        return 128 + int(e.sigval)
    finally:
        # Decided: a stop from here on (the watcher's, arriving late) must not turn the exit code
        # into an uncaught SignalException's 1.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if status_file:
            with contextlib.suppress(OSError):
                os.remove(status_file)
    if final.get("status") == "reshape" and watcher is not None and watcher.stderr is not None:
        os.dup2(watcher.stderr, 2)  # torchrun's end is over: what follows is ours
    if rejoin_with and final.get("status") == "reshape":
        rejoin(final, json.loads(rejoin_with))
    return 0


def rejoin(status: dict, how: dict) -> None:
    """A node other than node 0 after a goodput action stopped the run (its ranks' ``status``, with
    the layout they decided, `goodput.cordon.resume_layout`): a node left becomes `lmforge train`
    again (exec: the same process) with the new node count and its node rank, and joins the
    rendezvous node 0's supervisor starts; a cordoned node, or every node when the run stops, says
    why it leaves. First it waits for the stopped attempt's rendezvous to close (its host, node 0's
    torchrun, exits after the ranks): a join before that would land in the old one. Should the new one
    be up before this looks (it is not: node 0 restarts through two process starts), the wait ends
    at the rendezvous timeout and the node joins it all the same."""
    me = node_name()
    rank = (status.get("node_ranks") or {}).get(me)
    if rank is None:
        why = "it is cordoned" if me in (status.get("cordon") or []) else status.get("stop") or "the run stops"
        print(f"lmforge: this node ({me}) leaves the run: {why}", flush=True)
        return
    host, port = split_endpoint(how["endpoint"])
    deadline = time.monotonic() + float(how["timeout_s"])
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
        except OSError:
            break
        time.sleep(0.05)
    print(f"lmforge: this node ({me}) rejoins the run on {status['nodes']} node(s) as node {rank}", flush=True)
    sys.stderr.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (an ignored signal stays ignored across exec)
    os.execv(sys.executable, [sys.executable, "-m", "lmforge", *how["argv"], "--nnodes", str(status["nodes"]),
                              "--node-rank", str(rank)])


def exit_now(code: int) -> None:
    """End a launcher process whose work is done without the interpreter's teardown of torch
    (about a second of CPU): a stop is over only when every process of the run has exited."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(agent_main(sys.argv[1:]))
