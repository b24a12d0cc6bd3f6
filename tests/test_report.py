"""``vsekit report``: metrics table, curves, retrieval examples, attention, missing pieces, Chromium.

Most tests build run folders by hand (config.json, metrics.jsonl, metrics.json, sims_test.npy, a
checkpoint of a tiny attention model registered here), so they check the report against values
the test itself wrote or computed independently. ``test_end_to_end_trained_run`` trains a real
model with the trainer (issue #6) when it is importable.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from vsekit.cli import main
from vsekit.report import report
from vsekit.report.examples import top_k
from vsekit.report.runs import parse_epoch, parse_metrics
from vsekit.storage.store import write_array
from vsekit.models import base

torch.set_num_threads(1)

TOY = "_report_toy_attention"


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


class ToyAttention(base.RetrievalModel):
    """A tiny pairwise model with SEAM-like word hops and SMAN-like grid attention (2 steps)."""

    image_input = "grid"
    pairwise = True

    def __init__(self, vocab_size: int = 64, channels: int = 8, dim: int = 8, hops: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, dim)
        self.w_att = nn.Linear(dim, hops)
        self.img = nn.Linear(channels, dim)
        self.q = nn.Linear(dim, 1)

    def word_weights(self, tokens, lengths):
        e = self.emb(tokens)
        logits = self.w_att(e).transpose(1, 2)                       # (B, hops, L)
        pad = torch.arange(tokens.shape[1])[None, :] >= lengths[:, None]
        return torch.softmax(logits.masked_fill(pad[:, None, :], float("-inf")), dim=-1), e

    def encode_captions(self, tokens, lengths):
        a, e = self.word_weights(tokens, lengths)
        return nn.functional.normalize((a @ e).mean(1), dim=-1)

    def encode_images(self, feats, counts=None):
        v = self.img(feats.flatten(1, 2).float())                    # (B, cells, dim)
        alpha = torch.softmax(self.q(v).squeeze(-1), dim=1)          # step 1: (B, cells)
        return v, nn.functional.normalize((alpha[..., None] * v).sum(1), dim=-1)

    def score(self, img, cap):
        v, v1 = img
        a2 = torch.softmax(torch.einsum("icd,td->itc", v, cap), dim=-1)   # step 2: per pair
        v2 = nn.functional.normalize(torch.einsum("itc,icd->itd", a2, v), dim=-1)
        return v1 @ cap.T + (v2 * cap[None]).sum(-1)


if TOY not in base._MODELS:
    base.register_model(TOY)(ToyAttention)


# fixtures -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_store(tmp_path_factory):
    """48 demo images (6 test, 30 test captions), whitespace tokens and a 2×2×8 grid feature set."""
    from vsekit.storage.demo import make_demo_data
    from vsekit.storage.sources.karpathy import ingest_karpathy

    root = tmp_path_factory.mktemp("report_store")
    make_demo_data(root / "demo", images=48, seed=3, size=64)
    store, _ = ingest_karpathy(root / "demo" / "dataset_demo.json", root / "demo", root / "demo.zarr")
    texts = store.caption_text()
    vocab = ["<pad>", "<start>", "<end>", "<unk>"] + sorted({w for t in texts for w in t.lower().split()})
    stoi = {w: i for i, w in enumerate(vocab)}
    ids, offsets = [], [0]
    for t in texts:
        ids += [1] + [stoi[w] for w in t.lower().split()] + [2]
        offsets.append(len(ids))
    g = store.root.require_group("tokens")
    write_array(g, "ids", np.asarray(ids, dtype=np.int32))
    write_array(g, "offsets", np.asarray(offsets, dtype=np.int64))
    g.attrs.update({"vocabulary": vocab, "specials": vocab[:4]})
    fs = store.create_features("grid", (2, 2, 8), "float16", attrs={"kind": "grid", "model": "toy"},
                               block_rows=16)
    data = np.random.default_rng(0).normal(size=(48, 2, 2, 8)).astype(np.float16)
    for b in fs.blocks():
        fs.write_block(b, data[b.start:b.stop])
    # 4 regions of 8 channels, 2-4 of them real per image (the rest padding)
    rs = store.create_features("regions", (4, 8), "float16", attrs={"kind": "regions", "model": "toy"},
                               extra={"count": ((), "int16"), "boxes": ((4, 4), "float32")})
    counts = np.random.default_rng(1).integers(2, 5, size=48).astype(np.int16)
    regions = np.random.default_rng(2).normal(size=(48, 4, 8)).astype(np.float16)
    regions[np.arange(4)[None, :] >= counts[:, None]] = 0
    rs.write_block(0, regions, count=counts, boxes=np.zeros((48, 4, 4), np.float32))
    return store


METRICS_A = {"coco-1k": {"i2t": {"r1": 41.25, "r5": 70.5, "r10": 81.0, "medr": 2.0, "meanr": 7.5, "mrr": 0.52},
                         "t2i": {"r1": 30.0, "r5": 62.75, "r10": 75.0, "medr": 3.0, "meanr": 11.0, "mrr": 0.44},
                         "rsum": 360.5},
             "coco-5k": {"i2t": {"r1": 20.0, "r5": 45.0, "r10": 58.0, "medr": 7.0, "meanr": 30.0, "mrr": 0.3},
                         "t2i": {"r1": 15.0, "r5": 37.0, "r10": 49.0, "medr": 11.0, "meanr": 44.0, "mrr": 0.25},
                         "rsum": 224.0}}
# a second spelling, flat keys: the report must read both
METRICS_B = {"coco-1k": {"i2t_r1": 45.0, "i2t_r5": 69.0, "i2t_r10": 83.5, "i2t_medr": 2.0, "i2t_meanr": 6.0,
                         "i2t_mrr": 0.55, "t2i_r1": 28.0, "t2i_r5": 64.0, "t2i_r10": 74.0, "t2i_medr": 4.0,
                         "t2i_meanr": 12.5, "t2i_mrr": 0.41, "rsum": 363.5}}


def make_run(path: Path, store, *, metrics=None, sims=None, model=None, epochs=3, features="grid",
             name=None, model_kwargs=None) -> Path:
    path.mkdir(parents=True)
    config = {"model": name or (TOY if model is not None else "vsepp"), "store": str(store.path),
              "features": features,
              "model_kwargs": model_kwargs or {"vocab_size": len(store.root["tokens"].attrs["vocabulary"])}}
    (path / "config.json").write_text(json.dumps(config))
    with open(path / "metrics.jsonl", "w") as f:
        for e in range(1, epochs + 1):
            f.write(json.dumps({"epoch": e, "train_loss": 10.0 / e, "val": {"i2t": {"r1": 10.0 * e},
                                "t2i": {"r1": 8.0 * e}, "rsum": 50.0 * e}}) + "\n")
    if metrics is not None:
        (path / "metrics.json").write_text(json.dumps(metrics))
    if sims is not None:
        np.save(path / "sims_test.npy", sims)
    if model is not None:
        torch.save({"model": model.state_dict(), "epoch": epochs}, path / "checkpoint_best.pt")
    return path


def test_sizes(small_store):
    assert len(small_store.split_rows("test")) == 6 and len(small_store.captions_of_split("test")) == 30


class Page(HTMLParser):
    """Collects the metric cells, example blocks and images of a report page."""

    def __init__(self):
        super().__init__()
        self.cells, self.imgs, self.capq, self.imgq, self.missing = [], [], [], [], []
        self.stack: list[dict] = []
        self.tables = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table" and a.get("id") == "metrics":
            self.tables += 1
        if tag == "td" and "data-metric" in a:
            self.cells.append(a)
        if tag == "img":
            self.imgs.append(a)
            if self.stack:
                self.stack[-1]["imgs"].append(a)
        if tag == "div" and "missing" in (a.get("class") or "").split():
            self.missing.append(a)
            if self.stack:
                self.stack[-1]["imgs"].append(a)
        if tag == "div" and "capq" in (a.get("class") or "").split():
            self.stack = [dict(a, imgs=[])]
            self.capq.append(self.stack[0])
        if tag == "div" and "imgq" in (a.get("class") or "").split():
            self.stack = [dict(a, imgs=[], caps=[])]
            self.imgq.append(self.stack[0])
        if tag == "li" and self.stack and "caps" in self.stack[-1]:
            self.stack[-1]["caps"].append(dict(a, text=""))

    def handle_data(self, data):
        if self.stack and self.stack[-1].get("caps") and self.lasttag in ("li", "span"):
            self.stack[-1]["caps"][-1]["text"] += data


def parse_page(path: Path) -> Page:
    p = Page()
    p.feed(path.read_text())
    return p


# unit checks ---------------------------------------------------------------------------------------
def test_parse_metrics_reads_nested_and_flat_spellings():
    a, b = parse_metrics(METRICS_A), parse_metrics(METRICS_B)
    assert a["coco-1k"]["i2t.r1"] == 41.25 and a["coco-5k"]["t2i.medr"] == 11.0 and a["coco-1k"]["rsum"] == 360.5
    assert b["coco-1k"]["t2i.meanr"] == 12.5 and b["coco-1k"]["i2t.mrr"] == 0.55
    assert set(a["coco-1k"]) == set(b["coco-1k"]) == {f"{d}.{m}" for d in ("i2t", "t2i") for m in
                                                      ("r1", "r5", "r10", "medr", "meanr", "mrr")} | {"rsum"}
    flat = parse_metrics({"protocol": "1k", "R@1 i2t": 1.0, "i2t R@5": 2.0, "i2t R@10": 3.0,
                          "t2i": {"R@1": 4.0, "R@5": 5.0, "R@10": 6.0, "Med r": 7}})
    assert flat == {"1k": {"i2t.r1": 1.0, "i2t.r5": 2.0, "i2t.r10": 3.0, "t2i.r1": 4.0, "t2i.r5": 5.0,
                           "t2i.r10": 6.0, "t2i.medr": 7.0, "rsum": 21.0}}
    # per-fold values are not mixed into the average
    folds = parse_metrics({"coco-1k": {"rsum": 9.0, "folds": [{"rsum": 1.0}], "fold0": {"rsum": 2.0}}})
    assert folds == {"coco-1k": {"rsum": 9.0}}


def test_parse_epoch_prefers_validation_and_total_loss():
    rec = {"epoch": 4, "loss": 2.5, "loss_rank": 2.0, "penalty": 0.5, "val_loss": 9.0,
           "train": {"rsum": 1.0}, "val": {"rsum": 120.0, "i2t_r1": 30.0, "t2i_r1": 20.0}}
    assert parse_epoch(rec) == {"epoch": 4.0, "loss": 2.5, "rsum": 120.0, "i2t.r1": 30.0, "t2i.r1": 20.0}


def test_line_chart_draws_points_gaps_and_marks():
    from vsekit.report.plots import line_chart, nice_ticks

    svg = line_chart([("a", [0, 1, 2, 3], [1.0, None, 3.0, 4.0]), ("b", [0, 1], [2.0, 2.5])],
                     title="t", marks=[(2, "switch")])
    assert svg.count("<polyline") == 3 and svg.count("<circle") == 5  # a: [1.0] and [3.0, 4.0]; b
    assert svg.count('stroke-dasharray="4 3"') == 1 and "<title>switch</title>" in svg
    assert "not logged" in line_chart([("a", [1, 2], [None, None])], title="loss")
    assert nice_ticks(1, 3, 6, integer=True) == [1, 2, 3]
    assert parse_epoch({"epoch": 3, "loss": 1.0, "switch": "max loss from epoch 2"})["switch"] == 1.0


def test_top_k_matches_a_stable_argsort_including_ties():
    rng = np.random.default_rng(1)
    s = rng.integers(0, 6, size=(7, 40)).astype(float)            # many ties
    ref = np.argsort(-s, axis=1, kind="stable")[:, :5]
    assert np.array_equal(top_k(s, 5), ref)
    s2 = rng.normal(size=(3, 4))
    assert np.array_equal(top_k(s2, 5), np.argsort(-s2, axis=1, kind="stable"))


# the page ---------------------------------------------------------------------------------------
def test_table_equals_metrics_json_and_marks_best(small_store, tmp_path):
    rng = np.random.default_rng(2)
    a = make_run(tmp_path / "run_a", small_store, metrics=METRICS_A, sims=rng.normal(size=(6, 30)))
    b = make_run(tmp_path / "run_b", small_store, metrics=METRICS_B, epochs=2)
    s = report([a, b], tmp_path / "out", n_attention=0)
    p = parse_page(s.path)
    assert p.tables == 1
    got = {(c["data-run"], c["data-protocol"], c["data-metric"]): c for c in p.cells}
    want = {("run_a", proto, f"{d}.{m}" if d else m): (vals[d][m] if d else vals[m])
            for proto, vals in METRICS_A.items() for d, m in
            [(d, m) for d in ("i2t", "t2i") for m in vals[d]] + [(None, "rsum")]}
    want.update({("run_b", "coco-1k", k.replace("_", ".")): v for k, v in METRICS_B["coco-1k"].items()})
    assert {k: float(got[k]["data-value"]) for k in want} == want
    # best per column within coco-1k: higher recall/MRR/rsum, lower ranks
    best = {k[2]: k[0] for k, c in got.items() if k[1] == "coco-1k" and "best" in c.get("class", "")}
    assert best["i2t.r1"] == "run_b" and best["i2t.r5"] == "run_a" and best["t2i.medr"] == "run_a"
    assert best["i2t.meanr"] == "run_b" and best["t2i.mrr"] == "run_a" and best["rsum"] == "run_b"
    # a single run in coco-5k: nothing to compare, nothing marked
    assert not any("best" in c.get("class", "") for k, c in got.items() if k[1] == "coco-5k")
    html = s.path.read_text()
    assert "<svg" in html and "validation rsum" in html and "training loss" in html
    assert "run_b: no retrieval examples (no sims_test.npy and no loadable checkpoint)" in s.notes


def test_tied_best_values_are_all_marked(small_store, tmp_path):
    a = make_run(tmp_path / "a", small_store, metrics=METRICS_A)
    b = make_run(tmp_path / "b", small_store, metrics=METRICS_B)
    p = parse_page(report([a, b], tmp_path / "out", n_captions=0, n_images=0).path)
    tied = [c for c in p.cells if c["data-protocol"] == "coco-1k" and c["data-metric"] == "i2t.medr"]
    assert len(tied) == 2 and all("best" in c["class"].split() for c in tied)


def test_examples_match_the_similarity_matrix_and_images_decode(small_store, tmp_path):
    from PIL import Image
    import base64
    import io

    sims = np.random.default_rng(5).normal(size=(6, 30))
    sims[2, :] = sims[2, 0]                                     # ties in one image's row
    run = make_run(tmp_path / "run", small_store, metrics=METRICS_A, sims=sims)
    s = report([run], tmp_path / "out", n_captions=7, n_images=4, k=5, seed=3)
    data = json.loads((tmp_path / "out" / "report.json").read_text())["runs"][0]["examples"]
    test_caps = small_store.captions_of_split("test")
    test_imgs = small_store.split_rows("test")
    cap_img = np.searchsorted(test_imgs, small_store.caption_images()[test_caps])
    assert len(data["captions"]) == 7 and len(data["images"]) == 4
    for c in data["captions"]:
        col = sims[:, c["caption"]]
        assert c["top"] == np.argsort(-col, kind="stable")[:5].tolist()
        assert c["image"] == cap_img[c["caption"]] and c["caption_row"] == test_caps[c["caption"]]
        assert c["rank"] == 1 + int(np.sum(col > col[c["image"]]))
        assert np.allclose(c["scores"], col[c["top"]])
    for e in data["images"]:
        row = sims[e["image"]]
        assert e["top"] == np.argsort(-row, kind="stable")[:5].tolist()
        assert e["matches"] == [bool(cap_img[j] == e["image"]) for j in e["top"]]
    # the page shows the same lists, and every thumbnail is a decodable image of a test image
    p = parse_page(s.path)
    assert len(p.capq) == 7 and len(p.imgq) == 4
    for block, c in zip(p.capq, data["captions"]):
        shown = [int(i["data-image"]) for i in block["imgs"] if "data-correct" not in i]
        assert shown == c["top"]
        marked = [int(i["data-image"]) for i in block["imgs"] if i.get("data-image") and
                  int(i["data-image"]) == c["image"]]
        assert marked == [c["image"]]
    for block, e in zip(p.imgq, data["images"]):
        listed = [li for li in block["caps"] if "data-correct" not in li]  # the top k; then the correct one
        assert [int(li["data-caption"]) for li in listed] == e["top"]
        assert [li.get("class") == "ok" for li in listed] == e["matches"]
        texts = small_store.caption_text()[test_caps[e["top"]]]
        assert [li["text"].split(" (")[0].strip() for li in listed] == [str(t) for t in texts]
        extra = [int(li["data-caption"]) for li in block["caps"] if "data-correct" in li]
        assert extra == ([] if any(e["matches"]) else [e["correct"]])
    assert p.imgs and not p.missing
    for img in p.imgs:
        assert int(img["data-image-row"]) in set(test_imgs.tolist())
        head, b64 = img["src"].split(",", 1)
        assert head == "data:image/jpeg;base64"
        with Image.open(io.BytesIO(base64.b64decode(b64))) as im:
            im.load()
            assert max(im.size) == 64  # the demo images are 64 px, smaller than the thumbnail size


def test_model_run_scores_in_blocks_and_shows_attention(small_store, tmp_path):
    torch.manual_seed(0)
    vocab = small_store.root["tokens"].attrs["vocabulary"]
    model = ToyAttention(vocab_size=len(vocab)).eval()
    run = make_run(tmp_path / "toy", small_store, metrics=METRICS_A, model=model)
    s = report([run], tmp_path / "out", n_captions=5, n_images=3, n_attention=2, block=4)
    data = json.loads((tmp_path / "out" / "report.json").read_text())["runs"][0]
    assert data["examples"]["source"].startswith("the run's model")
    # an independent full similarity matrix, computed with the model in one go
    from vsekit.report import model_io

    rows, caps = small_store.split_rows("test"), small_store.captions_of_split("test")
    f, _ = model_io.read_features(small_store, "grid", rows)
    tok, lengths = model_io.read_tokens(small_store, caps)
    with torch.no_grad():
        full = model.score(model.encode_images(f), model.encode_captions(tok, lengths)).numpy()
    for c in data["examples"]["captions"]:
        assert c["top"] == np.argsort(-full[:, c["caption"]], kind="stable")[:5].tolist()
        assert np.allclose(c["scores"], full[c["top"], c["caption"]], atol=1e-5)
    for e in data["examples"]["images"]:
        assert e["top"] == np.argsort(-full[e["image"]], kind="stable")[:5].tolist()
    # attention: word hops (2 × L) and the grid's two steps, equal to the model's own weights
    att = data["attention"]
    assert len(att) == 2 and s.n_attention == 6
    views = att[0]["views"]
    cap = att[0]["caption"]
    t1, l1 = model_io.read_tokens(small_store, caps[[cap]])
    assert [v["kind"] for v in views] == ["words", "grid", "grid"]
    assert views[0]["shape"] == [2, int(l1[0])] and views[1]["shape"] == [2, 2]
    from vsekit.report.attention import pair_attention

    img = att[0]["image"]
    f1, _ = model_io.read_features(small_store, "grid", rows[[img]])
    got = pair_attention(model, f1, None, t1, l1)
    with torch.no_grad():
        a_words, _ = model.word_weights(t1, l1)
        v, _ = model.encode_images(f1)
        step1 = torch.softmax(model.q(v).squeeze(-1), dim=1)
        step2 = torch.softmax(torch.einsum("icd,td->itc", v, model.encode_captions(t1, l1)), dim=-1)
    assert np.allclose(got[0].weights, a_words[0].numpy(), atol=1e-6)
    assert np.allclose(got[1].weights, step1.reshape(2, 2).numpy(), atol=1e-6)
    assert np.allclose(got[2].weights, step2.reshape(2, 2).numpy(), atol=1e-6)
    html = s.path.read_text()
    assert html.count('class="heat"') == 4 and "hop 2" in html and "grid weights, step 2" in html


def test_sgraf_word_attention_equals_its_equation_and_temde_has_none(small_store, tmp_path):
    """SGR's per-word weights (SGRAF eq. 4) recomputed in numpy; T-EMDE's centroid softmax is not shown."""
    from vsekit.report import model_io
    from vsekit.models import create_model

    vocab = len(small_store.root["tokens"].attrs["vocabulary"])
    runs = {}
    for gm in ("self-attention", "t-emde"):
        kw = {"img_shape": [4, 8], "vocab_size": vocab, "embed_dim": 16, "word_dim": 8, "sim_dim": 8,
              "global_module": gm, "temde_divisions": 2, "temde_centroids": 4, "temde_dim": 2}
        torch.manual_seed(0)
        model = create_model("sgr", **kw).eval()
        runs[gm] = (model, make_run(tmp_path / gm, small_store, model=model, name="sgr", model_kwargs=kw,
                                    features="regions"))
    s = report([r for _, r in runs.values()], tmp_path / "out", n_captions=2, n_images=1, n_attention=2)
    data = json.loads((tmp_path / "out" / "report.json").read_text())["runs"]
    assert [v["title"] for a in data[0]["attention"] for v in a["views"]] == \
        ["word weights (text self-attention)"] * 2
    assert [a["views"] for a in data[1]["attention"]] == [[], []]
    assert "has no attention over words or grid cells" in s.path.read_text()
    # the numbers: w = softmax_l(w_c · (tanh(W_l u_l) ⊙ tanh(W_g mean(u)))) over the true words
    model = runs["self-attention"][0]
    att = data[0]["attention"][0]
    caps, rows = small_store.captions_of_split("test"), small_store.split_rows("test")
    tok, lengths = model_io.read_tokens(small_store, caps[[att["caption"]]])
    f, counts = model_io.read_features(small_store, "regions", rows[[att["image"]]])
    from vsekit.report.attention import pair_attention

    (view,) = pair_attention(model, f, counts, tok, lengths)
    with torch.no_grad():
        u = model.encode_captions(tok, lengths)[0][0].numpy().astype(np.float64)
    p = {k: v.detach().numpy().astype(np.float64) for k, v in model.t_att.named_parameters()}
    local = np.tanh(u @ p["local.weight"].T + p["local.bias"])
    glob = np.tanh(u.mean(0) @ p["glob.weight"].T + p["glob.bias"])
    logits = (local * glob) @ p["common.weight"][0] + p["common.bias"][0]
    w = np.exp(logits - logits.max())
    assert np.allclose(view.weights[0], w / w.sum(), atol=1e-5)


def test_missing_pieces_degrade_clearly(small_store, tmp_path):
    from vsekit.storage.store import FeatureStore

    # a copy of the store whose image root points at a folder without the images
    st = tmp_path / "copy.zarr"
    shutil.copytree(small_store.path, st)
    copy = FeatureStore.open(st, mode="r+")
    copy.root.attrs["image_root"] = str(tmp_path / "gone")
    run = make_run(tmp_path / "noeval", copy, sims=np.random.default_rng(0).normal(size=(6, 30)))
    (run / "metrics.jsonl").unlink()
    s = report([run], tmp_path / "out", n_captions=2, n_images=1)
    html = s.path.read_text()
    assert "no test evaluation" in html and f"vsekit evaluate {run}" in html
    assert "no metrics.jsonl: no learning curves" in html and "not logged in metrics.jsonl" in html
    p = parse_page(s.path)
    assert p.missing and not p.imgs
    assert all("image not on disk" in html for _ in p.missing)
    assert s.missing_images and all(m.startswith(str(tmp_path / "gone")) for m in s.missing_images)
    assert any("no longer on disk" in n for n in s.notes)


def test_cli_writes_the_report_and_rejects_bad_input(small_store, tmp_path):
    run = make_run(tmp_path / "run", small_store, metrics=METRICS_A, sims=np.zeros((6, 30)))
    r = CliRunner().invoke(main, ["report", str(run), "--out", str(tmp_path / "out"), "--caption-queries", "2",
                                  "--image-queries", "1"])
    assert r.exit_code == 0, r.output
    assert "wrote " + str(tmp_path / "out" / "index.html") in r.output and "2 caption and 1 image" in r.output
    assert (tmp_path / "out" / "index.html").stat().st_size > 1000
    (tmp_path / "empty").mkdir()
    r = CliRunner().invoke(main, ["report", str(tmp_path / "empty"), "--out", str(tmp_path / "o2")])
    assert r.exit_code == 1 and "is not a training run folder (no config.json)" in r.output
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{nope")
    r = CliRunner().invoke(main, ["report", str(tmp_path / "bad"), "--out", str(tmp_path / "o3")])
    assert r.exit_code == 1 and "config.json is not valid JSON" in r.output
    r = CliRunner().invoke(main, ["report", str(run), "--out", str(tmp_path / "o4"), "--top-k", "0"])
    assert r.exit_code == 1 and "--top-k" in r.output and "0 is not in the range x>=1" in r.output  # a usage error


def test_wrong_sized_sims_file_is_reported_not_used(small_store, tmp_path):
    run = make_run(tmp_path / "run", small_store, metrics=METRICS_A, sims=np.zeros((5, 30)))
    s = report([run], tmp_path / "out")
    assert any("sims_test.npy is 5×30, the test split is 6×30" in n for n in s.notes)
    assert s.n_caption_examples == 0


# headless Chromium ---------------------------------------------------------------------------------
def _chromium() -> str | None:
    """Path of a chromium binary, installing Debian's package when missing and we are root."""
    import os

    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None
    try:
        subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], check=False, timeout=600,
                       capture_output=True, env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
        if not shutil.which("chromium"):
            subprocess.run(["apt-get", "update", "-q"], check=False, timeout=300, capture_output=True)
            subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], check=False, timeout=600,
                           capture_output=True, env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    except (OSError, subprocess.TimeoutExpired):
        return None
    return shutil.which("chromium")


@pytest.fixture(scope="session")
def chromium():
    path = _chromium()
    if path is None:
        pytest.skip("headless Chromium is not installed and cannot be installed (not root, or apt-get failed)")
    return path


def _chrome(chromium: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_page_renders_in_headless_chromium(small_store, tmp_path, chromium):
    from PIL import Image

    torch.manual_seed(0)
    model = ToyAttention(vocab_size=len(small_store.root["tokens"].attrs["vocabulary"])).eval()
    a = make_run(tmp_path / "run_a", small_store, metrics=METRICS_A, model=model)
    b = make_run(tmp_path / "run_b", small_store, metrics=METRICS_B, sims=np.random.default_rng(0).normal(size=(6, 30)))
    s = report([a, b], tmp_path / "out", n_captions=3, n_images=2, n_attention=1)
    url = s.path.resolve().as_uri()
    shot = tmp_path / "shot.png"
    r = _chrome(chromium, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1200,1600", url)
    assert shot.is_file(), r.stderr[-2000:]
    console = [ln for ln in r.stderr.splitlines() if "CONSOLE" in ln or "ERR_" in ln or "Uncaught" in ln]
    assert console == [], console
    with Image.open(shot) as im:
        px = np.asarray(im.convert("RGB"))
    assert px.shape[0] >= 1000 and len(np.unique(px.reshape(-1, 3), axis=0)) > 50  # not a blank page
    dom = _chrome(chromium, tmp_path / "profile2", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert '<table class="metrics" id="metrics">' in dom.stdout
    assert re.search(r'<img src="data:image/jpeg;base64,[A-Za-z0-9+/=]{100,}', dom.stdout)
    assert "<svg" in dom.stdout


# real trained runs (issues #6 and #7), when the trainer exists ------------------------------------
def _trainer():
    try:
        from vsekit.train import evaluate, train
        from vsekit.train.demo import pixel_features
    except ImportError as exc:
        pytest.skip(f"the trainer (vsekit.train.train / evaluate, issue #6) is not importable: {exc}")
    return train, evaluate, pixel_features


def test_end_to_end_trained_seam_run(small_store, tmp_path):
    """Train SEAM-E for 2 epochs, evaluate, report: table = metrics.json, top-5 = sims_test.npy,
    hop strips equal to the model's own attention."""
    train, evaluate, pixel_features = _trainer()
    pixel_features(small_store, "pixels", side=4, bins=2)
    run = tmp_path / "seam"
    train(small_store.path, "pixels", "seam-e", run, presets=["seam-e", "demo"], epochs=2, batch_size=16,
          embed_dim=16, word_dim=16, model_args={"hops": 3, "att_units": 8}, progress=False)
    evaluate([run], progress=False)
    s = report([run], tmp_path / "out", n_captions=4, n_images=3, n_attention=1)
    doc = json.loads((run / "metrics.json").read_text())
    p = parse_page(s.path)
    cells = {(c["data-protocol"], c["data-metric"]): float(c["data-value"]) for c in p.cells}
    expect = {(proto, k.replace("_", ".", 1) if k != "rsum" else k): v
              for proto, m in doc["protocols"].items() for k, v in m.items() if k != "folds"}
    assert expect and cells == expect
    sims = np.load(run / "sims_test.npy")
    data = json.loads((tmp_path / "out" / "report.json").read_text())["runs"][0]
    assert data["examples"]["source"] == "saved similarities (sims_test.npy)"
    for c in data["examples"]["captions"]:
        assert c["top"] == np.argsort(-sims[:, c["caption"]], kind="stable")[:5].tolist()
    for e in data["examples"]["images"]:
        assert e["top"] == np.argsort(-sims[e["image"]], kind="stable")[:5].tolist()
    assert p.imgs and not p.missing
    assert all(small_store.image_file(int(i["data-image-row"])).is_file() for i in p.imgs)
    # the hop strips are the model's own A (Lin et al.) for that caption
    from vsekit.report import model_io
    from vsekit.train.checkpoint import load_model

    (att,) = data["attention"]
    assert [v["kind"] for v in att["views"]] == ["words"]
    model, _ = load_model(run)
    caps = small_store.captions_of_split("test")
    tok, lengths = model_io.read_tokens(small_store, caps[[att["caption"]]])
    with torch.no_grad():
        enc = model.txt_enc
        a = enc.att[0].attention(enc.embed(tok), torch.ones_like(tok, dtype=torch.bool))[0].numpy()
    assert att["views"][0]["shape"] == list(a.shape) == [3, int(lengths[0])]
    from vsekit.report.attention import pair_attention

    f, _ = model_io.read_features(small_store, "pixels", small_store.split_rows("test")[[att["image"]]])
    (view,) = pair_attention(model, f, None, tok, lengths)
    assert np.allclose(view.weights, a, atol=1e-6)
    assert (run / "curves.png").is_file() and "validation rsum" in s.path.read_text()


def test_end_to_end_trained_sman_run_shows_grid_steps(small_store, tmp_path):
    """SMAN on the 2×2 grid: attention heat maps for steps 1 and 2 and word strips for both steps."""
    train, evaluate, _ = _trainer()
    run = tmp_path / "sman"
    train(small_store.path, "grid", "sman", run, epochs=1, batch_size=16, embed_dim=16, word_dim=16,
          progress=False)
    s = report([run], tmp_path / "out", n_captions=3, n_images=2, n_attention=1)
    data = json.loads((tmp_path / "out" / "report.json").read_text())["runs"][0]
    assert data["examples"]["source"].startswith("the run's model")
    assert any("no test evaluation" in n for n in s.notes)
    (att,) = data["attention"]
    kinds = [(v["kind"], v["title"]) for v in att["views"]]
    assert ("grid", "grid weights, step 1") in kinds and ("grid", "grid weights, step 2") in kinds
    assert [t for k, t in kinds if k == "words"] == ["word weights, step 1", "word weights, step 2"]
    assert s.path.read_text().count('class="heat"') == 2


@pytest.mark.parametrize("n_words", [4, 5])
def test_sman_word_weights_are_never_taken_for_grid_maps(n_words):
    """A caption with as many words as the grid has cells (here 2x2 = 4) gives the same grid views as
    any other: each grid map is a softmax over cells (sums to 1 over G*G), never the word softmax."""
    from vsekit.report.attention import pair_attention
    from vsekit.models import create_model

    torch.manual_seed(0)
    model = create_model("sman", img_shape=(2, 2, 8), vocab_size=30, embed_dim=16, word_dim=8).eval()
    feats = torch.randn(1, 2, 2, 8)
    tokens = torch.arange(1, n_words + 1)[None]
    views = pair_attention(model, feats, None, tokens, torch.tensor([n_words]))
    grids = [v for v in views if v.kind == "grid"]
    words = [v for v in views if v.kind == "words"]
    assert [v.title for v in grids] == ["grid weights, step 1", "grid weights, step 2"]
    assert words and all(v.weights.shape[-1] == n_words for v in words)
    for g in grids:
        assert g.weights.shape == (2, 2) and np.isclose(g.weights.sum(), 1.0)
        assert not any(w.weights.size == 4 and np.allclose(np.sort(w.weights.ravel()), np.sort(g.weights.ravel()))
                       for w in words)


# issue 24: what a reader of the page sees ----------------------------------------------------------
class Cards(HTMLParser):
    """The attention cards (div.att) with their images, and the no-attention notes."""

    def __init__(self):
        super().__init__()
        self.cards: list[dict] = []
        self.notes: list[str] = []
        self._depth = 0
        self._in_note = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "div" and "att" in classes:
            self.cards.append(dict(a, imgs=[]))
            self._depth = 1
        elif tag == "div" and self._depth:
            self._depth += 1
        if tag == "img" and self._depth:
            self.cards[-1]["imgs"].append(a)
        if tag == "div" and "noatt" in classes:
            self._in_note = True
            self.notes.append("")

    def handle_endtag(self, tag):
        if tag == "div" and self._depth:
            self._depth -= 1
        if tag == "div":
            self._in_note = False

    def handle_data(self, data):
        if self._in_note:
            self.notes[-1] += data


def _cards(path: Path) -> Cards:
    c = Cards()
    c.feed(path.read_text())
    return c


def _sgraf_run(tmp_path, store, mode, global_module, name=None):
    from vsekit.models import create_model

    kw = {"img_shape": [4, 8], "vocab_size": len(store.root["tokens"].attrs["vocabulary"]), "embed_dim": 16,
          "word_dim": 8, "sim_dim": 8, "global_module": global_module, "temde_divisions": 2,
          "temde_centroids": 4, "temde_dim": 2}
    torch.manual_seed(0)
    model = create_model(mode, **kw).eval()
    return make_run(tmp_path / (name or f"{mode}-{global_module}"), store, model=model, name=mode,
                    model_kwargs=kw, features="regions", metrics=METRICS_A)


@pytest.mark.parametrize("other, shared", [(14.96, True), (14.94, False)])
def test_best_mark_goes_to_every_run_showing_the_best_value(small_store, tmp_path, other, shared):
    import copy

    ma, mb = copy.deepcopy(METRICS_A), copy.deepcopy(METRICS_A)
    ma["coco-1k"]["i2t"]["r1"], mb["coco-1k"]["i2t"]["r1"] = 15.04, other
    a = make_run(tmp_path / "a", small_store, metrics=ma)
    b = make_run(tmp_path / "b", small_store, metrics=mb)
    html = report([a, b], tmp_path / "out", n_captions=0, n_images=0, n_attention=0).path.read_text()
    found = re.findall(r'<td class="([a-z]*)" data-run="(a|b)" data-protocol="coco-1k" '
                       r'data-metric="i2t\.r1"[^>]*>([^<]*)</td>', html)
    shown = {run: text for _, run, text in found}
    starred = {run for cls, run, _ in found if cls == "best"}
    assert shown["a"] == "15.0" and shown["b"] == ("15.0" if shared else "14.9")
    assert starred == ({"a", "b"} if shared else {"a"})


def test_attention_cards_show_the_image_they_name(small_store, tmp_path):
    run = _sgraf_run(tmp_path, small_store, "saf", "self-attention")
    s = report([run], tmp_path / "out", n_captions=3, n_images=0, n_attention=3)
    data = json.loads((tmp_path / "out" / "report.json").read_text())["runs"][0]
    rows = small_store.split_rows("test")
    cards = _cards(s.path).cards
    assert len(cards) == 3 and len(data["attention"]) == 3
    html = s.path.read_text()
    assert html.count("with its image") == 3
    for card, att in zip(cards, data["attention"]):
        assert att["views"] and int(card["data-caption"]) == att["caption"]
        assert [int(i["data-image-row"]) for i in card["imgs"]] == [int(rows[att["image"]])]
        assert card["imgs"][0]["src"].startswith("data:image/jpeg;base64,")


def test_models_without_word_attention_are_described_as_what_they_are(small_store, tmp_path):
    sgr = _sgraf_run(tmp_path, small_store, "sgr", "t-emde")
    saf = _sgraf_run(tmp_path, small_store, "saf", "none")
    s = report([sgr, saf], tmp_path / "out", n_captions=1, n_images=0, n_attention=1)
    notes = _cards(s.path).notes
    assert len(notes) == 2
    assert "similarity graph reasoning over its local (word–region) and global alignment vectors" in notes[0]
    assert "T-EMDE" in notes[0] and "embedding model" not in notes[0]
    assert "SAF scores a pair by filtering its local (word–region) alignment vectors" in notes[1]
    assert "embedding model" not in s.path.read_text()


def test_image_query_shows_its_correct_caption_below_the_top_k(small_store, tmp_path):
    test_caps = small_store.captions_of_split("test")
    test_imgs = small_store.split_rows("test")
    cap_img = np.searchsorted(test_imgs, small_store.caption_images()[test_caps])
    sims = np.random.default_rng(7).uniform(0.5, 1.0, size=(6, 30))
    for g in range(6):
        own = np.flatnonzero(cap_img == g)
        sims[g, own] = 0.1 + 0.01 * np.arange(len(own))  # its own captions score lowest
    best_own = {g: int(np.flatnonzero(cap_img == g)[-1]) for g in range(6)}
    sims[1, :] = 0.3                                   # image 1: every caption tied
    best_own[1] = int(np.flatnonzero(cap_img == 1)[0])  # ties go to the lower index
    run = make_run(tmp_path / "run", small_store, metrics=METRICS_A, sims=sims)
    s = report([run], tmp_path / "out", n_captions=0, n_images=6, k=5)
    p = parse_page(s.path)
    assert len(p.imgq) == 6
    texts = small_store.caption_text()
    for block in p.imgq:
        g = int(block["data-image"])
        (li,) = [li for li in block["caps"] if "data-correct" in li]
        j = best_own[g]
        assert int(li["data-caption"]) == j and "ok" in li["class"].split()
        rank = 1 + int(np.sum(sims[g] > sims[g, j]))
        place = 1 + int(np.sum(sims[g] > sims[g, j])) + int(np.sum(sims[g, :j] == sims[g, j]))
        assert int(li["data-rank"]) == rank and int(li["value"]) == place
        assert li["text"].startswith(str(texts[test_caps[j]]))
        assert f"correct, rank {rank}" in li["text"]
        if g == 1:
            assert rank == 1 and place == j + 1 > 5
            # why it is listed after the top 5 although its rank is 1, in words
            assert f"listed #{place} because {place - 1} caption(s) of the same score come first" in li["text"]
        else:
            assert rank == 26 and place == 26  # 25 other captions score higher


def test_saf_plus_sgr_ensemble_row_is_called_sgraf(small_store, tmp_path):
    saf = make_run(tmp_path / "saf", small_store, metrics=METRICS_A, name="saf")
    sgr = make_run(tmp_path / "sgr-temde", small_store, metrics=METRICS_B, name="sgr")
    vse = make_run(tmp_path / "vse2", small_store, metrics=METRICS_B, name="vse")
    doc = {"runs": ["runs/saf", "runs/sgr-temde"], "protocols": METRICS_B}  # paths as evaluate was given them
    (saf / "metrics_ensemble.json").write_text(json.dumps(doc))
    (vse / "metrics_ensemble.json").write_text(json.dumps({"runs": [str(vse), str(saf)], "protocols": METRICS_B}))
    html = report([saf, sgr, vse], tmp_path / "out", n_captions=0, n_images=0,
                  n_attention=0).path.read_text()
    rows = re.findall(r'<tr><td class="run">([^<]*)</td><td class="run">([^<]*)</td>', html)
    assert ("SGRAF (saf + sgr-temde)", "SGRAF: mean of the SAF and SGR similarities") in rows
    assert ("vse2 + saf", "ensemble: mean of similarities") in rows
    assert 'data-run="SGRAF (saf + sgr-temde)"' in html
