"""Benchmark: data-parallel training steps (``vsekit train --nproc-per-node``) against one process.

At the papers' sizes (SAF / SGR: 36 x 2048 regions; VSE++: 2048-d vectors; joint 1024, words 300,
similarity 256, batch 128, captions of 8-16 tokens from 10,000 words, random inputs), each model's
training step (the trainer's own ``train_step``: encode, gathers, score, hinge loss, DDP's gradient average,
clip, Adam) runs

- in one process with 1 thread (the baseline), and
- on 2 gloo ranks with 1 thread each, at the SAME global batch (each rank encodes half of it and
  scores every image against its half of the captions),

each set in fresh processes (``torch.multiprocessing.spawn``), one after the other. Reported per
model: s/step (median of ``--steps`` after ``--warmup``; for the ranks, the slowest rank's), the
speed-up and scaling efficiency (speed-up / ranks), one process at a rank's share of the batch
(for VSE++, whose work is linear in the batch, a rank's own work alone on the machine with no
communication: the efficiency's bound, as a batch of B / R does not always cost 1 / R of a batch of
B; the pairwise models' score work is B x B / R on a rank, not (B / R)^2, so there it bounds nothing),
for VSE++ also R such processes side by side with no group at all (what this machine gives R
processes that share its caches and memory but never communicate: the bound that counts),
the bytes each rank puts into collectives per step
(encodings gathered forward and their gradients backward, batch-norm sums, DDP's gradients) and
the bytes on the wire per rank of ring algorithms, and the peak RSS of each rank.

``--find-unused-ab`` times DDP's search for parameters without a gradient (``find_unused_parameters``,
on for SMAN and SGR only since issue 44): in one 2-rank gloo group, the model's step with the search
off and a twin's with it on alternate step by step (the order swapped every step), so the machine's
load hits both alike; reported per model: each median (the slowest rank's s/step) and the median of
the per-step ratios off / on. ``--ab`` does the same for issue 47's communication hook: off, DDP
all-reduces every gradient whole (no hook, as before); on, a word embedding's gradient only in the
rows some rank touched (``step.reduce_touched_rows``, the default); with the bytes all-reduced per step.

``--device cuda`` times one process on the GPU (the per-GPU step time the on-paper expectation for 8
GPUs / 2 nodes starts from). Needs only torch and vsekit's models (no store, no zarr).

Usage: ``python bench/train_ddp.py [--models vse,saf,sgr] [--batch 128] [--steps 3] [--warmup 1]
[--ranks 2] [--device cpu] [--find-unused-ab | --ab] [--out bench/results/train_ddp.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

VOCAB, WORD, EMBED, SIM, REGIONS, FEAT = 10000, 300, 1024, 256, 36, 2048


def _import_step():
    """vsekit's step and models; without zarr (a GPU image) ``vsekit.train``'s package init (which
    imports the store) is skipped: the step needs only torch."""
    try:
        import zarr  # noqa: F401
    except ImportError:
        pkg = types.ModuleType("vsekit.train")
        pkg.__path__ = [str(ROOT / "src" / "vsekit" / "train")]
        sys.modules["vsekit.train"] = pkg
    from vsekit.train import step, distributed, config  # noqa: F401
    return step, distributed, config


def build(name: str, batch: int, device: str, seed: int = 0):
    import numpy as np
    import torch

    from vsekit.models import create_model

    torch.manual_seed(seed)
    if name == "vse":
        net = create_model("vse", img_shape=(FEAT,), vocab_size=VOCAB, embed_dim=EMBED, word_dim=WORD)
        shape = (FEAT,)
    else:
        net = create_model(name, img_shape=(REGIONS, FEAT), vocab_size=VOCAB, embed_dim=EMBED, word_dim=WORD,
                           sim_dim=SIM, dropout=0.0)
        shape = (REGIONS, FEAT)
    rng = np.random.default_rng(seed)
    lengths = torch.from_numpy(rng.integers(8, 17, batch).astype(np.int64))
    tokens = torch.from_numpy(rng.integers(1, VOCAB, (batch, int(lengths.max()))).astype(np.int64))
    tokens[torch.arange(tokens.shape[1])[None, :] >= lengths[:, None]] = 0
    feats = torch.from_numpy(rng.standard_normal((batch, *shape), dtype=np.float32))
    counts = torch.full((batch,), REGIONS, dtype=torch.int64) if name != "vse" else None
    images = torch.arange(batch)
    return net.to(device), (feats, counts, tokens, lengths, images)


class _Batch:
    def __init__(self, feats, counts, tokens, lengths, images):
        self.feats, self.counts, self.tokens, self.lengths, self.images = feats, counts, tokens, lengths, images


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(name: str, batch: int, steps: int, warmup: int, device: str, group) -> dict:
    import torch

    step_mod, _, config = _import_step()
    net, tensors = build(name, batch, device)
    b = _Batch(*tensors)
    cfg = config.TrainConfig(model=name, grad_clip=2.0)
    from vsekit.models.losses import HingeLoss
    from vsekit.train.presets import make_optimizer   # the trainer's (fused Adam)

    loss_fn = HingeLoss(0.2, max_violation=True)
    optim = make_optimizer("adam", net.parameters(), 2e-4)
    dev = torch.device(device)
    net.train()
    times, traffic = [], None
    for i in range(warmup + steps):
        before = dict(group.traffic)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step_mod.train_step(net, b, loss_fn, optim, cfg, dev, group)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
            traffic = {k: group.traffic[k] - before.get(k, 0) for k in group.traffic}
    out = {"s_per_step": statistics.median(times), "times": times, "peak_rss_mb": round(_peak_rss_mb(), 1),
           "traffic_bytes": traffic}
    if dev.type == "cuda":
        out["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def _worker(rank: int, world: int, port: int, name: str, batch: int, steps: int, warmup: int, out_dir: str,
            threads: int, alone: bool = False) -> None:
    import torch

    torch.set_num_threads(threads)
    _, distributed, _ = _import_step()
    if world > 1 and not alone:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        group = distributed.setup("cpu", timeout_s=1800)
    else:
        group = distributed.Group()
    try:
        res = measure(name, batch, steps, warmup, "cpu", group)
    finally:
        group.close()
    Path(out_dir, f"{name}-{world}-{rank}.json").write_text(json.dumps(res))


def run_cpu(name: str, world: int, batch: int, steps: int, warmup: int, threads: int, tmp: str,
            alone: bool = False) -> list[dict]:
    """``world`` processes in a gloo group, or with ``alone`` side by side with no group at all."""
    import torch.multiprocessing as mp

    _, distributed, _ = _import_step()
    mp.spawn(_worker, args=(world, distributed.free_port(), name, batch, steps, warmup, tmp, threads, alone),
             nprocs=world, join=True)
    return [json.loads(Path(tmp, f"{name}-{world}-{r}.json").read_text()) for r in range(world)]


def _wrap_without_hook(step_mod, net, group) -> None:
    """``net``'s DDP wrapper as before issue 47: no communication hook, every bucket all-reduced whole."""
    from torch.nn.parallel import DistributedDataParallel

    keep = DistributedDataParallel.register_comm_hook
    DistributedDataParallel.register_comm_hook = lambda self, state, hook: None
    try:
        step_mod.data_parallel(net, group)
    finally:
        DistributedDataParallel.register_comm_hook = keep


def _ab_worker(rank: int, world: int, port: int, name: str, batch: int, steps: int, warmup: int, out_dir: str,
               threads: int, what: str) -> None:
    import torch

    torch.set_num_threads(threads)
    step_mod, distributed, config = _import_step()
    from vsekit.models.losses import HingeLoss
    from vsekit.train.presets import make_optimizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    group = distributed.setup("cpu", timeout_s=1800)
    runs = {}
    for key in ("off", "on"):
        net, tensors = build(name, batch, "cpu")
        if what == "find-unused":
            net.unused_parameters = key == "on"     # what data_parallel passes to DDP's find_unused_parameters
        elif key == "off":
            _wrap_without_hook(step_mod, net, group)
        runs[key] = (net, _Batch(*tensors), make_optimizer("adam", net.parameters(), 2e-4))
    cfg, loss_fn = config.TrainConfig(model=name, grad_clip=2.0), HingeLoss(0.2, max_violation=True)
    times: dict = {"off": [], "on": []}
    reduced: dict = {}
    try:
        for i in range(warmup + steps):
            for key in (("off", "on") if i % 2 == 0 else ("on", "off")):
                net, b, optim = runs[key]
                group.barrier()
                before = group.traffic["reduce"]
                t0 = time.perf_counter()
                step_mod.train_step(net, b, loss_fn, optim, cfg, torch.device("cpu"), group)
                if i >= warmup:
                    times[key].append(time.perf_counter() - t0)
                # the bytes all-reduced: the hook counts its own; without it DDP sends every gradient
                reduced[key] = (group.traffic["reduce"] - before if key == "on" or what == "find-unused"
                                else sum(p.numel() * p.element_size() for p in net.parameters() if p.grad is not None))
        flags = {k: bool(step_mod.data_parallel(runs[k][0], group).find_unused_parameters) for k in runs}
    finally:
        group.close()
    Path(out_dir, f"ab-{name}-{rank}.json").write_text(json.dumps({"times": times, "find_unused": flags,
                                                                   "reduce_bytes": reduced}))


def run_ab(name: str, batch: int, steps: int, warmup: int, threads: int, tmp: str, what: str) -> dict:
    """Two variants of the step alternating step by step in one 2-rank group (see above): ``what`` is
    ``"find-unused"`` (off / on: DDP's search) or ``"rows"`` (off: every embedding row all-reduced,
    on: only the touched ones)."""
    import torch.multiprocessing as mp

    _, distributed, _ = _import_step()
    mp.spawn(_ab_worker, args=(2, distributed.free_port(), name, batch, steps, warmup, tmp, threads, what), nprocs=2,
             join=True)
    ranks = [json.loads(Path(tmp, f"ab-{name}-{r}.json").read_text()) for r in range(2)]
    off, on = ([max(t) for t in zip(*(r["times"][k] for r in ranks))] for k in ("off", "on"))
    return {"s_per_step_off": statistics.median(off), "s_per_step_on": statistics.median(on),
            "median_ratio_off_on": statistics.median(a / b for a, b in zip(off, on)),
            "find_unused": ranks[0]["find_unused"], "reduce_bytes": ranks[0]["reduce_bytes"], "off": off, "on": on}


def wire_bytes(traffic: dict, world: int) -> float:
    """Bytes a rank sends per step with ring algorithms: an all-gather of a p-byte part sends
    (R - 1) p (its gradient's reduce-scatter as much); an all-reduce of s bytes sends 2 (R - 1) / R s."""
    r = world
    return (r - 1) * (traffic.get("gather", 0) + traffic.get("gather_grad", 0)) + 2 * (r - 1) / r * traffic.get("reduce", 0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="vse,saf,sgr")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--find-unused-ab", action="store_true")
    ap.add_argument("--ab", action="store_true", help="the whole embedding all-reduced against its touched rows")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import tempfile

    import torch

    results = {"batch": args.batch, "ranks": args.ranks, "threads": args.threads, "device": args.device,
               "torch": torch.__version__, "cpus": os.cpu_count(), "load_before": os.getloadavg(), "models": {}}
    for name in args.models.split(","):
        if args.find_unused_ab or args.ab:
            what = "find-unused" if args.find_unused_ab else "rows"
            with tempfile.TemporaryDirectory() as tmp:
                res = run_ab(name, args.batch, args.steps, args.warmup, args.threads, tmp, what)
            results["models"][name] = {f"{what}_ab": res}
            _write(args.out, results)
            label = "find_unused_parameters" if args.find_unused_ab else "touched embedding rows only"
            print(f"{name}: 2 ranks, {label} off {res['s_per_step_off']:.3f} s/step, on "
                  f"{res['s_per_step_on']:.3f} s/step; median per-step ratio off / on "
                  f"{res['median_ratio_off_on']:.3f}; all-reduced bytes per rank per step {res['reduce_bytes']}",
                  flush=True)
            continue
        if args.device.startswith("cuda"):
            _, distributed, _ = _import_step()
            group = distributed.setup(args.device, 600)    # under torchrun: an NCCL group
            dev = distributed.device_of(group, args.device)
            res = measure(name, args.batch, args.steps, args.warmup, dev, group)
            res["backend"] = group.backend
            results["models"][name] = {"cuda_1": res}
            _write(args.out, results)
            print(f"{name}: {res['s_per_step']:.4f} s/step on {torch.cuda.get_device_name()} through "
                  f"{group.backend or 'no process group'} (peak {res.get('peak_cuda_mb')} MB, traffic "
                  f"{res['traffic_bytes']})", flush=True)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            one = run_cpu(name, 1, args.batch, args.steps, args.warmup, args.threads, tmp)[0]
            many = run_cpu(name, args.ranks, args.batch, args.steps, args.warmup, args.threads, tmp)
            # a rank's own work, with no communication: one process at the batch share of a rank
            share = run_cpu(name, 1, args.batch // args.ranks, args.steps, args.warmup, args.threads, tmp)[0]
            # ... and R such processes side by side with no group (what the machine gives R processes
            # that share its memory and caches but never communicate): the bound for VSE++
            side = (run_cpu(name, args.ranks, args.batch // args.ranks, args.steps, args.warmup, args.threads, tmp,
                            alone=True) if name == "vse" else None)
        t_many = max(r["s_per_step"] for r in many)
        speedup = one["s_per_step"] / t_many
        traffic = many[0]["traffic_bytes"]
        bound = one["s_per_step"] / (args.ranks * share["s_per_step"])
        rec = {"one": one, "ranks": many, "share": share, "s_per_step_1": one["s_per_step"], "s_per_step_n": t_many,
               "s_per_step_share": share["s_per_step"], "efficiency_bound": bound,
               "side_by_side": side,
               "s_per_step_side_by_side": max(r["s_per_step"] for r in side) if side else None,
               "efficiency_bound_side_by_side": (one["s_per_step"] / (args.ranks * max(r["s_per_step"] for r in side))
                                                 if side else None),
               "speedup": speedup, "efficiency": speedup / args.ranks, "traffic_bytes_per_rank": traffic,
               "wire_bytes_per_rank": wire_bytes(traffic, args.ranks),
               "peak_rss_mb_1": one["peak_rss_mb"], "peak_rss_mb_ranks": [r["peak_rss_mb"] for r in many]}
        results["models"][name] = rec
        _write(args.out, results)
        side_text = (f"; {args.ranks} side by side with no group: {rec['s_per_step_side_by_side']:.2f} s/step, at "
                     f"most {rec['efficiency_bound_side_by_side']:.2f}" if side else "")
        print(f"{name}: 1 rank {one['s_per_step']:.2f} s/step, {args.ranks} ranks {t_many:.2f} s/step: speed-up "
              f"{speedup:.2f}, efficiency {speedup / args.ranks:.2f} (1 process at batch {args.batch // args.ranks}: "
              f"{share['s_per_step']:.2f} s/step{f': at most {bound:.2f} without communication' if name == 'vse' else ''}"
              f"{side_text}); "
              f"per rank per step {traffic} "
              f"(wire {rec['wire_bytes_per_rank'] / 2**20:.1f} MiB); peak RSS {one['peak_rss_mb']:.0f} MB vs "
              f"{[round(r['peak_rss_mb']) for r in many]} MB", flush=True)
    results["load_after"] = os.getloadavg()
    if args.out:
        _write(args.out, results)
        print(f"wrote {args.out}")


def _write(out, results) -> None:
    """The figures so far (a run cut short keeps what it measured)."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
