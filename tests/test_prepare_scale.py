"""`data prepare` / `data dedup` as N tasks: work units that do not depend on N, datatrove's local,
Slurm and Ray executors, a killed job finished by the same command, dedup across tasks, and bad
executor input. The reference everywhere is the plain one-process command."""

from __future__ import annotations

import gzip
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from lmforge.data.prepare.dedup import curate_to_jsonl
from lmforge.data.prepare.executors import ExecutorSpec, idle_tasks_note, progress_fields, throughput_line
from lmforge.data.prepare.job import Job, Stage
from lmforge.data.prepare.prepare import MARKER, prepare
from lmforge.data.text.sources import Source, SourceStats, list_files
from lmforge.data.text.tokenizer import train_tokenizer
from lmforge.data.prepare.units import plan_units, unit_documents
from train_helpers import cli, communicate, free_port, lmforge, train_in_process

SEQ = 32
UNIT = 2048  # bytes of input per work unit: the corpus below makes about 20 units
UNIT_MB = str(UNIT / (1 << 20))


def _doc(rng: random.Random, i: int) -> str:
    words = ["alpha", "beta", "gamma", "delta", "über", "naïve", "日本", "x=1;", "return", "\n"]
    return f"doc {i}: " + " ".join(rng.choices(words, k=rng.randint(5, 80)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    """A one-document .txt, a JSONL file cut into several units, small JSONL files grouped, a .gz."""
    d = tmp_path_factory.mktemp("scale-raw")
    rng = random.Random(5)
    docs = [_doc(rng, i) for i in range(150)]
    (d / "a.txt").write_text(docs[0])
    (d / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[1:100]))
    for k in range(3):
        (d / f"s{k}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[100 + 10 * k:110 + 10 * k]))
    with gzip.open(d / "z.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in docs[130:])
    return d, docs


@pytest.fixture(scope="module")
def tok(corpus, tmp_path_factory):
    return train_tokenizer([str(corpus[0])], 300, str(tmp_path_factory.mktemp("scale-tok")))


@pytest.fixture(scope="module")
def plain(corpus, tok, tmp_path_factory) -> Path:
    """The plain command's dataset (this process), the reference of every executor test."""
    out = tmp_path_factory.mktemp("scale-plain") / "ds"
    s = prepare([str(corpus[0])], tok, str(out), SEQ, eval_fraction=0.2, unit_bytes=UNIT)
    assert s["units"] >= 10 and s["splits"]["val"]["samples"] > 0
    return out


def _files(ds: Path) -> dict[str, bytes]:
    """Every file of both splits (shards and index), by name."""
    return {f"{s}/{p.name}": p.read_bytes() for s in ("train", "val") for p in sorted((ds / s).iterdir())}


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix == ".json") if folder.is_dir() else []


def _args(corpus, tok, out, *more) -> list:
    return ["data", "prepare", "--input", corpus[0], "--tokenizer", tok.path, "--out", out, "--seq-len", SEQ,
            "--eval-fraction", "0.2", "--unit-mb", UNIT_MB, "--json", *more]


def test_units_do_not_depend_on_tasks_and_read_every_line_once(tmp_path):
    rows = [json.dumps({"text": "x" * n}) + "\n" for n in (1, 30, 2, 500, 3, 3, 120, 7)]
    (tmp_path / "big.jsonl").write_text("".join(rows))
    (tmp_path / "c.txt").write_text("hello")
    (tmp_path / "d.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "e.jsonl.gz").write_bytes(gzip.compress(b'{"text": "hello"}\n'))
    sources = list_files([str(tmp_path)])
    want = [json.loads(r)["text"] for r in rows]
    for unit_bytes in (1, 7, 64, 333, 10_000):
        units = plan_units(sources, unit_bytes)
        got = [t for u in units for t in unit_documents(u, "text", SourceStats()) if t != "hello"]
        assert got == want, unit_bytes  # every line once, in order, wherever the byte ranges fall
    small = [[s.uri.rsplit("/", 1)[1] for s in u.slices] for u in plan_units(sources, 30)[-2:]]
    assert small == [["c.txt", "d.jsonl"], ["e.jsonl.gz"]]  # whole files grouped up to the unit size
    assert plan_units(list_files([str(tmp_path)]), 64) == plan_units(sources, 64)  # a fresh listing: the same units
    assert plan_units([Source("builtin:python-stdlib")], 64)[0].bytes is None


def test_progress_and_throughput_lines():
    line = throughput_line(20_000_000, 100.0, 2)
    assert line.startswith("200,000 tokens/s, 100,000 tokens/s per core (2 cores); 1T tokens: ")
    assert " on 1, " in line and " on 100 machines like this one" in line
    assert throughput_line(5_000, 2.7, 2) == ("1,852 tokens/s, 926 tokens/s per core (2 cores) over 2.7 s: too little "
                                             "work to project 1T tokens from (it takes a run of 60 s or more)")
    job = Job("x", plan_units([Source("a", 100), Source("b", 100), Source("c", 300)], 100), "text")
    f = progress_fields(job, Stage("units", 3), {0}, 1000, 100, 1, 2.0)
    assert f == {"rate": "500 tokens/s", "eta": "ETA 8 s"}  # 400 bytes left at 50 bytes/s
    # Before the first item ends there is no rate: the time left says when it will be known (the
    # elapsed time is labelled as such); a dedup stage that reads no input counts items, not "0.0 MB/s".
    assert progress_fields(job, Stage("units", 3), set(), 0, 0, 0, 5.0) == {"rate": "", "eta": "ETA after the first item"}
    assert progress_fields(job, Stage("duplicates", 9), {0, 1}, 0, 0, 2, 4.0) == {"rate": "0.50 items/s",
                                                                                  "eta": "ETA 14 s"}
    assert idle_tasks_note(3, ExecutorSpec("local", tasks=8), 256 << 20) == (
        "3 units of --unit-mb 256 for 8 tasks: 3 tasks run, 5 would have nothing to do (a smaller --unit-mb makes "
        "more units)")
    assert idle_tasks_note(8, ExecutorSpec("local", tasks=8), 256 << 20) is None


@pytest.mark.integration
def test_piped_summaries_are_not_wrapped_at_80_columns(plain, tmp_path):
    """`data inspect` (the summary `data prepare` prints) into a pipe: each line whole, however long."""
    r = cli("data", "inspect", plain, check=True)
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("seq_len"))
    assert len(line) > 80 and line.endswith("eos 0)")
    assert any(ln.startswith("dataset ") and ln.endswith(str(plain)) for ln in r.stdout.splitlines())


def _pool_workers(pid: int) -> list[int]:
    """The task processes of the local executor under process ``pid``: the children of its pool's fork server."""
    from lmforge.process import descendants

    def parent(q: int) -> int | None:
        try:
            return int(Path(f"/proc/{q}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return None

    def server(q: int) -> bool:
        try:
            return b"forkserver" in Path(f"/proc/{q}/cmdline").read_bytes()
        except OSError:
            return False

    tree = descendants(pid)
    servers = {q for q in tree if server(q)}
    return [q for q in tree if parent(q) in servers]


def _kill_a_task(args: list, ready) -> tuple[int, str, list[int]]:
    """Start ``lmforge ARGS``, SIGKILL the task processes ``ready(workers)`` names once it names any,
    and wait for the command to end (a generous timeout is the failure: a command that never exits)."""
    tag = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-m", "lmforge", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, LMFORGE_TEST_TAG=tag))
    victims: list[int] = []
    while not victims and proc.poll() is None:
        time.sleep(0.01)
        victims = ready(_pool_workers(proc.pid))
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    _, err = communicate(proc, timeout=120)
    assert not _left_behind(tag)
    return proc.returncode, err, victims


def _left_behind(tag: str) -> list[int]:
    """Live processes started under the test's tag (their environment carries it): none may outlive the command."""
    out = []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and f"LMFORGE_TEST_TAG={tag}".encode() in Path(f"/proc/{d}/environ").read_bytes():
                out.append(int(d))
        except OSError:
            pass
    return out


def _after_kill(code: int, err: str, victims: list[int], out: Path) -> None:
    """A killed run either finished (the kill landed after the work was done) or stopped with one
    line naming a dead task, listing nothing."""
    if code == 0:
        return
    last = err.strip().splitlines()[-1]
    assert code == 1 and last.startswith("error: a task of the units stage (process ") and \
        int(last.split("(process ")[1].split(")")[0]) in victims, err
    assert not (out / "train" / "index.json").exists() and not (out / MARKER).exists()


@pytest.mark.e2e
def test_tasks_write_the_plain_dataset_and_a_killed_task_is_redone(corpus, tok, plain, tmp_path):
    """Kills at several moments of `--tasks 2`, each run going on from the last; then 3 tasks finish
    the job, redoing only the units without a marker, and write the plain command's dataset.

    1. The task processes, as soon as one has taken its work (datatrove's task log appears): a task
       lost before it did anything, which the pool would wait for forever (D0).
    2. The command itself (SIGKILL) while its tasks work: they must not go on publishing units (D6).
    3. The command while its last step writes the indexes (item 3).
    After 2 and 3 no process of the run is left, and DEST is either complete (marker and val index;
    a work/ left by a kill after the marker is what the same command removes) or refused by `train`."""
    from lmforge.data.prepare.prepared import is_prepared
    from lmforge.errors import UserError

    out = tmp_path / "ds"
    args = _args(corpus, tok, out, "--tasks", "2")
    started = out / "work" / "logs" / "units" / "logs"
    _after_kill(*_kill_a_task(args, lambda w: w if started.is_dir() and os.listdir(started) else []), out)
    for ready in (lambda: _names(out / "work" / "units"), lambda: (out / "train" / "index.json").exists()):
        _kill_the_command(args, ready)
        if (out / MARKER).exists():
            assert is_prepared(str(out)) and (out / "val" / "index.json").exists()
        elif out.exists():
            with pytest.raises(UserError, match="an unfinished `lmforge data prepare`"):
                is_prepared(str(out))
    done, finished = len(_names(out / "work" / "units")), (out / MARKER).exists()
    s = json.loads(lmforge(*_args(corpus, tok, out, "--tasks", "3"), check=True).stdout)
    if not finished:  # else a kill landed after the last unit: nothing was left to redo
        assert (s["executor"], s["tasks"], s["units_done_earlier"]) == ("local", 3, done)
    assert s["units"] == json.loads((plain / MARKER).read_text())["units"]
    assert _files(out) == _files(plain)  # the same samples, the same order, byte for byte
    assert sorted(os.listdir(out)) == [MARKER, "train", "val"]


@pytest.mark.e2e
def test_a_task_killed_while_the_other_is_idle_never_leaves_the_command_waiting(tok, tmp_path):
    """Three units, two tasks: task 1 does unit 1 (tiny) and waits idle in the pool while task 0 does
    units 0 and 2. Both task processes are killed then: the pool's teardown would wait forever on
    the queue lock the idle one held; the command must end all the same, and finish on a rerun."""
    rng = random.Random(4)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "market"]
    raw = tmp_path / "raw"
    raw.mkdir()
    big = "".join(json.dumps({"text": " ".join(rng.choices(words, k=200))}) + "\n" for _ in range(300))
    for name, text in (("a.jsonl", big), ("b.jsonl", json.dumps({"text": "tiny"}) + "\n"), ("c.jsonl", big)):
        (raw / name).write_text(text)
    unit_mb = str((raw / "a.jsonl").stat().st_size / (1 << 20))
    plain = prepare([str(raw)], tok, str(tmp_path / "plain"), SEQ, eval_fraction=0.2,
                    unit_bytes=(raw / "a.jsonl").stat().st_size)
    assert plain["units"] == 3
    out = tmp_path / "idle"
    args = ["data", "prepare", "--input", raw, "--tokenizer", tok.path, "--out", out, "--seq-len", SEQ,
            "--eval-fraction", "0.2", "--unit-mb", unit_mb, "--json", "--tasks", "2"]
    rank1_done = out / "work" / "logs" / "units" / "completions" / "00001"  # datatrove's mark for task 1
    _after_kill(*_kill_a_task(args, lambda w: w if rank1_done.exists() else []), out)
    r = lmforge(*args[:-1], "4", check=True)  # more tasks than units: said, not left idle in silence
    assert f"note: 3 units of --unit-mb {float(unit_mb):g} for 4 tasks: 3 tasks run, 1 would have nothing to do" \
        in r.stderr
    assert _files(out) == _files(tmp_path / "plain")


@pytest.mark.e2e
def test_dedup_across_tasks_removes_a_duplicate_from_another_tasks_input(tmp_path):
    rng = random.Random(2)
    words = "river stone cloud market garden winter signal harbor lantern meadow copper thunder".split()

    def essay():
        return " ".join(" ".join(rng.choice(words) for _ in range(rng.randint(6, 14))) + "." for _ in range(30))

    a, b = [essay() for _ in range(20)], [essay() for _ in range(20)]
    b[5] = a[3].upper()  # an exact duplicate (after normalization) of a document of the other file
    edited = a[7].split(" ")
    edited[10] = "anchor"
    b[12] = " ".join(edited)  # a near duplicate of another
    for name, docs in (("a", a), ("b", b)):
        (tmp_path / "in").mkdir(exist_ok=True)
        (tmp_path / "in" / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    size = max(p.stat().st_size for p in (tmp_path / "in").iterdir())  # a file per unit
    plain = curate_to_jsonl([str(tmp_path / "in")], str(tmp_path / "plain"), {"dedup": True}, unit_bytes=size)
    two = json.loads(lmforge("data", "dedup", "--input", tmp_path / "in", "--unit-mb", str(size / (1 << 20)), "--json",
                             "--out", tmp_path / "two", "--tasks", "2", "--removed-out", tmp_path / "rm",
                             check=True).stdout)
    assert two["units"] == 2 and two["tasks"] == 2  # each file is a unit, each unit a task
    assert two["curation"]["by_reason"] == plain["curation"]["by_reason"] == {"dedup/exact": 1, "dedup/near": 1}
    kept = (tmp_path / "two" / "documents.jsonl").read_text()
    assert kept == (tmp_path / "plain" / "documents.jsonl").read_text() and len(kept.splitlines()) == 38
    removed = {r["reason"]: r for f in (tmp_path / "rm").iterdir() for r in map(json.loads, f.read_text().splitlines())}
    assert (removed["dedup/exact"]["doc"], removed["dedup/exact"]["duplicate_of"]) == (25, 3)
    assert (removed["dedup/near"]["doc"], removed["dedup/near"]["duplicate_of"]) == (32, 7)


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch) -> Path:
    """No Slurm here: `sbatch` and `scontrol` are stand-ins that record the submissions (sbatch.log)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/sbatch.log\n"
                                    f"n=$(wc -l < {tmp_path}/sbatch.log)\necho \"Submitted batch job $n\"\n")
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho localhost\n")
    for p in bin_dir.iterdir():
        p.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path / "sbatch.log"


def _run_array_task(out: Path, stage: str, i: int) -> subprocess.CompletedProcess:
    """One task of a submitted job array, run the way its script runs it."""
    env = dict(os.environ, SLURM_ARRAY_TASK_ID=str(i), SLURM_NODELIST="node1", SLURM_JOB_ID="1")
    return subprocess.run([os.path.join(sys.prefix, "bin", "launch_pickled_pipeline"),
                           str(out / "work" / "logs" / stage / "executor.pik")], env=env, capture_output=True,
                          timeout=300)


@pytest.mark.e2e
def test_slurm_job_arrays_run_as_slurm_would_run_them(corpus, tok, plain, tmp_path, fake_slurm):
    """The test checks the generated array scripts, then runs every array task the way the scripts do."""
    out = tmp_path / "ds"
    s = prepare([str(corpus[0])], tok, str(out), SEQ, eval_fraction=0.2, unit_bytes=UNIT,
                executor=ExecutorSpec("slurm", tasks=2, partition="cpu", time="02:00:00"))
    assert [j["stage"] for j in s["submitted"]] == ["units", "finalize"] and not (out / MARKER).exists()
    script = Path(s["submitted"][0]["script"]).read_text()
    for line in ("#SBATCH --array=0-1", "#SBATCH --partition=cpu", "#SBATCH --time=02:00:00",
                 "#SBATCH --cpus-per-task=1", "#SBATCH --job-name=lmforge-units", f"source {sys.prefix}/bin/activate",
                 f"launch_pickled_pipeline {out}/work/logs/units/executor.pik"):
        assert line in script, line
    assert "--qos" not in script and "#SBATCH --array=0-0" in Path(s["submitted"][1]["script"]).read_text()
    calls = fake_slurm.read_text().splitlines()
    units_job = s["submitted"][0]["job_id"]
    assert any(f"--dependency=afterok:{units_job}" in c for c in calls[1:])  # finalize waits for the units
    for job in s["submitted"]:
        for i in range(job["tasks"]):
            assert _run_array_task(out, job["stage"], i).returncode == 0
    assert _files(out) == _files(plain)
    assert sorted(os.listdir(out)) == [MARKER, "train", "val", "work"] and os.listdir(out / "work") == ["logs"]


@pytest.mark.e2e
def test_a_failure_of_slurms_last_step_is_said_by_the_next_run(corpus, tok, tmp_path, fake_slurm, capsys):
    """The last step fails on Slurm, where no one reads it (the data is shorter than --seq-len): the
    same command, run again, runs the last step itself (every unit is done), so its error is the
    command's one line, not a line in work/errors and a resubmitted job failing the same way."""
    from lmforge.errors import UserError

    out = tmp_path / "ds"
    run = dict(eval_fraction=0.2, unit_bytes=1 << 20, executor=ExecutorSpec("slurm", tasks=1, partition="cpu"))
    s = prepare([str(corpus[0])], tok, str(out), 100_000, **run)
    for job in s["submitted"]:
        _run_array_task(out, job["stage"], 0)
    assert not (out / MARKER).exists() and os.listdir(out / "work" / "errors")
    submitted = fake_slurm.read_text()
    capsys.readouterr()
    with pytest.raises(UserError, match="--seq-len 100000: larger than the data"):
        prepare([str(corpus[0])], tok, str(out), 100_000, **run)
    assert "note: a task of the earlier jobs (finalize stage) stopped: --seq-len 100000: larger" in capsys.readouterr().err
    assert fake_slurm.read_text() == submitted and not out.exists()  # nothing submitted again; bad input: removed


@pytest.mark.e2e
def test_ray_executor_on_a_local_instance(corpus, tok, plain, tmp_path):
    """Killed with SIGKILL once a unit is done, the command leaves no process behind (Ray's agents
    ignore SIGTERM); the same command then finishes the job on a fresh local instance."""
    pytest.importorskip("ray")
    args = _args(corpus, tok, tmp_path / "ray", "--executor", "ray", "--tasks", "2")
    _kill_the_command(args, lambda: _names(tmp_path / "ray" / "work" / "units"))
    r = lmforge(*args, check=True, timeout=600)
    assert json.loads(r.stdout)["executor"] == "ray"
    assert _files(tmp_path / "ray") == _files(plain)


def _kill_the_command(args: list, ready) -> None:
    """Start ``lmforge ARGS``, SIGKILL it (the command alone) once ``ready()``, and wait until no process
    it started is left: a generous timeout is the failure."""
    tag = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-m", "lmforge", *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, env=dict(os.environ, LMFORGE_TEST_TAG=tag))
    while proc.poll() is None and not ready():
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 60
    while _left_behind(tag):
        assert time.monotonic() < deadline, f"left behind: {_left_behind(tag)}"
        time.sleep(0.1)


@pytest.mark.integration
def test_bad_executor_input_is_one_line_and_writes_nothing(corpus, tok, plain, tmp_path, capsys, monkeypatch):
    from lmforge.cli.main import main

    def error(*args) -> str:
        capsys.readouterr()
        code = main([str(a) for a in args])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
        return lines[0]

    before = (plain / MARKER).read_bytes()
    args = [a if a != SEQ else SEQ * 2 for a in _args(corpus, tok, plain)]
    assert f"already holds a different prepared dataset (--seq-len {SEQ})" in error(*args, "--tasks", "2")
    args = [a if a != UNIT_MB else "0.01" for a in _args(corpus, tok, plain)]  # other units: other samples
    assert f"already holds a different prepared dataset (--unit-mb {UNIT / (1 << 20):g})" in error(*args)
    assert (plain / MARKER).read_bytes() == before
    out = tmp_path / "new"
    base = _args(corpus, tok, out)
    assert "--executor spark: unknown executor (expected local, slurm or ray)" in error(*base, "--executor", "spark")
    assert "--tasks: expected a whole number at least 1" in error(*base, "--tasks", "0")
    assert "--executor slurm: needs --partition NAME" in error(*base, "--executor", "slurm")
    with monkeypatch.context() as m:  # not on a Slurm machine: no traceback, nothing written
        m.setenv("PATH", str(tmp_path))
        assert "--executor slurm: no `sbatch` on PATH" in error(*base, "--executor", "slurm", "--partition", "cpu")
    with monkeypatch.context() as m:  # a cluster that does not answer: one line at once, not minutes of silence
        m.setenv("RAY_ADDRESS", f"127.0.0.1:{free_port()}")
        assert "cannot reach the Ray cluster" in error(*base, "--executor", "ray", "--tasks", "2")
        m.setenv("RAY_ADDRESS", "nowhere")
        assert "RAY_ADDRESS=nowhere: expected HOST:PORT" in error(*base, "--executor", "ray", "--tasks", "2")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the package were not installed
    assert "--executor ray: needs ray: pip install 'lmforge[ray]'" in error(*base, "--executor", "ray", "--tasks", "2")
    monkeypatch.setitem(sys.modules, "datatrove.executor", None)
    assert "needs datatrove: pip install 'lmforge[curate]'" in error(*base, "--tasks", "2")
    assert not out.exists()


def test_exact_dedup_over_several_key_ranges(tmp_path):
    """Past 64 GB of input the exact keys are split into ranges, one finder item each: the same
    decisions (each repeat points at the first occurrence in input order, whatever its range)."""
    from lmforge.config.curation import DedupConfig
    from lmforge.data.curate.crossdedup import DedupPlan, find_duplicates, removals, write_signatures
    from lmforge.data.curate.dedup import signatures
    from lmforge.data.prepare.job import WorkDir

    rng = random.Random(3)
    units = [[f"text {rng.randrange(40)}" for _ in range(30)] for _ in range(3)]
    plan = DedupPlan(exact=True, near=False, partitions=4, bands=0, rows=0, num_perm=128, threshold=0.8)
    wd = WorkDir(str(tmp_path))
    for u, texts in enumerate(units):
        write_signatures(wd, plan, u, *signatures(texts, DedupConfig(near=False)))
    from lmforge.data.curate.crossdedup import EXACT, _load_part

    spread = [sum(len(_load_part(wd, f"dedup/exact/{u:06d}.bin", EXACT, p, 4)) for u in range(3)) for p in range(4)]
    assert sum(n > 0 for n in spread) > 1 and sum(spread) == 90  # the keys did spread over several ranges
    for item in range(plan.duplicate_items):
        find_duplicates(wd, plan, item)
    first: dict[str, tuple[int, int]] = {}
    for u, texts in enumerate(units):
        want = {}
        for d, t in enumerate(texts):
            if t in first:
                want[d] = ("exact", *first[t])
            else:
                first[t] = (u, d)
        assert removals(wd, plan, u) == want


@pytest.fixture(scope="module")
def dups(tmp_path_factory) -> Path:
    """A corpus with exact repeats, so that curation removes documents (samples for --removed-out)."""
    d = tmp_path_factory.mktemp("scale-dups")
    rng = random.Random(8)
    docs = [_doc(rng, i) for i in range(60)]
    (d / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs + docs[:15]))
    return d


@pytest.mark.integration
def test_a_kill_around_the_marker_leaves_a_dataset_complete_or_refused(dups, tok, tmp_path, monkeypatch):
    """The last step's order: indexes, removed samples, the marker, then work/ goes. A kill just
    before the marker (D5) leaves a folder `train` refuses and the same command completes; a kill
    just after it (D4) leaves work/, which the same command removes (not only "already prepared")."""
    from lmforge.data import remote
    from lmforge.data.prepare.job import WorkDir
    from lmforge.errors import UserError
    from lmforge.data.prepare.prepared import is_prepared

    out, rm = tmp_path / "ds", tmp_path / "removed"
    run = dict(eval_fraction=0.2, unit_bytes=2048, curate={"dedup": {"exact": True, "near": False}}, removed_out=str(rm))
    put = remote.put_bytes

    def killed_at_the_marker(uri, data, *a, **k):
        if uri.endswith(MARKER):
            raise KeyboardInterrupt
        return put(uri, data, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(remote, "put_bytes", killed_at_the_marker)
        with pytest.raises(KeyboardInterrupt):
            prepare([str(dups)], tok, str(out), SEQ, **run)
    assert (out / "train" / "index.json").exists() and (out / "val" / "index.json").exists() and not (out / MARKER).exists()
    with pytest.raises(UserError, match="an unfinished `lmforge data prepare`"):
        is_prepared(str(out))
    with pytest.raises(UserError, match="an unfinished `lmforge data prepare`"):
        train_in_process({"model": "llama-tiny", "tokenizer": tok.path, "train_data": str(out),
                          "training_duration": "2ba", "save_folder": str(tmp_path / "run")})

    with monkeypatch.context() as m:
        m.setattr(WorkDir, "remove", lambda self, keep_logs=False: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            prepare([str(dups)], tok, str(out), SEQ, **run)  # goes on from the units: the marker, then the kill
    assert (out / MARKER).exists() and (out / "work").is_dir() and is_prepared(str(out))
    shutil.rmtree(rm)  # as if the kill had come while the samples were being written
    s = prepare([str(dups)], tok, str(out), SEQ, **run)
    assert s["already_prepared"] and sorted(os.listdir(out)) == [MARKER, "train", "val"]
    assert [p.name for p in rm.iterdir()] == ["dedup-exact.jsonl"] and \
        len((rm / "dedup-exact.jsonl").read_text().splitlines()) == 15
    ref = prepare([str(dups)], tok, str(tmp_path / "ref"), SEQ, **run | {"removed_out": None})
    assert _files(out) == _files(tmp_path / "ref") and ref["curation"]["by_reason"] == {"dedup/exact": 15}

    # `data dedup`: the same order (documents.jsonl, the samples, curation.json, then work/ goes)
    jsonl = tmp_path / "jsonl"
    with monkeypatch.context() as m:
        m.setattr(WorkDir, "remove", lambda self, keep_logs=False: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            curate_to_jsonl([str(dups)], str(jsonl), run["curate"], unit_bytes=2048)
    assert json.loads((jsonl / "curation.json").read_text())["documents_written"] == 60 and (jsonl / "work").is_dir()
    assert curate_to_jsonl([str(dups)], str(jsonl), run["curate"], unit_bytes=2048)["already_done"]
    assert sorted(os.listdir(jsonl)) == ["curation.json", "documents.jsonl"]


def _corrupt_zst(path: Path, docs: list[str]) -> None:
    """A .jsonl.zst damaged in its middle: its first documents read, then the stream breaks."""
    import zstandard

    raw = zstandard.ZstdCompressor().compress("".join(json.dumps({"text": t}) + "\n" for t in docs).encode())
    path.write_bytes(raw[: len(raw) // 2] + bytes(200) + raw[len(raw) // 2 + 200:])


def test_an_unreadable_input_is_skipped_named_and_the_same_for_every_stage(tmp_path):
    from lmforge.data.text.sources import UnreadableInput

    rng = random.Random(6)  # past the reader's 1 MB buffer, so that documents come before the break
    docs = [f"document {i} " + " ".join(rng.choices(["river", "stone", "cloud", "lantern", "meadow"], k=300))
            for i in range(1500)]
    _corrupt_zst(tmp_path / "b.jsonl.zst", docs)
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "first"}) + "\n")
    (tmp_path / "c.jsonl.gz").write_bytes(b"\x1f\x8b not gzip")
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "last"}) + "\n")
    import zstandard

    whole = zstandard.ZstdCompressor().compress(b'{"text": "cut short"}\n' * 100)
    (tmp_path / "c2.jsonl.zst").write_bytes(whole[: len(whole) // 2])  # a file cut short: not read as if it ended there
    [unit] = plan_units(list_files([str(tmp_path)]), 1 << 20)
    stats = SourceStats()
    got = list(unit_documents(unit, "text", stats))
    assert got[0] == "first" and got[-1] == "last" and got[1:-1] == docs[:len(got) - 2] and 0 < len(got) - 2 < 1500
    assert [s["input"].rsplit("/", 1)[1] for s in stats.skipped_inputs] == ["b.jsonl.zst", "c.jsonl.gz", "c2.jsonl.zst"]
    assert "truncated: the file ends inside a frame" in stats.skipped_inputs[2]["reason"]
    assert stats.skipped_inputs[0]["reason"].startswith("corrupt or truncated zstd") and \
        stats.skipped_inputs[0]["reason"].endswith(f"skipped after its first {len(got) - 2} documents")
    assert list(unit_documents(unit, "text", SourceStats())) == got  # where it breaks depends on its bytes only
    with pytest.raises(UnreadableInput, match="b.jsonl.zst: corrupt or truncated zstd"):
        list(unit_documents(unit, "text", SourceStats(), "fail"))


@pytest.mark.e2e
def test_a_bad_input_file_met_by_a_task_keeps_the_units_done(corpus, tok, plain, tmp_path):
    """D1: a corrupt .zst met by a task: with --on-bad-input fail one line at once (it was a "dead
    task" and a command that never exited), the units done kept; the same command (resumed, skipping
    by default) finishes the job, naming the file; nothing of the job is lost."""
    raw = tmp_path / "raw"
    shutil.copytree(corpus[0], raw)
    (raw / "zz.jsonl.zst").write_bytes(b"not zstd at all")  # read with z.jsonl.gz, in the last unit
    out = tmp_path / "ds"
    args = _args((raw,), tok, out, "--tasks", "2")
    r = lmforge(*args, "--on-bad-input", "fail")
    line = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and line.startswith(f"error: {raw / 'zz.jsonl.zst'}: corrupt or truncated zstd") and \
        "units done are kept: run the same command with --on-bad-input skip" in line, r.stderr
    done = len(_names(out / "work" / "units"))
    assert done >= 1 and not (out / MARKER).exists()
    s = json.loads(lmforge(*args, check=True).stdout)
    assert s["units_done_earlier"] == done and [i["input"] for i in s["skipped_inputs"]] == [str(raw / "zz.jsonl.zst")]
    assert _files(out) == _files(plain)


def _run_near_stages(out: Path, plan) -> None:
    """Every dedup stage after the signatures, item by item, as any task would run them."""
    from lmforge.data.prepare.job import run_items
    from lmforge.data.prepare.units import Slice, Unit

    job = Job(str(out), [Unit(u, (Slice("x"),), 1) for u in range(plan.units)], "text", dedup=plan)
    for stage in job.stages():
        if stage.name not in ("signatures", "units"):
            run_items(job, stage, range(stage.items))


def _reference_clusters(edges: list[tuple[int, int]]) -> dict[int, int]:
    """node -> the smallest node of its component (union-find), for the nodes that are not it."""
    parent: dict[int, int] = {}

    def root(x: int) -> int:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for a, b in edges:
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return {n: root(n) for n in parent if root(n) != n}


def _near_removed(out: Path, plan) -> dict[int, int]:
    from lmforge.data.curate.crossdedup import removals
    from lmforge.data.prepare.job import WorkDir

    return {(u << 32) | d: (fu << 32) | fd for u in range(plan.units)
            for d, (_, fu, fd) in removals(WorkDir(str(out)), plan, u).items()}


def test_near_dedup_decisions_do_not_depend_on_how_the_work_is_cut(tmp_path):
    """Candidate pairs (a document and the previous one of equal band values, in input order),
    verified on the whole signatures, joined into components, each removing all but its first
    document: the same for one part of everything as for many band, group and node ranges, and
    the same as union-find over the verified pairs."""
    import numpy as np

    from lmforge.data.curate.crossdedup import DedupPlan, write_signatures
    from lmforge.data.prepare.job import WorkDir

    rng = np.random.default_rng(7)
    units, per_unit, perm, bands, rows = 6, 40, 32, 8, 4
    base = rng.integers(0, 2**32 - 1, (units * per_unit, perm), dtype=np.uint32)
    for target, source, edits in ((50, 3, 2), (130, 50, 3), (200, 130, 2), (233, 12, 30), (7, 5, 0)):
        base[target] = base[source]  # near copies (a few values changed), a chain, a far one, an exact one
        base[target, rng.choice(perm, edits, replace=False)] = rng.integers(0, 2**32 - 1, edits)
    sigs = [list(base[u * per_unit:(u + 1) * per_unit]) for u in range(units)]
    sigs[2][3] = None  # a document without a signature (an empty one)
    want = None
    for band_parts, groups, node_parts in ((1, 1, 1), (4, 3, 8), (2, 6, 2)):
        plan = DedupPlan(False, True, 1, bands, rows, perm, 0.8, band_parts=band_parts, groups=groups,
                         node_parts=node_parts, rounds=8, units=units)
        out = tmp_path / f"p{band_parts}-{groups}-{node_parts}"
        for u in range(units):
            write_signatures(WorkDir(str(out)), plan, u, [None] * per_unit, sigs[u])
        _run_near_stages(out, plan)
        got = _near_removed(out, plan)
        want = want or got
        assert got == want, (band_parts, groups, node_parts)
    # The reference: datatrove's candidate pairs per band, verified, then union-find.
    node = [(u << 32) | d for u in range(units) for d in range(per_unit)]
    pairs = set()
    for b in range(bands):
        order = sorted((tuple(base[i, b * rows:(b + 1) * rows]), node[i]) for i in range(len(node))
                       if not (i == 2 * per_unit + 3))
        pairs |= {(x[1], y[1]) for x, y in zip(order, order[1:]) if x[0] == y[0]}
    flat = {node[i]: base[i] for i in range(len(node))}
    verified = [(a, b) for a, b in pairs if (flat[a] == flat[b]).mean() >= 0.8]
    assert want == _reference_clusters(verified) and len(want) == 4  # the chain's two, the exact copy, a first one


def test_connected_components_of_long_chains_stars_and_cycles(tmp_path):
    """The large-star / small-star steps on graphs that are hard for them: a long path with its nodes
    in a random order, a star, a cycle, pairs; any number of node ranges gives union-find's answer."""
    import numpy as np

    from lmforge.data.curate.crossdedup import DedupPlan, _save_edges
    from lmforge.data.prepare.job import WorkDir, run_items

    rng = np.random.default_rng(11)
    ids = rng.permutation(1000).astype(np.uint64)  # node i is (unit, doc) = divmod(ids[i], 100)
    node = [int(i // 100) << 32 | int(i % 100) for i in ids]
    edges = [(node[i], node[i + 1]) for i in range(200)]  # a path
    edges += [(node[300], node[i]) for i in range(301, 400)]  # a star
    edges += [(node[i], node[i + 1]) for i in range(500, 540)] + [(node[540], node[500])]  # a cycle
    edges += [(node[i], node[i + 1]) for i in range(600, 800, 2)]  # pairs
    want = _reference_clusters(edges)
    for node_parts in (1, 4):
        plan = DedupPlan(False, True, 1, 1, 1, 1, 0.8, groups=1, node_parts=node_parts, rounds=20, units=10)
        out = tmp_path / str(node_parts)
        a, b = np.array([e[0] for e in edges], np.uint64), np.array([e[1] for e in edges], np.uint64)
        _save_edges(WorkDir(str(out)), "dedup/components/00/00000.bin", np.r_[a, b], np.r_[b, a], plan)
        job = Job(str(out), [], "text", dedup=plan)
        for stage in job.stages()[3:-1]:  # components, clusters, removals
            run_items(job, stage, range(stage.items))
        assert _near_removed(out, plan) == want, node_parts


def test_a_crash_in_a_task_is_said_to_be_a_bug_that_a_rerun_repeats(tmp_path):
    """Not bad input and not a dead task: an exception (here from a damaged dedup file) is recorded
    with its traceback, and the command's line says that running it again fails the same way."""
    from lmforge.data.curate.crossdedup import DedupPlan
    from lmforge.data.prepare.executors import TaskCrashed, _raise_task_error
    from lmforge.data.prepare.job import WorkDir, run_items
    from lmforge.data.prepare.units import Slice, Unit

    plan = DedupPlan(exact=True, near=False, partitions=1, bands=0, rows=0, num_perm=128, threshold=0.8)
    wd = WorkDir(str(tmp_path))
    wd.write_bytes("dedup/exact/000000.bin", b"xx")
    job = Job(str(tmp_path), [Unit(0, (Slice("x"),), 1)], "text", dedup=plan)
    with pytest.raises(ValueError):
        run_items(job, Stage("duplicates", 1), [0])
    [record] = [json.loads(p.read_text()) for p in (tmp_path / "work" / "errors").iterdir()]
    assert record["crash"] and "Traceback" in record["traceback"]
    with pytest.raises(TaskCrashed, match=r"a task of the duplicates stage crashed: ValueError: .*this is a bug, not "
                                          r"the data's fault: running the same command again fails the same way"):
        _raise_task_error(wd)


def test_a_prepared_dataset_is_opened_once_by_resolution(plain, tok, monkeypatch):
    from lmforge.data.stream import run_data as resolve
    from lmforge.data.prepare.prepare import read_summary

    opened = []
    real = resolve.open_dataset
    monkeypatch.setattr(resolve, "open_dataset", lambda *a, **k: opened.append(a) or real(*a, **k))
    data = resolve.ResolvedData(tok.path, [resolve.ResolvedDataset("d", str(plain), None, read_summary(str(plain)))], [])
    assert data.epoch_pieces(SEQ) == data.epoch_pieces(SEQ // 2) // 2 and data.split_lines(SEQ // 2)
    assert len(opened) == 1


def test_data_dedup_alone_keeps_its_documents_in_this_process():
    """With no filter, decontamination or tokenizer there is nothing for a worker process to do per
    document (only the trip there and back): the units stage then runs in this process."""
    from lmforge.config.curation import CurateConfig
    from lmforge.data.prepare.job import per_document_checks

    assert not per_document_checks(CurateConfig.model_validate({"dedup": {"exact": True}}), None)
    assert per_document_checks(CurateConfig.model_validate({"filters": {"c4": True}}), None)
    assert per_document_checks(CurateConfig.model_validate({}), object())
