"""Benchmark: a model's training step as this checkout makes it against a git revision's, in one run.

The revision's ``train/step.py`` and ``models/encoders.py`` are loaded from git beside this
checkout's (its caption GRU, its optimiser factory ``train/presets.py``, its clip and DDP hook), and
the two steps alternate (ABBA) on the same inputs at the papers' sizes (``train_ddp.py``'s: batch
128, 2048-d images or 36 x 2048 regions, 10,000 words; ``--model vse`` or ``saf`` / ``sgr``): in one
process with ``--threads`` threads, and on 2 gloo ranks with one thread each (a barrier before each
step). Reported per setting: each variant's median wall time (for the
ranks the slowest rank's), median process CPU time (the load changes it less than the wall time),
and the medians of the per-step ratios revision / this checkout. The efficiency at 2 ranks moves by
the 2-rank ratio over the 1-rank one (``efficiency_factor``): an idle run's efficiency times it is
this checkout's.

Usage: ``OMP_NUM_THREADS=1 python -P bench/train_ab_rev.py [--rev main] [--model vse] [--batch 128]
[--threads 1] [--steps 10] [--warmup 1] [--out bench/results/train_ab_rev.json]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from train_ddp import _Batch, _import_step, build  # noqa: E402

FILES = {"step": "src/vsekit/train/step.py", "encoders": "src/vsekit/models/encoders.py",
         "presets": "src/vsekit/train/presets.py"}


def _load_rev(rev: str, tmp: str) -> dict:
    """The revision's modules, imported under private names (relative imports made absolute)."""
    mods = {}
    for key, path in FILES.items():
        text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=HERE.parent, check=True, capture_output=True,
                              text=True).stdout
        pkg = "vsekit.train" if "/train/" in path else "vsekit.models"
        text = text.replace("from ..", "from vsekit.").replace("from .", f"from {pkg}.")
        file = Path(tmp, f"rev_{key}.py")
        file.write_text(text)
        spec = importlib.util.spec_from_file_location(f"rev_{key}", file)
        mods[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods[key])
    return mods


def _variants(rev: str, tmp: str):
    """(name, step function, gru_last, optimiser factory) of the revision and of this checkout."""
    step, _, _ = _import_step()
    from vsekit.models import encoders
    from vsekit.train import presets

    old = _load_rev(rev, tmp)
    return [("rev", old["step"].train_step, old["encoders"].gru_last, old["presets"].make_optimizer),
            ("new", step.train_step, encoders.gru_last, presets.make_optimizer)]


def _run(rank: int, world: int, port: int, rev: str, steps: int, warmup: int, out: str, model: str = "vse",
         batch: int = 128, threads: int = 1) -> None:
    import torch

    torch.set_num_threads(threads)
    _, distributed, config = _import_step()
    from vsekit.models import encoders
    from vsekit.models.losses import HingeLoss

    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        group = distributed.setup("cpu", timeout_s=1800)
    else:
        group = distributed.Group()
    with tempfile.TemporaryDirectory() as tmp:
        variants = _variants(rev, tmp)
    runs = []
    for name, train_step, gru_last, make_optimizer in variants:
        net, tensors = build(model, batch, "cpu")
        runs.append((name, train_step, gru_last, net, _Batch(*tensors), make_optimizer("adam", net.parameters(), 2e-4)))
    cfg, loss_fn = config.TrainConfig(model=model, grad_clip=2.0), HingeLoss(0.2, max_violation=True)
    times = {name: {"wall": [], "cpu": []} for name, *_ in runs}
    try:
        for i in range(warmup + steps):
            for name, train_step, gru_last, net, b, optim in (runs if i % 2 == 0 else runs[::-1]):
                encoders.gru_last = gru_last          # the caption encoder calls the module's gru_last
                group.barrier()
                w, c = time.perf_counter(), time.process_time()
                train_step(net, b, loss_fn, optim, cfg, torch.device("cpu"), group)
                if i >= warmup:
                    times[name]["wall"].append(time.perf_counter() - w)
                    times[name]["cpu"].append(time.process_time() - c)
    finally:
        group.close()
    Path(out, f"ab-{world}-{rank}.json").write_text(json.dumps(times))


def measure(world: int, rev: str, steps: int, warmup: int, model: str, batch: int, threads: int) -> dict:
    import torch.multiprocessing as mp

    _, distributed, _ = _import_step()
    with tempfile.TemporaryDirectory() as out:
        if world == 1:
            _run(0, 1, 0, rev, steps, warmup, out, model, batch, threads)
        else:
            mp.spawn(_run, args=(world, distributed.free_port(), rev, steps, warmup, out, model, batch), nprocs=world,
                     join=True)
        ranks = [json.loads(Path(out, f"ab-{world}-{r}.json").read_text()) for r in range(world)]
    res = {}
    for kind in ("wall", "cpu"):
        rev_t, new_t = ([max(t) for t in zip(*(r[v][kind] for r in ranks))] for v in ("rev", "new"))
        res[kind] = {"rev_s": statistics.median(rev_t), "new_s": statistics.median(new_t),
                     "ratio_rev_new": statistics.median(a / b for a, b in zip(rev_t, new_t)), "rev": rev_t, "new": new_t}
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", default="main")
    ap.add_argument("--model", default="vse")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="the one process's threads (a rank has one)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rev = subprocess.run(["git", "rev-parse", "--short", args.rev], cwd=HERE.parent, check=True, capture_output=True,
                         text=True).stdout.strip()
    results = {"rev": rev, "model": args.model, "batch": args.batch, "threads_1": args.threads,
               "load_before": os.getloadavg()}
    for world in (1, 2):
        results[f"ranks_{world}"] = r = measure(world, args.rev, args.steps, args.warmup, args.model, args.batch,
                                                args.threads)
        print(f"{world} rank(s): revision {rev} / this checkout, wall {r['wall']['rev_s']:.3f} / {r['wall']['new_s']:.3f} "
              f"s/step (ratio {r['wall']['ratio_rev_new']:.3f}), CPU {r['cpu']['rev_s']:.3f} / {r['cpu']['new_s']:.3f} "
              f"(ratio {r['cpu']['ratio_rev_new']:.3f})", flush=True)
    results["load_after"] = os.getloadavg()
    results["efficiency_factor"] = {k: results["ranks_2"][k]["ratio_rev_new"] / results["ranks_1"][k]["ratio_rev_new"]
                                    for k in ("wall", "cpu")}
    print(f"2-rank efficiency x {results['efficiency_factor']['wall']:.3f} (wall), "
          f"x {results['efficiency_factor']['cpu']:.3f} (CPU)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
