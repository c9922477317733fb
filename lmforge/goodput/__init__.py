"""Goodput, the torch-free part: the rules that keep a big run going and the accounting of its time.

- `conditions`: straggler scores (a rank's own time per step — its sections without a collective —
  over its peers' median), the sections scored on each kind of data parallelism, the MFU-drop and
  health conditions, and the action a condition asks for (`config.goodput`);
- `health`: a node's GPU health — the `HealthSource` interface, its NVML implementation
  (nvidia-ml-py) and the one fault injection drives on any machine — and the light sampler thread;
- `diagnosis`: the verdict of a diagnostic sweep (which nodes fail, and why) from its numbers;
- `cordon`: the run's exclude list (``cordon.json``, kept with the run), what it becomes for
  Slurm (``--exclude``) and Kubernetes (node anti-affinity), and the layout a run resumes on after
  an action (the node count, each node left's new node rank — or why it stops);
- `ledger`: what each training attempt did with its time, written as it goes (``goodput.jsonl``),
  and the accounting of the run's wall time from it (productive steps, start-up, checkpoints,
  evaluation, recovery, lost work: the parts add up to the wall);
- `faults`: fault injection (``LMFORGE_FAULT``), a feature users test their cluster with.

The measuring (timers, the all-gather, the matmul and all-reduce tests) is the core's:
`train.telemetry` and `distributed.diagnose`.
"""
