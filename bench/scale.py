"""Scale by simulation: ``--cluster local:4``, ``slurm:4`` and ``slurm-array:4`` on a million rows.

    .venv/bin/python bench/scale.py                                  # 1,000,000 rows, 250 per block
    .venv/bin/python bench/scale.py --rows 200000 --modes local:4,slurm-array:4

A stand-in model that costs nothing: a ``sitecustomize`` module on every process's path (driver,
dask workers, SLURM jobs, array tasks) replaces the extraction of a block by filling it with its row
numbers, so what is measured is vsekit's own cost per block: scheduling, leases, status checks,
chunk writes. The store has ``--rows`` image rows (paths only; no image is read), the feature set
``--block-rows`` rows per block (4,000 blocks for the defaults), float16 rows of 96 values.

Per mode, two runs into sets of their own:

* a full run: wall time from the command's start to the last block (for the array: until its job
  has left squeue), blocks per second, per-block overhead (wall seconds x 4 workers / blocks) and
  the driver's peak RSS (``ru_maxrss`` of the vsekit process; for the array the submitting process,
  and the array tasks' own peak RSS beside it);
* a kill and resume: the run is killed (SIGKILL to the driver's process group, and ``scancel`` of
  its SLURM jobs) once about half the blocks are done; the same command is run again; reported:
  seconds from the rerun's start to its first newly committed block, and to the end.

The SLURM legs start a throw-away single-node SLURM (tests/slurm_local.py; root, slurm-wlm, munge).
Writes JSON to ``--out`` (default bench/results/scale.json) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.append(str(ROOT / "tests"))  # slurm_local

OPTS = dict(model="test_resnet", kind="global", weights="none", input_size=64, resize=72, crops=1,
            batch_size=250, dtype="float16", progress=False, device="cpu", workers=0)

STANDIN = '''
import os
if os.environ.get("VSEKIT_BENCH_STANDIN"):
    import atexit, resource
    import numpy as np
    from vsekit.extract import array as _array, distribute as _distribute, runner as _runner
    from vsekit.extract.writer import BlockBuffer

    def _fill(plan, blk):
        buf = BlockBuffer.empty(plan, blk)
        buf.data[:] = np.arange(blk.start, blk.stop, dtype=np.float32)[:, None] % 2048
        buf.status[:] = 1
        buf.filled = len(blk)
        return buf

    def _compute(job, block, **kwargs):   # what the block engine would compute, without a model
        return _fill(job.plan, block)

    def _compute_all(job, blocks, **kwargs):
        for b in blocks:
            yield _fill(job.plan, b)

    _distribute.compute_block = _compute
    _array.compute_block = _compute
    _runner.compute_blocks = _compute_all
    _runner.extractor_for = lambda job: None

    def _rss():
        out = os.environ.get("VSEKIT_BENCH_RSS")
        if out and os.environ.get("SLURM_ARRAY_TASK_ID") is not None:
            kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            with open(out, "a") as f:
                f.write(f"task {os.environ['SLURM_ARRAY_TASK_ID']} {kb}\\n")

    atexit.register(_rss)
'''


def make_store(path: Path, rows: int):
    from vsekit.storage import FeatureStore

    store = FeatureStore.create(path, dataset="scale", image_root=str(path.parent))
    ids = [str(i) for i in range(rows)]
    store.write_images(ids, [f"img/{i}.jpg" for i in range(rows)], ["train"] * rows)
    return store


# --- one extract command, in a process of its own --------------------------------------------------
def _child(store: str, name: str, cluster: str, block_rows: int) -> None:
    """The command under test (``bench/scale.py _child ...``): prints its wall time and peak RSS."""
    from vsekit.extract import extract

    t0 = time.perf_counter()
    res = extract(store, name=name, cluster=cluster, block_rows=block_rows, **OPTS)
    print(json.dumps({"seconds": time.perf_counter() - t0, "maxrss_mb": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss / 1024, "job_id": getattr(res, "job_id", None)}), flush=True)


def start(store: Path, name: str, cluster: str, block_rows: int, env: dict) -> subprocess.Popen:
    log = open(Path(store).parent / f"{name}.stderr", "a")
    return subprocess.Popen([sys.executable, __file__, "_child", str(store), name, cluster, str(block_rows)],
                            env=env, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)


def done_blocks(store: Path, name: str) -> int:
    import numpy as np

    from vsekit.storage import FeatureStore

    try:
        fs = FeatureStore.open(store).features(name)
        st = np.asarray(fs.status[:])
    except Exception:
        return 0
    step = fs.chunk_rows
    return int(sum(1 for s in range(0, len(st), step) if (st[s:s + step] != 0).all()))


def written_blocks(store: Path, name: str) -> int:
    """Blocks whose status chunk has been written (a directory listing: cheap enough to poll)."""
    try:
        return sum(1 for n in os.listdir(Path(store) / "features" / name / "status" / "c") if n.isdigit())
    except FileNotFoundError:
        return 0


def slurm_jobs(env) -> list[str]:
    import slurm_local

    return slurm_local.jobs(env) if env.get("SLURM_CONF") else []


def wait_array(env, job: str | None, timeout: float) -> None:
    deadline = time.time() + timeout
    while job and time.time() < deadline and any(j.split("_")[0] == job for j in slurm_jobs(env)):
        time.sleep(0.5)


def full_run(store: Path, mode: str, blocks: int, block_rows: int, env: dict, timeout: float) -> dict:
    name = "full_" + mode.replace(":", "").replace("-", "")
    rss_file = Path(store).parent / f"{name}.rss"
    env = dict(env, VSEKIT_BENCH_RSS=str(rss_file))
    t0 = time.perf_counter()
    p = start(store, name, mode, block_rows, env)
    out, _ = p.communicate(timeout=timeout)
    info = json.loads(out.strip().splitlines()[-1])
    wait_array(env, info.get("job_id"), timeout)
    wall = time.perf_counter() - t0
    assert done_blocks(store, name) == blocks, f"{mode}: {done_blocks(store, name)} of {blocks} blocks done"
    row = {"mode": mode, "wall_s": round(wall, 1), "blocks_per_s": round(blocks / wall, 1),
           "overhead_ms_per_block": round(1000 * wall * 4 / blocks, 1),
           "driver_maxrss_mb": round(info["maxrss_mb"], 1)}
    if rss_file.exists():
        kbs = [int(x.split()[2]) for x in rss_file.read_text().splitlines()]
        row["task_maxrss_mb"] = round(max(kbs) / 1024, 1)
    return row


def kill_and_resume(store: Path, mode: str, blocks: int, block_rows: int, env: dict, timeout: float) -> dict:
    import slurm_local

    name = "resume_" + mode.replace(":", "").replace("-", "")
    p = start(store, name, mode, block_rows, env)
    deadline = time.time() + timeout
    while written_blocks(store, name) < blocks // 2 and time.time() < deadline:
        time.sleep(0.1)
    if env.get("SLURM_CONF"):   # the jobs first: they would go on writing
        for j in slurm_jobs(env):
            subprocess.run([slurm_local.which("scancel"), "-s", "KILL", j.split("_")[0]], env=env,
                           capture_output=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    if env.get("SLURM_CONF"):
        for j in slurm_jobs(env):
            subprocess.run([slurm_local.which("scancel"), j.split("_")[0]], env=env, capture_output=True)
        while slurm_jobs(env):
            time.sleep(0.5)
    before = done_blocks(store, name)
    if before == blocks:
        return {"mode": mode, "killed_at_blocks": f"{before} (all: finished before the kill)"}
    t0 = time.perf_counter()
    p = start(store, name, mode, block_rows, env)
    first = None
    while p.poll() is None or (first is None and time.perf_counter() - t0 < timeout):
        if first is None and written_blocks(store, name) > before:
            first = time.perf_counter() - t0
        if p.poll() is not None and mode.startswith("slurm-array"):
            break
        time.sleep(0.1)
    out, _ = p.communicate()
    info = json.loads(out.strip().splitlines()[-1])
    while first is None and time.perf_counter() - t0 < timeout:
        if written_blocks(store, name) > before:
            first = time.perf_counter() - t0
        time.sleep(0.2)
    wait_array(env, info.get("job_id"), timeout)
    total = time.perf_counter() - t0
    assert done_blocks(store, name) == blocks, f"{mode} resume: not complete"
    return {"mode": mode, "killed_at_blocks": before, "resume_first_block_s": round(first or -1, 1),
            "resume_total_s": round(total, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--block-rows", type=int, default=250)
    ap.add_argument("--modes", default="local:4,slurm:4,slurm-array:4")
    ap.add_argument("--no-resume", action="store_true")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default=str(HERE / "results" / "scale.json"))
    args = ap.parse_args()
    blocks = -(-args.rows // args.block_rows)
    work = Path(tempfile.mkdtemp(prefix="vsekit-scale-"))
    site = work / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(STANDIN)
    env = dict(os.environ, VSEKIT_BENCH_STANDIN="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(site), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    store = work / "scale.zarr"
    sys.path.insert(0, str(ROOT / "src"))
    make_store(store, args.rows)
    print(f"store of {args.rows} rows in {time.perf_counter() - t0:.1f}s; {blocks} blocks", flush=True)
    rows = []
    modes = args.modes.split(",")
    slurm_ctx = None
    if any(m.startswith("slurm") for m in modes):
        import slurm_local

        why = slurm_local.unavailable()
        if why:
            print(f"SLURM legs skipped: {why}")
            modes = [m for m in modes if not m.startswith("slurm")]
        else:
            slurm_ctx = slurm_local.local_slurm(work / "slurm", cpus=4)
            env.update(next(iter([slurm_ctx.__enter__()])))
            env["VSEKIT_CLUSTER_CONFIG"] = json.dumps({
                "interface": "lo", "cores": 1, "memory": "2GB", "walltime": "02:00:00", "queue": "vsekit",
                "python": sys.executable, "log_directory": str(work / "jobs")})
    try:
        for mode in modes:
            row = full_run(store, mode, blocks, args.block_rows, env, args.timeout)
            if not args.no_resume:
                row.update(kill_and_resume(store, mode, blocks, args.block_rows, env, args.timeout))
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        if slurm_ctx is not None:
            slurm_ctx.__exit__(None, None, None)
    result = {"rows": args.rows, "block_rows": args.block_rows, "blocks": blocks, "cpus": os.cpu_count(),
              "legs": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    keys = ["mode", "wall_s", "blocks_per_s", "overhead_ms_per_block", "driver_maxrss_mb", "task_maxrss_mb",
            "killed_at_blocks", "resume_first_block_s", "resume_total_s"]
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, "-")) for k in keys) + " |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        _child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        main()
