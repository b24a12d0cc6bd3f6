"""Benchmark: one training step (forward, backward, clip, optimiser) of each pairwise model at the
papers' sizes, against the SGRAF reference's per-caption training loop, each in its own process.

``reference-saf`` / ``reference-sgr`` are a reimplementation, written here from the SGRAF reference's
``train_emb`` (its operations and their order, not its code): image fc 2048 -> 1024 and l2norm; word
embedding 300, dropout 0.4, a BiGRU of 1024 whose two directions are averaged, l2norm; the visual
and textual self-attention (``BatchNorm1d(36)`` over region slots); ``EncoderSimilarity``'s Python
loop over the captions, each cut to its own length and repeated once per image (SCAN attention with
its transposes, ``(context - word)^2`` into ``W_sl``, the global node; SGR's three steps with
separate query and key maps over every node, or SAF's filtration with one ``BatchNorm1d(1)`` call
per caption); the max-violation hinge (margin 0.2), gradient clip 2 and Adam 2e-4.

``saf``, ``sgr``, ``sgr-temde`` (SGR with the T-EMDE global module), ``sman`` and ``vse`` are
vsekit's models trained as ``vsekit train`` trains them (the trainer's step: encode, ``score``,
``HingeLoss``, the model's extra loss, clip, the preset's optimiser), with the allocator tuned as
the ``vsekit`` command does. Sizes: 36 x 2048 regions (SMAN: a 7 x 7 x 2048 grid, hidden 512; VSE:
2048-d vectors, GRU 1024), joint 1024, words 300, similarity 256, batch 128, captions of 8-16 tokens
from a 10,000-word vocabulary, random inputs (speed does not depend on training).

Every model runs in a fresh subprocess (``--one NAME``), one after the other, so the peak RSS
(``ru_maxrss``) is that model's alone; a warm-up step, then ``--steps`` timed steps (median).
The child also reports its system CPU time and minor page faults per step.

Usage: ``python bench/train_step.py [--models reference-saf,saf,...] [--batch 128] [--steps 3]
[--warmup 1] [--threads 2] [--out bench/results/train_step.md]``.

:func:`step_peak` gives the peak device memory of one training step on a device (``make gpu-check``).
"""

from __future__ import annotations

import sys
from pathlib import Path

if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # bench/tokenize.py must not shadow the standard library's tokenize

import argparse
import json
import os
import resource
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
K, GRID, IMG_DIM, EMBED, WORD, SIM, VOCAB, MARGIN = 36, 7, 2048, 1024, 300, 256, 10000, 0.2
MODELS = ("reference-saf", "saf", "reference-sgr", "sgr", "sgr-temde", "sman", "vse")


# -- the reference's training step, reimplemented -----------------------------------------------
def ref_l2norm(x, dim=-1, eps=1e-8):
    return x / (x.pow(2).sum(dim, keepdim=True).sqrt() + eps)


def ref_l1norm(x, dim=-1, eps=1e-8):
    return x / (x.abs().sum(dim, keepdim=True) + eps)


class RefVisualSA(nn.Module):
    def __init__(self, d, regions, drop=0.4):
        super().__init__()
        self.local = nn.Sequential(nn.Linear(d, d), nn.BatchNorm1d(regions), nn.Tanh(), nn.Dropout(drop))
        self.glob = nn.Sequential(nn.Linear(d, d), nn.BatchNorm1d(d), nn.Tanh(), nn.Dropout(drop))
        self.common = nn.Linear(d, 1)

    def forward(self, local, raw_global):
        l_emb = self.local(local)
        g_emb = self.glob(raw_global).unsqueeze(1).repeat(1, l_emb.size(1), 1)
        weights = torch.softmax(self.common(l_emb.mul(g_emb)).squeeze(2), dim=1)
        return ref_l2norm((weights.unsqueeze(2) * local).sum(dim=1))


class RefTextSA(nn.Module):
    def __init__(self, d, drop=0.4):
        super().__init__()
        self.local = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Dropout(drop))
        self.glob = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Dropout(drop))
        self.common = nn.Linear(d, 1)

    def forward(self, local, raw_global):
        l_emb = self.local(local)
        g_emb = self.glob(raw_global).unsqueeze(1).repeat(1, l_emb.size(1), 1)
        weights = torch.softmax(self.common(l_emb.mul(g_emb)).squeeze(2), dim=1)
        return ref_l2norm((weights.unsqueeze(2) * local).sum(dim=1))


class RefGraphReasoning(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.q, self.k, self.g = nn.Linear(s, s), nn.Linear(s, s), nn.Linear(s, s)

    def forward(self, emb):
        edges = torch.softmax(torch.bmm(self.q(emb), self.k(emb).permute(0, 2, 1)), dim=-1)
        return F.relu(self.g(torch.bmm(edges, emb)))


class RefAttentionFiltration(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.w = nn.Linear(s, 1)
        self.bn = nn.BatchNorm1d(1)

    def forward(self, emb):
        attn = ref_l1norm(torch.sigmoid(self.bn(self.w(emb).permute(0, 2, 1))), -1)
        return ref_l2norm(torch.matmul(attn, emb).squeeze(1))


class ReferenceSGRAF(nn.Module):
    def __init__(self, mode, vocab=VOCAB, img_dim=IMG_DIM, d=EMBED, word=WORD, s=SIM, steps=3, smooth=9.0):
        super().__init__()
        self.mode, self.smooth = mode, smooth
        self.fc = nn.Linear(img_dim, d)
        self.embed = nn.Embedding(vocab, word)
        self.drop = nn.Dropout(0.4)
        self.gru = nn.GRU(word, d, batch_first=True, bidirectional=True)
        self.v_sa, self.t_sa = RefVisualSA(d, K), RefTextSA(d)
        self.sim_loc = nn.Linear(d, s)
        self.sim_glo = nn.Linear(d, s)
        self.sim_eval = nn.Linear(s, 1)
        if mode == "sgr":
            self.sgr = nn.ModuleList(RefGraphReasoning(s) for _ in range(steps))
        else:
            self.saf = RefAttentionFiltration(s)

    def encode(self, feats, tokens, lengths):
        img = ref_l2norm(self.fc(feats))
        x = self.drop(self.embed(tokens))
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.gru(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        half = out.size(2) // 2
        cap = ref_l2norm((out[:, :, :half] + out[:, :, half:]) / 2)
        return img, cap

    def similarities(self, img, cap, lengths):
        n_img = img.size(0)
        img_glo = self.v_sa(img, img.mean(1))
        cols = []
        for i, n in enumerate(lengths.tolist()):
            cap_i = cap[i, :n].unsqueeze(0)
            cap_expand = cap_i.repeat(n_img, 1, 1)
            cap_glo = self.t_sa(cap_i, cap_i.mean(1))
            # SCAN attention: query words, context regions
            attn = F.leaky_relu(torch.bmm(img, cap_expand.transpose(1, 2)), 0.1)
            attn = ref_l2norm(attn, 2).transpose(1, 2).contiguous()
            attn = torch.softmax(attn.view(-1, K) * self.smooth, dim=1).view(n_img, n, K)
            context = torch.bmm(attn, img)
            context = ref_l2norm(context)
            sim_loc = ref_l2norm(self.sim_loc(torch.pow(torch.sub(context, cap_expand), 2)))
            sim_glo = ref_l2norm(self.sim_glo(torch.pow(torch.sub(img_glo, cap_glo), 2)))
            emb = torch.cat([sim_glo.unsqueeze(1), sim_loc], 1)
            if self.mode == "sgr":
                for module in self.sgr:
                    emb = module(emb)
                vec = emb[:, 0, :]
            else:
                vec = self.saf(emb)
            cols.append(torch.sigmoid(self.sim_eval(vec)))
        return torch.cat(cols, 1)


def ref_loss(scores):
    diagonal = scores.diag().view(-1, 1)
    cost_s = (MARGIN + scores - diagonal.expand_as(scores)).clamp(min=0)
    cost_im = (MARGIN + scores - diagonal.t().expand_as(scores)).clamp(min=0)
    eye = torch.eye(scores.size(0), dtype=torch.bool)
    cost_s, cost_im = cost_s.masked_fill(eye, 0), cost_im.masked_fill(eye, 0)
    return cost_s.max(1)[0].sum() + cost_im.max(0)[0].sum()


# -- inputs and vsekit's step --------------------------------------------------------------------
def inputs(name: str, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if name == "sman":
        feats = torch.randn(batch, GRID, GRID, IMG_DIM, generator=g)
    elif name == "vse":
        feats = torch.randn(batch, IMG_DIM, generator=g)
    else:
        feats = torch.randn(batch, K, IMG_DIM, generator=g)
    lengths = torch.randint(8, 17, (batch,), generator=g)
    tokens = torch.randint(4, VOCAB, (batch, int(lengths.max())), generator=g)
    counts = torch.full((batch,), K) if feats.dim() == 3 else None
    return feats, counts, tokens, lengths


def build_vsekit(name: str):
    from vsekit.models import create_model

    torch.manual_seed(0)
    if name == "sman":
        return create_model("sman", img_shape=(GRID, GRID, IMG_DIM), vocab_size=VOCAB, embed_dim=512, word_dim=512)
    if name == "vse":
        return create_model("vse", img_shape=(IMG_DIM,), vocab_size=VOCAB, embed_dim=1024, word_dim=300)
    kw = {"global_module": "t-emde", "temde_divisions": 16} if name == "sgr-temde" else {}
    return create_model(name.split("-")[0], img_shape=(K, IMG_DIM), vocab_size=VOCAB, embed_dim=EMBED,
                        word_dim=WORD, sim_dim=SIM, **kw)


def make_step(name: str, batch: int, device: str = "cpu"):
    """A no-argument function running one training step of ``name`` on a fixed batch."""
    feats, counts, tokens, lengths = inputs(name, batch)
    if name.startswith("reference-"):
        torch.manual_seed(0)
        model = ReferenceSGRAF(name.split("-")[1]).to(device).train()
        optim = torch.optim.Adam(model.parameters(), lr=2e-4)
        feats, tokens = feats.to(device), tokens.to(device)

        def step():
            img, cap = model.encode(feats, tokens, lengths)
            loss = ref_loss(model.similarities(img, cap, lengths))
            optim.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            optim.step()
            return loss
        return step, model

    from vsekit.models.losses import HingeLoss
    from vsekit.train import presets

    model = build_vsekit(name).to(device).train()
    sman = name == "sman"
    optim = presets.make_optimizer("adadelta" if sman else "adam", model.parameters(),
                                   0.05 if sman else 2e-4, 5e-4 if sman else 0.0)
    clip = 0.1 if sman else 2.0
    loss_fn = HingeLoss(MARGIN, max_violation=True)
    images = torch.arange(batch, device=device)
    feats, tokens = feats.to(device), tokens.to(device)
    counts = None if counts is None else counts.to(device)

    def step():
        img = model.encode_images(feats, counts)
        cap = model.encode_captions(tokens, lengths)
        scores = model.score(img, cap)
        loss = loss_fn(scores, images)
        extra = model.extra_loss(img, cap, scores)
        if extra is not None:
            loss = loss + extra
        optim.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), clip)
        optim.step()
        return loss
    return step, model


def step_peak(model: str = "saf", device: str = "cuda", batch: int = 128) -> int:
    """Peak device memory (bytes) of two training steps of ``model`` ("saf", "sgr", "sgr-temde",
    "sman", "vse" or "reference-saf"/"reference-sgr") at the papers' sizes on a CUDA ``device``:
    the second step holds the optimiser state too. For ``make gpu-check``."""
    step, _ = make_step(model, batch, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(2):
        step()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))


def gpu_check(device: str = "cuda", small: bool = False) -> dict:
    """``make gpu-check``'s hook: peak device memory of a batch-128 SAF and SGR training step on
    CUDA (issue 31); on the CPU (its CI mode) one small step of each, so the hook cannot rot."""
    out: dict = {"ok": True}
    for model in ("saf", "sgr"):
        if str(device).startswith("cuda"):
            out[f"{model}_peak_device_gb_batch128"] = step_peak(model, device, 128) / 2**30
        else:
            step, _ = make_step(model, 2 if small else 8, device)
            loss = float(step().detach())
            out[f"{model}_cpu_step_loss"] = loss
            out["ok"] = out["ok"] and loss == loss   # not NaN
    return out


def run_one(name: str, batch: int, steps: int, threads: int, tune: bool, warmup: int = 1) -> dict:
    torch.set_num_threads(threads)
    if tune and not name.startswith("reference-"):
        from vsekit.allocator import tune_allocator
        tune_allocator()    # as the vsekit command does
    step, _ = make_step(name, batch)
    for _ in range(warmup):
        step()   # warm-up: first allocations, the optimiser's state
    times = []
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps):
        t = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"model": name, "batch": batch, "s_per_step": statistics.median(times), "times": times,
            "loss": float(loss.detach()), "peak_rss_gb": r1.ru_maxrss / 2**20,
            "sys_s_per_step": (r1.ru_stime - r0.ru_stime) / steps,
            "minor_faults_per_step": (r1.ru_minflt - r0.ru_minflt) / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per model (median), after one warm-up")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (0: the first step is timed)")
    ap.add_argument("--no-tune", action="store_true", help="leave glibc's allocator untuned for vsekit too")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(HERE / "results" / "train_step.md"))
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.batch, args.steps, args.threads, not args.no_tune, args.warmup)),
              flush=True)
        return
    rows = []
    for name in args.models.split(","):
        cmd = [sys.executable, __file__, "--one", name, "--batch", str(args.batch), "--steps", str(args.steps),
               "--threads", str(args.threads), "--warmup", str(args.warmup)] + (["--no-tune"] if args.no_tune else [])
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if res.returncode != 0:
            print(f"{name}: failed (exit {res.returncode})\n{res.stderr[-2000:]}", flush=True)
            continue
        row = json.loads(res.stdout.strip().splitlines()[-1])
        print(row, flush=True)
        rows.append(row)
    by = {r["model"]: r for r in rows}
    lines = [f"# Training step benchmark (`bench/train_step.py`)", "",
             f"Command: `python bench/train_step.py --models {args.models} --batch {args.batch} --steps "
             f"{args.steps} --threads {args.threads} --warmup {args.warmup}{' --no-tune' if args.no_tune else ''}`  ",
             "Each model in its own process, one after the other; median of the timed steps.", "",
             "| model | s/step | vs reference | peak RSS (GB) | system CPU s/step | minor faults/step |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ref = by.get("reference-" + r["model"].split("-")[0]) if not r["model"].startswith("reference") else None
        speed = f"{ref['s_per_step'] / r['s_per_step']:.2f}x" if ref else "—"
        lines.append(f"| {r['model']} | {r['s_per_step']:.2f} | {speed} | {r['peak_rss_gb']:.2f} | "
                     f"{r['sys_s_per_step']:.2f} | {r['minor_faults_per_step']:,.0f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
