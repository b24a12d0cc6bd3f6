"""``vsekit report``: one static HTML page per set of training runs (docs/report.md).

The page shows the runs side by side: test metrics in the papers' layout, learning curves (inline
SVG), retrieval examples on the test split and attention maps, with images inlined as base64
thumbnails, so the folder holds one ``index.html`` (plus ``report.json``) and needs no server. Cost is
bounded by the sample, not the test set; anything missing is said on the page instead of failing.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any, Sequence


from ..version import __version__
from .examples import Examples, SimsFileSource, retrieval_examples
from .images import heatmap_uri, thumbnail_uri
from .page import _figure, metrics_table, page, word_strip
from .plots import DASHES, line_chart
from .runs import RunInfo, load_ensembles, load_run

__all__ = ["report", "ReportSummary", "load_run"]


@dataclass
class ReportSummary:
    """What ``report`` wrote and what it had to leave out."""

    path: Path
    runs: list[str]
    notes: list[str] = field(default_factory=list)
    n_caption_examples: int = 0
    n_image_examples: int = 0
    n_attention: int = 0
    missing_images: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class _RunExamples:
    run: RunInfo
    examples: Examples | None = None
    data: Any = None                       # model_io.SplitData
    texts: dict[int, str] = field(default_factory=dict)
    attention: list[tuple[int, int, list]] = field(default_factory=list)  # (caption, image, views)
    words: dict[int, list[str]] = field(default_factory=dict)
    no_attention: str = ""                 # why the model shows no attention view


def report(runs: Sequence[str | Path], out: str | Path, *, split: str = "test", n_captions: int = 8,
           n_images: int = 6, n_attention: int = 3, k: int = 5, seed: int = 0,
           store: str | Path | None = None, device: str = "cpu", block: int = 256,
           thumb_size: int = 96, title: str | None = None) -> ReportSummary:
    """Write ``out/index.html`` (and ``out/report.json``) for the run folders ``runs``."""
    t0 = time.perf_counter()
    if not runs:
        raise ValueError("give at least one run folder")
    for name, v in (("--caption-queries", n_captions), ("--image-queries", n_images), ("--attention", n_attention)):
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    if k < 1:
        raise ValueError(f"--top-k must be >= 1, got {k}")
    infos = [load_run(r) for r in runs]
    _unique_names(infos)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = ReportSummary(path=out / "index.html", runs=[str(r.path) for r in infos])
    notes = [f"{r.name}: {n}" for r in infos for n in r.notes]

    ensembles = load_ensembles(infos)   # `vsekit evaluate A B` (SGRAF = SAF + SGR): a row as in the terminal
    sections = [("Test metrics", metrics_table(infos + ensembles)), ("Learning curves", _curves(infos))]
    results = [_examples_of(r, split=split, n_captions=n_captions, n_images=n_images,
                            n_attention=n_attention, k=k, seed=seed, store=store, device=device,
                            block=block, notes=notes) for r in infos]
    missing: set[str] = set()
    sections.append((f"Retrieval examples ({split} split)",
                     "".join(_examples_html(res, thumb_size, missing, summary) for res in results)))
    sections.append(("Attention", "".join(_attention_html(res, thumb_size, missing, summary) for res in results)))
    if missing:
        notes.append(f"{len(missing)} example image(s) are no longer on disk (shown as placeholders), "
                     f"e.g. {sorted(missing)[0]}")
    summary.missing_images = sorted(missing)
    summary.notes = notes
    html = page(title or "vsekit run report", infos, sections, notes, {"split": split, "version": __version__})
    summary.path.write_text(html, encoding="utf-8")
    (out / "report.json").write_text(json.dumps(_json_summary(infos, results, notes, split), indent=1))
    summary.seconds = time.perf_counter() - t0
    return summary


def _unique_names(infos: list[RunInfo]) -> None:
    seen: Counter[str] = Counter()
    for r in infos:
        seen[r.name] += 1
        if seen[r.name] > 1:
            r.name = f"{r.name} ({seen[r.name]})"


# learning curves ----------------------------------------------------------------------------------
def _xs(history: list[dict[str, float]]) -> list[float]:
    ep = [h.get("epoch") for h in history]
    if all(e is not None for e in ep) and all(b > a for a, b in zip(ep, ep[1:])):
        return [float(e) for e in ep]
    return [float(i + 1) for i in range(len(history))]  # restarts (curriculum, resume): log order


def _curves(infos: list[RunInfo]) -> str:
    r1, rsum, loss, marks = [], [], [], []
    for i, r in enumerate(infos):   # one colour per run in every chart; one line style per direction
        xs = _xs(r.history)
        marks += [(x, f"{r.name}: switch to the max loss") for x, h in zip(xs, r.history) if h.get("switch")]
        for d, label in (("i2t", "i→t"), ("t2i", "t→i")):
            r1.append((f"{r.name} {label}", xs, [h.get(f"{d}.r1") for h in r.history],
                       {"group": i, "dash": DASHES[d]}))
        rsum.append((r.name, xs, [h.get("rsum") for h in r.history], {"group": i}))
        loss.append((r.name, xs, [h.get("loss") for h in r.history], {"group": i}))
    charts = [line_chart(r1, title="validation R@1", ylabel="R@1 (%)"),
              line_chart(rsum, title="validation rsum", ylabel="rsum", marks=marks)]
    groups = loss_scales(loss)
    for group in groups:   # one chart per scale: a loss several times another's would flatten it
        title = "training loss" if len(groups) == 1 else f"training loss ({', '.join(s[0] for s in group)})"
        charts.append(line_chart(group, title=title, ylabel="loss"))
    return f'<div class="charts">{"".join(charts)}</div>'

#: runs whose typical losses differ by more than this factor get separate loss charts
LOSS_SCALE_RATIO = 3.0


def loss_scales(series: list) -> list[list]:
    """``(label, xs, ys, style)`` loss series grouped so that one chart holds losses of one scale:
    sorted by their median, a new group starts where a median is over LOSS_SCALE_RATIO times the
    group's smallest. Series with no values go with the first group (they draw nothing)."""
    import statistics

    def median(s) -> float | None:
        vals = [abs(v) for v in s[2] if v is not None]
        return statistics.median(vals) if vals else None

    valued = sorted((s for s in series if median(s) is not None), key=median)
    empty = [s for s in series if median(s) is None]
    groups: list[list] = []
    for s in valued:
        if groups and median(s) <= LOSS_SCALE_RATIO * max(median(groups[-1][0]), 1e-12):
            groups[-1].append(s)
        else:
            groups.append([s])
    if not groups:
        return [empty]
    groups[0] += empty
    return groups


# retrieval examples -------------------------------------------------------------------------------
def _examples_of(run: RunInfo, *, split, n_captions, n_images, n_attention, k, seed, store, device, block,
                 notes) -> _RunExamples:
    from . import model_io

    res = _RunExamples(run)
    feats = model_io.features_name(run)
    try:
        st = model_io.open_store(run, store)
        res.data = model_io.SplitData.of(st, split, feats)
    except Exception as exc:  # noqa: BLE001 - the page says why
        notes.append(f"{run.name}: no retrieval examples: {exc}")
        return res
    if not len(res.data.image_rows) or not len(res.data.caption_rows):
        notes.append(f"{run.name}: the store has no {split} images or captions: no retrieval examples")
        return res
    source, model = None, None
    sims = run.sims_file(split)
    if sims is not None:
        try:
            cand = SimsFileSource(sims)
            if (cand.n_images, cand.n_captions) == (len(res.data.image_rows), len(res.data.caption_rows)):
                source = cand
            else:
                notes.append(f"{run.name}: {sims.name} is {cand.n_images}×{cand.n_captions}, the {split} split is "
                             f"{len(res.data.image_rows)}×{len(res.data.caption_rows)}; using the model instead")
        except (OSError, ValueError) as exc:
            notes.append(f"{run.name}: cannot read {sims.name}: {exc}")
    if run.checkpoint is not None and feats:
        try:
            model = model_io.load_model(run, device)
        except Exception as exc:  # noqa: BLE001
            notes.append(f"{run.name}: cannot load the model from {run.checkpoint.name}: {exc}")
    if source is None and model is not None:
        source = model_io.ModelSource(model, res.data, feats, device=device, block=block)
    if source is None:
        notes.append(f"{run.name}: no retrieval examples (no sims_{split}.npy and no loadable checkpoint)")
        return res
    cap_text = _LazyTexts(res.data)
    try:
        res.examples = retrieval_examples(source, res.data.caption_image, cap_text, n_captions=n_captions,
                                          n_images=n_images, k=k, seed=seed)
    except Exception as exc:  # noqa: BLE001
        notes.append(f"{run.name}: retrieval examples failed: {exc}")
        return res
    for e in res.examples.images:  # the texts of the captions shown for image queries
        for j in e.top + ([] if e.correct is None else [e.correct]):
            cap_text[j]
    res.texts = cap_text.cache
    if model is not None and n_attention:
        _attention_of(res, model, feats, n_attention, device, notes)
    elif n_attention:
        notes.append(f"{run.name}: no attention maps (no loadable checkpoint)")
    return res


class _LazyTexts:
    """Caption texts read on demand (only the few shown), cached."""

    def __init__(self, data):
        self.data, self.cache = data, {}

    def __getitem__(self, j: int) -> str:
        j = int(j)
        if j not in self.cache:
            self.cache[j] = self.data.caption_texts([j])[0]
        return self.cache[j]


def _attention_of(res: _RunExamples, model, feats: str, n: int, device: str, notes: list[str]) -> None:
    from . import model_io
    from .attention import no_attention_reason, pair_attention

    res.no_attention = no_attention_reason(model, res.run.model_name)
    vocab = res.data.tokens.vocabulary if res.data.tokens is not None else []
    pairs = [(c.caption, c.image) for c in res.examples.captions][:n]
    try:
        for cap, img in pairs:
            f, counts = model_io.read_features(res.data.store, feats, res.data.image_rows[[img]])
            tokens, lengths = model_io.read_tokens(res.data.store, res.data.caption_rows[[cap]], res.data.tokens)
            views = pair_attention(model, f.to(device), None if counts is None else counts.to(device),
                                   tokens.to(device), lengths.to(device))
            ids = tokens[0, :int(lengths[0])].tolist()
            res.words[cap] = [vocab[i] if 0 <= i < len(vocab) else str(i) for i in ids]
            res.attention.append((cap, img, views))
    except Exception as exc:  # noqa: BLE001
        notes.append(f"{res.run.name}: attention maps failed: {exc}")


def _examples_html(res: _RunExamples, size: int, missing: set[str], summary: ReportSummary) -> str:
    run = res.run
    head = f'<h3>{escape(run.name)} <span class="sub">({escape(run.label)})</span></h3>'
    if res.examples is None:
        return head + '<div class="note">no retrieval examples for this run (see the notes above)</div>'
    ex, data = res.examples, res.data
    out = [head, f'<div class="sub">scored by {escape(ex.source)}; {len(ex.captions)} sampled captions '
                 f'(text → image) and {len(ex.images)} sampled images (image → text)</div>']
    for c in ex.captions:
        figs = []
        for rank, (g, s) in enumerate(zip(c.top, c.top_scores), 1):
            figs.append(_thumb(data, g, f"#{rank} {'✓ ' if g == c.image else ''}{s:.3f}", g == c.image,
                               size, missing, f'data-image="{g}" data-rank="{rank}"'))
        if c.image not in c.top:  # below the top k (a tie can put rank k behind the k shown)
            tied = (f"; listed #{c.position}: images of the same score come first, R@K counts the tie in "
                    f"its favour" if c.position != c.rank else "")
            figs.append(_thumb(data, c.image, f"correct: rank {c.rank}{tied}", True, size, missing,
                               f'data-image="{c.image}" data-rank="{c.rank}" data-position="{c.position}" '
                               f'data-correct="1"'))
        out.append(f'<div class="ex capq" data-run="{escape(run.name)}" data-caption="{c.caption}" '
                   f'data-caption-row="{int(data.caption_rows[c.caption])}" data-correct="{c.image}" '
                   f'data-correct-rank="{c.rank}"><div>“{escape(c.text)}” '
                   f'<span class="sub">correct image at rank {c.rank}</span></div>'
                   f'<div class="thumbs">{"".join(figs)}</div></div>')
    for e in ex.images:
        items = "".join(
            f'<li class="{"ok" if m else ""}" data-caption="{j}">{escape(res.texts.get(j, ""))} '
            f'<span class="sub">({s:.3f})</span></li>'
            for j, s, m in zip(e.top, e.top_scores, e.matches))
        if e.correct is not None and not any(e.matches):  # its best own caption, below the top k
            # numbered by its place in the list; a tie lists captions of the same score before it, while
            # its rank (what R@K counts) gives the tie to it: say both, and why they differ
            tied = (f"; listed #{e.correct_position} because {e.correct_position - e.rank} caption(s) of "
                    f"the same score come first, and R@K counts the tie in its favour"
                    if e.correct_position != e.rank else "")
            items += (f'<li class="ok" value="{e.correct_position}" data-caption="{e.correct}" '
                      f'data-rank="{e.rank}" data-position="{e.correct_position}" data-correct="1">'
                      f'{escape(res.texts.get(e.correct, ""))} <span class="sub">({e.correct_score:.3f}; '
                      f'correct, rank {e.rank}{tied})</span></li>')
        fig = _thumb(data, e.image, f"image {int(data.image_rows[e.image])}", False, size, missing,
                     f'data-image="{e.image}"')
        out.append(f'<div class="ex imgq" data-run="{escape(run.name)}" data-image="{e.image}" '
                   f'data-image-row="{int(data.image_rows[e.image])}">{fig}<div>'
                   f'<div class="sub">its first correct caption at rank {e.rank} (of {e.n_captions} own)</div>'
                   f'<ol class="caps">{items}</ol></div></div>')
    summary.n_caption_examples += len(ex.captions)
    summary.n_image_examples += len(ex.images)
    return "".join(out)


def _thumb(data, local: int, caption: str, ok: bool, size: int, missing: set[str], attrs: str) -> str:
    path = data.image_file(local)
    uri = thumbnail_uri(path, size)
    if uri is None:
        missing.add(str(path))
    return _figure(uri, str(path), caption, ok, attrs + f' data-image-row="{int(data.image_rows[local])}"', size)


def _attention_html(res: _RunExamples, size: int, missing: set[str], summary: ReportSummary) -> str:
    run = res.run
    head = f'<h3>{escape(run.name)} <span class="sub">({escape(run.label)})</span></h3>'
    if not res.attention:
        return head + '<div class="note">no attention maps for this run</div>'
    if not any(views for _, _, views in res.attention):
        return head + (f'<div class="note noatt">{escape(run.model_name)} has no attention over words or grid '
                       f'cells: {escape(res.no_attention)}</div>')
    out = [head]
    for cap, img, views in res.attention:
        words = res.words.get(cap, [])
        fig = _thumb(res.data, img, f"image {int(res.data.image_rows[img])}", False, size, missing,
                     f'data-image="{img}"')
        parts = [f'<div class="sub">caption “{escape(res.texts.get(cap, ""))}” with its image</div>']
        grids = []
        for v in views:
            if v.kind == "words" and v.weights.shape[-1] == len(words):
                parts.append(word_strip(words, v.weights, v.title))
            elif v.kind == "grid":
                path = res.data.image_file(img)
                if thumbnail_uri(path, size) is None:
                    missing.add(str(path))
                grids.append(f'<figure><img class="heat" src="{heatmap_uri(v.weights, path, size + 64)}" '
                             f'alt="{escape(v.title)}"><figcaption>{escape(v.title)}</figcaption></figure>')
        if grids:
            parts.append(f'<div class="grids">{"".join(grids)}</div>')
        out.append(f'<div class="ex att" data-run="{escape(run.name)}" data-caption="{cap}" data-image="{img}">'
                   f'<div class="attpair">{fig}<div>{"".join(parts)}</div></div></div>')
        summary.n_attention += len(views)
    return "".join(out)


def _json_summary(infos, results, notes, split) -> dict[str, Any]:
    runs = []
    for r, res in zip(infos, results):
        item: dict[str, Any] = {"name": r.name, "path": str(r.path), "model": r.model_name,
                                "metrics": r.metrics, "epochs": len(r.history)}
        if res.examples is not None:
            d = res.data
            item["examples"] = {
                "source": res.examples.source,
                "captions": [{"caption": c.caption, "caption_row": int(d.caption_rows[c.caption]),
                              "image": c.image, "top": c.top, "scores": c.top_scores, "rank": c.rank}
                             for c in res.examples.captions],
                "images": [{"image": e.image, "image_row": int(d.image_rows[e.image]), "top": e.top,
                            "scores": e.top_scores, "matches": e.matches, "rank": e.rank,
                            "correct": e.correct}
                           for e in res.examples.images]}
            item["attention"] = [{"caption": c, "image": i, "views": [
                {"kind": v.kind, "title": v.title, "shape": list(v.weights.shape)} for v in views]}
                for c, i, views in res.attention]
        runs.append(item)
    return {"split": split, "vsekit_version": __version__, "runs": runs, "notes": notes}
