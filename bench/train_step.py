"""Benchmark: one training step (forward, backward, clip, optimiser) of each pairwise model at the
papers' sizes, against the SGRAF reference's per-caption training loop, each in its own process.

``reference-saf`` / ``reference-sgr`` are the SGRAF reference's own formulation (Paranioar/SGRAF,
``model.py``), written again here (not its code): the same modules and calls in the same order,
``SGRAF.train_emb``'s step: image fc 2048 -> 1024 and its ``l2norm``; word embedding 300, dropout
0.4, a BiGRU of 1024 over the packed captions (sorted longest first, as its ``collate_fn`` sorts
them), the two directions averaged, ``l2norm``; ``VisualSA`` (``BatchNorm1d(36)`` over the region
slots) and ``TextSA``; ``EncoderSimilarity``'s Python loop over the captions, each cut to its own
length and ``repeat``-ed once per image, ``SCAN_attention`` with its ``bmm``s, transposes and
``.contiguous()`` copies, ``(context - word)^2`` into ``sim_tranloc_w``, the global node; SGR's three
``GraphReasoning`` steps, or SAF's ``AttentionFiltration`` with one ``BatchNorm1d(1)`` call per
caption; ``ContrastiveLoss`` with its in-place ``masked_fill_`` (max violation, margin 0.2),
``clip_grad_norm_`` 2 and Adam 2e-4.

``reference-vse`` is VSE++'s reference (fartashf/vsepp, ``model.py``) the same way: its
``EncoderImagePrecomp``, ``EncoderText`` (GRU over packed captions, the last word's output),
``ContrastiveLoss`` with max violation and ``VSE.train_emb``'s clip 2 and Adam 2e-4.

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
[--warmup 1] [--threads 2] [--out bench/results/train_step.md]``. On a loaded machine,
``--alternate reference-saf,saf`` runs the two in one process with their steps alternating (ABBA) and
prints the median of the per-round ratios: the load, whatever it does, meets both alike
(``vse-torchgru``: VSE++ with the caption GRU as before issue 47, torch's packed ``nn.GRU``).

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
MODELS = ("reference-saf", "saf", "reference-sgr", "sgr", "sgr-temde", "sman", "reference-vse", "vse")


# -- the reference's training step, written again from its formulation --------------------------
# Paranioar/SGRAF, model.py: the same modules, calls and order (``EncoderImage``, ``EncoderText``,
# ``VisualSA``, ``TextSA``, ``GraphReasoning``, ``AttentionFiltration``, ``EncoderSimilarity`` with
# ``SCAN_attention``, ``ContrastiveLoss``, ``SGRAF.train_emb``): its l1norm / l2norm (``torch.pow``,
# ``sqrt``, ``+ eps``, ``torch.div``), one ``BatchNorm1d`` call per caption, the ``bmm``s with their
# transposes and ``.contiguous()`` copies, ``repeat`` of each caption over the images, the in-place
# ``masked_fill_`` of the loss, ``clip_grad_norm_`` over the parameter list, Adam. Captions come
# sorted by length, longest first, as the reference's ``collate_fn`` sorts them.
def ref_l1norm(x, dim, eps=1e-8):
    return torch.div(x, torch.abs(x).sum(dim=dim, keepdim=True) + eps)


def ref_l2norm(x, dim=-1, eps=1e-8):
    return torch.div(x, torch.pow(x, 2).sum(dim=dim, keepdim=True).sqrt() + eps)


def _xavier(module: nn.Module) -> None:
    """The reference's init_weights: uniform Xavier for each Linear, bias 0; BatchNorm weight 1, bias 0."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            r = (6.0 / (m.in_features + m.out_features)) ** 0.5
            nn.init.uniform_(m.weight, -r, r)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm1d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class RefEncoderImage(nn.Module):
    def __init__(self, img_dim, d):
        super().__init__()
        self.fc = nn.Linear(img_dim, d)
        _xavier(self)

    def forward(self, images):
        return ref_l2norm(self.fc(images), dim=-1)


class RefEncoderText(nn.Module):
    def __init__(self, vocab, word, d):
        super().__init__()
        self.embed = nn.Embedding(vocab, word)
        self.dropout = nn.Dropout(0.4)
        self.cap_rnn = nn.GRU(word, d, 1, batch_first=True, bidirectional=True)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)

    def forward(self, captions, lengths):
        x = self.dropout(self.embed(captions))
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True)   # sorted, longest first
        out, _ = self.cap_rnn(packed)
        emb, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        half = emb.size(2) // 2
        emb = (emb[:, :, :half] + emb[:, :, half:]) / 2
        return ref_l2norm(emb, dim=-1)


class RefSelfAttention(nn.Module):
    """VisualSA (``bn_local``: a BatchNorm1d over the region slots, one over the global vector) or
    TextSA (no batch norm)."""

    def __init__(self, d, drop=0.4, regions=None):
        super().__init__()
        local = [nn.Linear(d, d)] + ([nn.BatchNorm1d(regions)] if regions else []) + [nn.Tanh(), nn.Dropout(drop)]
        glob = [nn.Linear(d, d)] + ([nn.BatchNorm1d(d)] if regions else []) + [nn.Tanh(), nn.Dropout(drop)]
        self.embedding_local = nn.Sequential(*local)
        self.embedding_global = nn.Sequential(*glob)
        self.embedding_common = nn.Sequential(nn.Linear(d, 1))
        self.softmax = nn.Softmax(dim=1)
        _xavier(self)

    def forward(self, local, raw_global):
        l_emb = self.embedding_local(local)
        g_emb = self.embedding_global(raw_global)
        g_emb = g_emb.unsqueeze(1).repeat(1, l_emb.size(1), 1)
        weights = self.softmax(self.embedding_common(l_emb.mul(g_emb)).squeeze(2))
        new_global = (weights.unsqueeze(2) * local).sum(dim=1)
        return ref_l2norm(new_global, dim=-1)


class RefGraphReasoning(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.graph_query_w, self.graph_key_w, self.sim_graph_w = nn.Linear(s, s), nn.Linear(s, s), nn.Linear(s, s)
        self.relu = nn.ReLU()
        _xavier(self)

    def forward(self, sim_emb):
        query, key = self.graph_query_w(sim_emb), self.graph_key_w(sim_emb)
        edge = torch.softmax(torch.bmm(query, key.permute(0, 2, 1)), dim=-1)
        return self.relu(self.sim_graph_w(torch.bmm(edge, sim_emb)))


class RefAttentionFiltration(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.attn_sim_w = nn.Linear(s, 1)
        self.bn = nn.BatchNorm1d(1)
        _xavier(self)

    def forward(self, sim_emb):
        attn = ref_l1norm(torch.sigmoid(self.bn(self.attn_sim_w(sim_emb).permute(0, 2, 1))), dim=-1)
        return ref_l2norm(torch.matmul(attn, sim_emb).squeeze(1), dim=-1)


def ref_scan_attention(query, context, smooth, eps=1e-8):
    """query (n, words, d), context (n, regions, d): the words' attended region contexts."""
    attn = torch.bmm(context, torch.transpose(query, 1, 2))            # (n, regions, words)
    attn = nn.LeakyReLU(0.1)(attn)
    attn = ref_l2norm(attn, 2, eps)
    attn = torch.transpose(attn, 1, 2).contiguous()                     # (n, words, regions)
    attn = F.softmax(attn * smooth, dim=2)
    attn_t = torch.transpose(attn, 1, 2).contiguous()                   # (n, regions, words)
    weighted = torch.bmm(torch.transpose(context, 1, 2), attn_t)        # (n, d, words)
    return ref_l2norm(torch.transpose(weighted, 1, 2), dim=-1, eps=eps)


class RefEncoderSimilarity(nn.Module):
    def __init__(self, mode, d, s, steps=3):
        super().__init__()
        self.mode = mode
        self.v_global_w = RefSelfAttention(d, 0.4, regions=K)
        self.t_global_w = RefSelfAttention(d, 0.4)
        self.sim_tranloc_w, self.sim_tranglo_w = nn.Linear(d, s), nn.Linear(d, s)
        self.sim_eval_w = nn.Linear(s, 1)
        self.sigmoid = nn.Sigmoid()
        if mode == "sgr":
            self.SGR_module = nn.ModuleList(RefGraphReasoning(s) for _ in range(steps))
        else:
            self.SAF_module = RefAttentionFiltration(s)
        for m in self.children():   # the reference's own init_weights touches its direct Linear children
            if isinstance(m, nn.Linear):
                _xavier(m)

    def forward(self, img_emb, cap_emb, cap_lens):
        sims = []
        n_image = img_emb.size(0)
        img_glo = self.v_global_w(img_emb, torch.mean(img_emb, 1))
        for i in range(cap_emb.size(0)):
            n_word = cap_lens[i]
            cap_i = cap_emb[i, :n_word, :].unsqueeze(0)
            cap_i_expand = cap_i.repeat(n_image, 1, 1)
            cap_glo_i = self.t_global_w(cap_i, torch.mean(cap_i, 1))
            context = ref_scan_attention(cap_i_expand, img_emb, smooth=9.0)
            sim_loc = ref_l2norm(self.sim_tranloc_w(torch.pow(torch.sub(context, cap_i_expand), 2)), dim=-1)
            sim_glo = ref_l2norm(self.sim_tranglo_w(torch.pow(torch.sub(img_glo, cap_glo_i), 2)), dim=-1)
            sim_emb = torch.cat([sim_glo.unsqueeze(1), sim_loc], 1)
            if self.mode == "sgr":
                for module in self.SGR_module:
                    sim_emb = module(sim_emb)
                sim_vec = sim_emb[:, 0, :]
            else:
                sim_vec = self.SAF_module(sim_emb)
            sims.append(self.sigmoid(self.sim_eval_w(sim_vec)))
        return torch.cat(sims, 1)


class ReferenceSGRAF(nn.Module):
    """The three encoders of the reference's ``SGRAF`` object in one module (for ``.to`` / ``.train``)."""

    def __init__(self, mode, vocab=VOCAB, img_dim=IMG_DIM, d=EMBED, word=WORD, s=SIM, steps=3):
        super().__init__()
        self.img_enc = RefEncoderImage(img_dim, d)
        self.txt_enc = RefEncoderText(vocab, word, d)
        self.sim_enc = RefEncoderSimilarity(mode, d, s, steps)


class ReferenceVSE(nn.Module):
    """VSE++'s reference (fartashf/vsepp, ``model.py``), written again from its formulation:
    ``EncoderImagePrecomp`` (one Linear, Xavier-uniform as its ``init_weights``, ``l2norm``) and
    ``EncoderText`` (an Embedding drawn from U(-0.1, 0.1), a one-layer GRU over the packed captions, the
    output at each caption's last word gathered, ``l2norm``); its loss is the same ContrastiveLoss
    (:func:`ref_loss`) on ``im @ s.t()``, its step ``VSE.train_emb``: clip 2, Adam 2e-4."""

    def __init__(self, vocab=VOCAB, img_dim=IMG_DIM, d=EMBED, word=WORD):
        super().__init__()
        self.fc = nn.Linear(img_dim, d)
        r = (6.0 ** 0.5) / ((img_dim + d) ** 0.5)
        self.fc.weight.data.uniform_(-r, r)
        self.fc.bias.data.fill_(0)
        self.embed = nn.Embedding(vocab, word)
        self.embed.weight.data.uniform_(-0.1, 0.1)
        self.rnn = nn.GRU(word, d, 1, batch_first=True)
        self.d = d

    def images(self, x):
        return ref_l2norm(self.fc(x), 1)

    def captions(self, tokens, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(tokens), lengths, batch_first=True)
        out, _ = self.rnn(packed)
        padded = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0]
        last = (torch.tensor(lengths, device=tokens.device).view(-1, 1, 1).expand(tokens.size(0), 1, self.d) - 1)
        return ref_l2norm(torch.gather(padded, 1, last).squeeze(1), 1)


def ref_loss(scores, margin=MARGIN):
    """ContrastiveLoss(max_violation=True): its expand_as, ``eye > .5`` mask and in-place fills."""
    diagonal = scores.diag().view(scores.size(0), 1)
    d1 = diagonal.expand_as(scores)
    d2 = diagonal.t().expand_as(scores)
    cost_s = (margin + scores - d1).clamp(min=0)
    cost_im = (margin + scores - d2).clamp(min=0)
    mask = (torch.eye(scores.size(0)) > .5).to(scores.device)
    cost_s = cost_s.masked_fill_(mask, 0)
    cost_im = cost_im.masked_fill_(mask, 0)
    return cost_s.max(1)[0].sum() + cost_im.max(0)[0].sum()


# -- inputs and vsekit's step --------------------------------------------------------------------
def inputs(name: str, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if name == "sman":
        feats = torch.randn(batch, GRID, GRID, IMG_DIM, generator=g)
    elif name in ("vse", "reference-vse", "vse-torchgru"):
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
    if name == "reference-vse":
        torch.manual_seed(0)
        model = ReferenceVSE().to(device).train()
        params = list(model.parameters())
        optim = torch.optim.Adam(params, lr=2e-4)
        order = torch.argsort(lengths, descending=True, stable=True)     # its collate_fn sorts too
        tokens, cap_lens = tokens[order].to(device), lengths[order].tolist()
        feats = feats[order].to(device)

        def vse_step():   # VSE.train_emb
            img, cap = model.images(feats), model.captions(tokens, cap_lens)
            optim.zero_grad()
            loss = ref_loss(img.mm(cap.t()))
            loss.backward()
            nn.utils.clip_grad_norm_(params, 2.0)
            optim.step()
            return loss
        return vse_step, model
    if name.startswith("reference-"):
        torch.manual_seed(0)
        model = ReferenceSGRAF(name.split("-")[1]).to(device).train()
        params = [*model.txt_enc.parameters(), *model.img_enc.parameters(), *model.sim_enc.parameters()]
        optim = torch.optim.Adam(params, lr=2e-4)
        order = torch.argsort(lengths, descending=True, stable=True)     # the reference's collate_fn
        tokens, cap_lens = tokens[order].to(device), lengths[order].tolist()
        feats = feats[order].to(device)

        def step():   # SGRAF.train_emb
            img_embs = model.img_enc(feats)
            cap_embs = model.txt_enc(tokens, cap_lens)
            sims = model.sim_enc(img_embs, cap_embs, cap_lens)
            optim.zero_grad()
            loss = ref_loss(sims)
            loss.backward()
            nn.utils.clip_grad_norm_(params, 2.0)
            optim.step()
            return loss
        return step, model

    from vsekit.models.losses import HingeLoss
    from vsekit.train import presets
    from vsekit.train.step import clip_grad_norm

    model = build_vsekit("vse" if name == "vse-torchgru" else name).to(device).train()
    if name == "vse-torchgru":      # the caption GRU as before issue 47: torch's packed GRU (for --alternate)
        from torch.nn.utils.rnn import pack_padded_sequence

        from vsekit.models.encoders import l2norm

        enc = model.txt_enc
        enc.forward = lambda t, n: l2norm(enc.gru(pack_padded_sequence(
            enc.embed(t), n.cpu().clamp(min=1), batch_first=True, enforce_sorted=False))[1][-1])
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
        clip_grad_norm(model.parameters(), clip, torch.device(device))   # the trainer's clip
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


def run_alternating(names: list[str], batch: int, steps: int, threads: int, tune: bool, warmup: int = 1) -> dict:
    """Both models of a pair in one process, their steps alternating (ABBA order, so a load that
    drifts meets both alike): the ratio under a shared, changing load. Peak RSS is the pair's, so it
    is not reported per model here (the one-model runs give it)."""
    torch.set_num_threads(threads)
    if tune:
        from vsekit.allocator import tune_allocator
        tune_allocator()    # as the vsekit command does; the reference runs under it too here
    stepper = {n: make_step(n, batch)[0] for n in names}
    for n in names:
        for _ in range(warmup):
            stepper[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}   # the process's CPU seconds: less moved by a shared machine
    for r in range(steps):
        for n in (names if r % 2 == 0 else names[::-1]):
            t, c = time.perf_counter(), time.process_time()
            stepper[n]()
            times[n].append(time.perf_counter() - t)
            cpu[n].append(time.process_time() - c)
    ratios = [a / b for a, b in zip(times[names[0]], times[names[1]])]
    return {"models": names, "batch": batch, "times": times, "cpu_s": cpu,
            "s_per_step": {n: statistics.median(v) for n, v in times.items()},
            "cpu_s_per_step": {n: statistics.median(v) for n, v in cpu.items()},
            "ratio_first_over_second": statistics.median(ratios), "ratios": ratios,
            "cpu_ratio_first_over_second": statistics.median(a / b for a, b in zip(cpu[names[0]], cpu[names[1]]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per model (median), after one warm-up")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (0: the first step is timed)")
    ap.add_argument("--no-tune", action="store_true", help="leave glibc's allocator untuned for vsekit too")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--alternate", metavar="A,B",
                    help="one process, the steps of A and B alternating (ABBA): their ratio under a shared load")
    ap.add_argument("--out", default=str(HERE / "results" / "train_step.md"))
    args = ap.parse_args()
    if args.alternate:
        print(json.dumps(run_alternating(args.alternate.split(","), args.batch, args.steps, args.threads,
                                         not args.no_tune, args.warmup)), flush=True)
        return
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
