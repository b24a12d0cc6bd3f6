"""The report's HTML: one static page with inline CSS, SVG charts and base64 images (no JS, no network).

Elements carry ``data-*`` attributes (run, metric, value, image rows) so that tests and scripts can
read the page back without scraping text.
"""

from __future__ import annotations

import datetime as _dt
from html import escape
from typing import Any, Sequence

import numpy as np

from .images import heat_rgb
from .runs import DIRECTION_TITLES, DIRECTIONS, HIGHER_IS_BETTER, METRICS, RunInfo

CSS = """
body{font:14px/1.4 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:0 auto;max-width:1200px;
padding:0 18px 40px;color:#222;background:#fafafa}
h1{font-size:22px;margin:18px 0 4px}h2{font-size:18px;border-bottom:2px solid #ddd;padding-bottom:3px;margin-top:28px}
h3{font-size:15px;margin:16px 0 6px}.sub{color:#666}
table.metrics{border-collapse:collapse;background:#fff;margin:8px 0;font-size:12px;width:100%}
.tablewrap{overflow-x:auto;max-width:100%}
table.metrics th,table.metrics td{border:1px solid #ccc;padding:2px 4px;text-align:right;white-space:nowrap}
table.metrics th{background:#f0f0f0;text-align:center;white-space:normal}
table.metrics td.run{text-align:left;white-space:normal;overflow-wrap:anywhere;max-width:14em}
tr.warning td{background:#fff7e0;color:#6b4e00;text-align:left;white-space:normal;font-size:12px}
span.warn{color:#b07800;font-weight:700;cursor:help}
td.best{font-weight:700;background:#e3f3e3}td.best::after{content:" \\2605";color:#2a7d2a;font-size:11px}
td.none{color:#999;text-align:center!important}
.note{background:#fff7e0;border-left:4px solid #e0a800;padding:4px 10px;margin:4px 0}
.charts{display:flex;flex-wrap:wrap;gap:10px}.chart text.ct{font-size:13px;font-weight:600}
.chart text.tk{font-size:10px;fill:#444}.chart text.lg{font-size:10px}
.nochart{width:360px;height:80px;border:1px dashed #bbb;padding:10px;color:#777}
.ex{background:#fff;border:1px solid #ddd;border-radius:4px;padding:8px;margin:8px 0}
.thumbs{display:flex;gap:6px;flex-wrap:wrap;align-items:flex-start}
figure{margin:0;text-align:center;font-size:11px;color:#555}
figure img{display:block;border:3px solid transparent;border-radius:3px}
figure.ok img,figure.ok .missing{border-color:#2a9d2a}figure.ok figcaption{color:#2a7d2a;font-weight:700}
.missing{width:96px;height:96px;display:flex;align-items:center;justify-content:center;background:#eee;
border:3px dashed #c66;color:#933;font-size:10px;word-break:break-all;padding:2px;box-sizing:border-box}
ol.caps{margin:4px 0 0 0;padding-left:22px}ol.caps li.ok{color:#2a7d2a;font-weight:600}
ol.caps li.ok::after{content:" \\2714"}.imgq,.attpair{display:flex;gap:12px;align-items:flex-start}
table.strip{border-collapse:collapse;font-size:12px;margin:4px 0}table.strip td{padding:2px 4px;text-align:center}
table.strip td.h{color:#666;text-align:right;font-size:10px}.grids{display:flex;gap:10px;flex-wrap:wrap}
code{background:#eee;padding:0 3px}
"""


def _fmt(v: float | None, metric: str) -> str:
    if v is None:
        return "–"
    if metric.endswith(("medr", "meanr")):
        return f"{v:.1f}" if v != int(v) else f"{int(v)}"
    if metric.endswith("mrr"):
        return f"{v:.3f}"
    return f"{v:.1f}"


def best_cells(rows: Sequence[dict[str, float]], columns: Sequence[str]) -> dict[str, set[int]]:
    """For each column, the indices of the rows holding its best value (max, or min for ranks).

    Ties are judged on the value as the table shows it: two runs that both show "15.0" (15.04 and
    14.96) share the mark, since the reader cannot tell them apart.
    """
    best: dict[str, set[int]] = {}
    for col in columns:
        vals = [(i, r[col]) for i, r in enumerate(rows) if r.get(col) is not None]
        if len(vals) < 2:
            best[col] = set()
            continue
        target = _fmt((max if HIGHER_IS_BETTER[col] else min)(v for _, v in vals), col)
        best[col] = {i for i, v in vals if _fmt(v, col) == target}
    return best


def metrics_table(runs: Sequence[RunInfo]) -> str:
    """Runs side by side, one row per (run, protocol); best value per column marked within a protocol."""
    present = {k for r in runs for vals in (r.metrics or {}).values() for k in vals}
    per_dir = [(m, label) for m, label, _ in METRICS if any(f"{d}.{m}" in present for d in DIRECTIONS)]
    columns = [f"{d}.{m}" for d in DIRECTIONS for m, _ in per_dir] + ["rsum"]
    protocols: list[str] = []
    for r in runs:
        for p in r.metrics or {}:
            if p not in protocols:
                protocols.append(p)
    head = ['<table class="metrics" id="metrics"><thead><tr><th rowspan="2">run</th>'
            '<th rowspan="2">model</th><th rowspan="2">protocol</th>']
    head += [f'<th colspan="{len(per_dir)}">{escape(DIRECTION_TITLES[d])}</th>' for d in DIRECTIONS]
    head.append('<th rowspan="2">rsum</th></tr><tr>')
    head += [f"<th>{escape(label)}</th>" for _ in DIRECTIONS for _, label in per_dir]
    head.append("</tr></thead><tbody>")
    body: list[str] = []
    for proto in protocols:
        rows = [(r, r.metrics[proto]) for r in runs if r.metrics and proto in r.metrics]
        best = best_cells([v for _, v in rows], columns)
        for i, (run, vals) in enumerate(rows):
            warned = metric_warnings(run, proto)
            mark = (f' <span class="warn" title="{escape(" ".join(warned))}">&#9888;</span>' if warned else "")
            cells = [f'<td class="run">{escape(run.name)}</td><td class="run">{escape(run.label)}</td>'
                     f'<td class="run">{escape(proto or "test")}{mark}</td>']
            for col in columns:
                v = vals.get(col)
                cls = "best" if i in best[col] else ("none" if v is None else "")
                cells.append(f'<td class="{cls}" data-run="{escape(run.name)}" data-protocol="{escape(proto)}" '
                             f'data-metric="{col}" data-value="{"" if v is None else repr(float(v))}">'
                             f'{_fmt(v, col)}{mark if col == "rsum" else ""}</td>')
            body.append("<tr>" + "".join(cells) + "</tr>")
            body += [f'<tr class="warning" data-run="{escape(run.name)}" data-protocol="{escape(proto)}">'
                     f'<td colspan="{len(columns) + 3}">&#9888; warning of these figures '
                     f'(metrics.json): {escape(w)}</td></tr>' for w in warned]
    for run in runs:
        if not run.metrics:
            body.append(f'<tr><td class="run">{escape(run.name)}</td><td class="run">{escape(run.label)}'
                        f'</td><td class="none" colspan="{len(columns) + 1}">no test evaluation — run '
                        f'<code>vsekit evaluate {escape(str(run.path))}</code></td></tr>')
    return '<div class="tablewrap">' + "".join(head + body) + "</tbody></table></div>"


def metric_warnings(run: RunInfo, protocol: str) -> list[str]:
    """The warnings ``metrics.json`` records for a row: those naming its protocol, and those naming none."""
    doc = run.raw_metrics if isinstance(run.raw_metrics, dict) else {}
    warnings = [str(w) for w in (doc.get("warnings") or []) if w]
    named = [w for w in warnings if "--protocol " in w]
    own = [w for w in named if f"--protocol {protocol} " in w or w.rstrip().endswith(f"--protocol {protocol}")]
    return own + [w for w in warnings if w not in named]


def _figure(uri: str | None, path: str, caption: str, ok: bool, attrs: str, size: int) -> str:
    cls = ' class="ok"' if ok else ""
    if uri is None:
        body = (f'<div class="missing" title="{escape(path)}" {attrs}>image not on disk: '
                f'{escape(path.rsplit("/", 1)[-1])}</div>')
    else:
        body = f'<img src="{uri}" alt="{escape(path)}" title="{escape(path)}" style="max-width:{size}px" {attrs}>'
    return f"<figure{cls}>{body}<figcaption>{escape(caption)}</figcaption></figure>"


def word_strip(words: Sequence[str], weights: np.ndarray, title: str) -> str:
    """A heat strip per row (hop) of ``weights`` (rows, L) over the caption's words, plus their mean.

    Each row is coloured from its own minimum (dark) to its maximum (bright), so the words a hop
    prefers stand out even when its weights are close to uniform; the tooltip gives the weight.
    """
    w = np.atleast_2d(np.asarray(weights, dtype=np.float64))
    rows = list(w) + ([w.mean(axis=0)] if len(w) > 1 else [])
    out = [f'<div class="strip-block"><b>{escape(title)}</b> <span class="sub">(each row from its min, dark, '
           f'to its max, bright; hover for the weight)</span><table class="strip">']
    for i, row in enumerate(rows):
        lo, span = row.min(), row.max() - row.min()
        label = f"hop {i + 1}" if i < len(w) and len(w) > 1 else ("mean" if len(w) > 1 else "")
        cells = []
        for word, v in zip(words, row):
            x = float((v - lo) / span) if span > 0 else 1.0
            fg = "#000" if x > 0.55 else "#fff"
            cells.append(f'<td style="background:{heat_rgb(x)};color:{fg}" title="{v:.3f}">{escape(word)}</td>')
        out.append(f'<tr><td class="h">{label}</td>{"".join(cells)}</tr>')
    out.append("</table></div>")
    return "".join(out)


def page(title: str, runs: Sequence[RunInfo], sections: Sequence[tuple[str, str]], notes: Sequence[str],
         meta: dict[str, Any]) -> str:
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = ['<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width,initial-scale=1">',
             f"<title>{escape(title)}</title><style>{CSS}</style></head><body>",
             f"<h1>{escape(title)}</h1>",
             f'<div class="sub">{len(runs)} run(s) · split <b>{escape(str(meta.get("split", "")))}</b> · '
             f'generated {now} by vsekit {escape(str(meta.get("version", "")))}</div>']
    parts.append("<ul class='runs'>" + "".join(
        f"<li><b>{escape(r.name)}</b>: model <code>{escape(r.label)}</code>, folder "
        f"<code>{escape(str(r.path))}</code></li>" for r in runs) + "</ul>")
    parts += [f'<div class="note">{escape(n)}</div>' for n in notes]
    for heading, html in sections:
        parts.append(f"<h2>{escape(heading)}</h2>{html}")
    parts.append("</body></html>")
    return "\n".join(parts)
