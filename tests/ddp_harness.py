"""Data-parallel test harness: model cases, and the worker that each spawned rank of a real gloo group runs.

Imported by the spawned ranks (``torch.multiprocessing.spawn`` pickles the worker by module name),
so it holds no pytest fixtures. One spawned group runs every model case, so the group's start-up
(torch's import in each rank) is paid once per rank count.
"""

from __future__ import annotations

import os

import numpy as np
import torch

V = 23        # vocabulary
GLOBAL_D = 12
K, C = 5, 7   # regions x channels
G, GC = 2, 5  # grid G x G x GC

# name: (model, factory kwargs, feature layout, loss of step 1, loss of step 2)
CASES = {
    "vse-max": ("vse", {}, "global", True, True),
    "vse-sum": ("vse", {}, "global", False, False),
    "order": ("order", {}, "global", False, False),
    "order++": ("order", {"similarity": "order-norm"}, "global", True, True),
    "ph-poe": ("order", {}, "global", False, True),       # the curriculum: sum, then max
    "seam-e": ("seam-e", {"hops": 3, "att_units": 6, "filters": 4, "gru_dim": 6}, "global", True, True),
    "sman": ("sman", {"dropout": 0.0}, "grid", True, True),
    "saf": ("saf", {"dropout": 0.0, "sim_dim": 6}, "regions", True, True),
    "sgr": ("sgr", {"dropout": 0.0, "sim_dim": 6}, "regions", True, True),
    "sgr-temde": ("sgr", {"dropout": 0.0, "sim_dim": 6, "global_module": "t-emde", "temde_divisions": 3,
                          "temde_centroids": 2, "temde_dim": 2}, "regions", True, True),
}
# the global batches of the two steps: 6 (every rank count of the tests divides it) and 5 (an
# epoch's short last batch: an uneven split), with repeated images (pairs that are not negatives)
BATCHES = ((6, [0, 1, 2, 2, 3, 4]), (5, [5, 6, 6, 7, 8]))


def build(name: str):
    from vsekit.models import create_model

    model, kwargs, layout, _, _ = CASES[name]
    shape = {"global": (GLOBAL_D,), "grid": (G, G, GC), "regions": (K, C)}[layout]
    torch.manual_seed(0)
    net = create_model(model, img_shape=shape, vocab_size=V, embed_dim=8, word_dim=5, **kwargs)
    return net.double(), shape, layout


def batch(step: int, shape, layout: str):
    from vsekit.train.data import Batch

    n, images = BATCHES[step]
    rng = np.random.default_rng(100 + step)
    feats = torch.from_numpy(rng.standard_normal((n, *shape)))
    counts = None
    if layout == "regions":
        counts = torch.from_numpy(rng.integers(2, K + 1, n).astype(np.int64))
        feats[torch.arange(K)[None, :] >= counts[:, None]] = 0
    lengths = torch.from_numpy(rng.integers(1, 7, n).astype(np.int64))
    tokens = torch.from_numpy(rng.integers(1, V, (n, int(lengths.max())))).long()
    tokens[torch.arange(tokens.shape[1])[None, :] >= lengths[:, None]] = 0
    return Batch(feats, counts, tokens, lengths, torch.tensor(images))


def run_case(name: str, group) -> dict:
    """Two optimisation steps of ``name`` in float64 (Adam, clipping at 2): losses, and after each
    step the gradients, parameters and buffers."""
    from vsekit.models.losses import HingeLoss
    from vsekit.train.config import TrainConfig
    from vsekit.train.trainer import train_step

    bf16 = name.startswith("bf16:")   # float32 weights, the forward under bf16 autocast
    name = name[len("bf16:"):] if bf16 else name
    net, shape, layout = build(name)
    if bf16:
        net = net.float()
    net.train()
    cfg = TrainConfig(model=CASES[name][0], grad_clip=2.0, precision="bf16" if bf16 else "fp32")
    optim = torch.optim.Adam(net.parameters(), lr=1e-2)
    out: dict = {}
    for step in range(2):
        loss_fn = HingeLoss(0.2, max_violation=CASES[name][3 + step])
        b = batch(step, shape, layout)
        if bf16:
            b.feats = b.feats.float()
        loss, _ = train_step(net, b, loss_fn, optim, cfg, torch.device("cpu"), group)
        out[f"loss{step}"] = loss.detach().clone()
        out[f"grads{step}"] = {k: (None if p.grad is None else p.grad.detach().clone())
                               for k, p in net.named_parameters()}
        out[f"state{step}"] = {k: v.detach().clone() for k, v in net.state_dict().items()}
    out["buckets"] = buckets(net, group)   # gradients averaged by DDP during backward
    return out


def buckets(net, group) -> int:
    """How many gradient buckets DDP all-reduces for ``net`` (0 in one process)."""
    from vsekit.train.step import data_parallel

    if not group.distributed:
        return 0
    return len(data_parallel(net, group).reducer._get_zeros_like_grad_buckets())


def worker(rank: int, world: int, port: int, out_dir: str, names: list[str], bucket_mb: float | None = None) -> None:
    """One rank of a spawned gloo group: every case of ``names``, saved to ``out_dir/rank<r>.pt``;
    ``bucket_mb``: the gradient buckets' size (tiny: a bucket per parameter)."""
    if bucket_mb is not None:
        from vsekit.train import step

        step.BUCKET_MB = bucket_mb
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from vsekit.train.distributed import setup

    group = setup("cpu", timeout_s=60)
    try:
        results = {name: run_case(name, group) for name in names}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        group.close()


def spawn(world: int, out_dir: str, names: list[str], bucket_mb: float | None = None) -> list[dict]:
    import torch.multiprocessing as mp

    from vsekit.train.distributed import free_port

    mp.spawn(worker, args=(world, free_port(), out_dir, names, bucket_mb), nprocs=world, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


# validation over the ranks ------------------------------------------------------------------------
VAL_MODELS = {"vse": ("global", {}), "saf": ("regions", {"dropout": 0.0, "sim_dim": 6})}


def make_val_store(path: str) -> str:
    """A tokenised store with region features and a global feature set, 7 val images x 3 captions
    (7 and 21 split unevenly over 2 and 3 ranks)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import make_region_store
    from vsekit.storage.store import FeatureStore

    make_region_store(path, n_train=4, n_val=7, per_image=3, regions=K, channels=C)
    store = FeatureStore.open(path, mode="a")
    rng = np.random.default_rng(5)
    fs = store.create_features("global", (GLOBAL_D,), "float32", block_rows=8, attrs={"kind": "global"})
    for b in fs.blocks():
        fs.write_block(b, rng.standard_normal((len(b), GLOBAL_D), dtype=np.float32))
    return path


def validate_case(store_path: str, name: str, group) -> dict:
    """``trainer.validate`` of a float64 ``name`` on the val split; with the image rows and captions
    this process encoded."""
    from vsekit.models import create_model
    from vsekit.storage.store import FeatureStore
    from vsekit.train.config import TrainConfig
    from vsekit.train.data import EvalSet, Tokens, open_features
    from vsekit.train.trainer import validate

    features, kwargs = VAL_MODELS[name]
    store = FeatureStore.open(store_path)
    tokens = Tokens.from_store(store)
    source = open_features(store, features, store.split_rows("val"))
    evalset = EvalSet.from_store(store, "val", source)
    torch.manual_seed(0)
    net = create_model(name, img_shape=source.row_shape, vocab_size=tokens.vocab_size, embed_dim=8, word_dim=5,
                       **kwargs).double()
    seen = {"images": 0, "captions": 0}
    enc_i, enc_c = net.encode_images, net.encode_captions

    def encode_images(feats, counts):
        seen["images"] += len(feats)
        return enc_i(feats.double(), counts)

    def encode_captions(toks, lengths):
        seen["captions"] += len(toks)
        return enc_c(toks, lengths)

    net.encode_images, net.encode_captions = encode_images, encode_captions
    metrics = validate(net, source, tokens, evalset, TrainConfig(model=name, eval_batch=4), group)
    return {"metrics": metrics, **seen, "n_images": len(evalset.rows), "n_captions": len(evalset.captions)}


def validate_worker(rank: int, world: int, port: int, out_dir: str, store_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from vsekit.train.distributed import setup

    group = setup("cpu", timeout_s=60)
    try:
        results = {name: validate_case(store_path, name, group) for name in VAL_MODELS}
        torch.save(results, os.path.join(out_dir, f"val{rank}.pt"))
    finally:
        group.close()


def spawn_validate(world: int, out_dir: str, store_path: str) -> list[dict]:
    import torch.multiprocessing as mp

    from vsekit.train.distributed import free_port

    mp.spawn(validate_worker, args=(world, free_port(), out_dir, store_path), nprocs=world, join=True)
    return [torch.load(os.path.join(out_dir, f"val{r}.pt")) for r in range(world)]
