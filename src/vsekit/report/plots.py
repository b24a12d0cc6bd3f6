"""Learning curves as inline SVG line charts (no plotting library, no external files).

SVG keeps the page self-contained and sharp at any zoom, and a chart of a few hundred points is a
few kilobytes.
"""

from __future__ import annotations

import itertools
import math
from html import escape
from typing import Sequence

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
DASHES = {"i2t": "", "t2i": "6 3"}   # line style per retrieval direction: solid i→t, dashed t→i


def colour(i: int) -> str:
    """A distinct colour for run ``i``: the palette, then hues spread by the golden angle (never repeats)."""
    if i < len(PALETTE):
        return PALETTE[i]
    import colorsys

    r, g, b = colorsys.hls_to_rgb(((i - len(PALETTE)) * 0.381966 + 0.05) % 1.0, 0.42, 0.75)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


def nice_ticks(lo: float, hi: float, n: int = 5, integer: bool = False) -> list[float]:
    """About ``n`` round tick values covering [lo, hi] (whole numbers only when ``integer``)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    if integer:
        step = max(1.0, float(math.ceil(step)))
    start = math.floor(lo / step) * step
    ticks, t = [], start
    while t <= hi + step * 0.5 and len(ticks) < 50:
        ticks.append(round(t, 10))
        t += step
    return ticks


def _fmt(v: float) -> str:
    if v == int(v) and abs(v) < 1e6:
        return str(int(v))
    return f"{v:.3g}"


def line_chart(series: Sequence[tuple[str, Sequence[float], Sequence[float | None]]], *, title: str,
               xlabel: str = "epoch", ylabel: str = "", width: int = 380, height: int = 240,
               marks: Sequence[tuple[float, str]] = ()) -> str:
    """An SVG chart of ``(label, xs, ys[, style])`` series; None values are gaps. Empty → a note instead.

    ``style`` (optional dict): ``group`` picks the colour (one per run, so a run's two directions
    share it) and ``dash`` an SVG dash pattern (one per direction); by default series ``i`` gets
    colour ``i``, solid.

    ``marks`` are ``(x, label)`` vertical dashed lines (e.g. the curriculum's switch epoch).
    """
    series = [(s[0], s[1], s[2], s[3] if len(s) > 3 else {}) for s in series]
    pts = [(x, y) for _, xs, ys, _ in series for x, y in zip(xs, ys) if y is not None]
    if not pts:
        return (f'<div class="nochart"><b>{escape(title)}</b><br>'
                f'not logged in metrics.jsonl</div>')
    left, right, top, bottom = 52, 12, 26, 40
    height += 13 * len(series)  # the legend sits under the plot, one line per series
    pw, ph = width - left - right, height - top - bottom - 13 * len(series)
    xs_all = [p[0] for p in pts]
    ys_all = [p[1] for p in pts]
    xt = nice_ticks(min(xs_all), max(xs_all), 6, integer=all(float(x).is_integer() for x in xs_all))
    yt = nice_ticks(min(ys_all), max(ys_all), 5)
    x0, x1, y0, y1 = xt[0], xt[-1], yt[0], yt[-1]
    x1 = x1 if x1 > x0 else x0 + 1
    y1 = y1 if y1 > y0 else y0 + 1

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + ph - (y - y0) / (y1 - y0) * ph

    out = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
           f'<text x="{width / 2:.0f}" y="16" text-anchor="middle" class="ct">{escape(title)}</text>',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fff" stroke="#999"/>']
    for t in yt:
        y = sy(t)
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                   f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end" class="tk">{_fmt(t)}</text>')
    for t in xt:
        x = sx(t)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + ph}" y2="{top + ph + 4}" stroke="#999"/>'
                   f'<text x="{x:.1f}" y="{top + ph + 16}" text-anchor="middle" class="tk">{_fmt(t)}</text>')
    out.append(f'<text x="{left + pw / 2:.0f}" y="{top + ph + 30}" text-anchor="middle" class="tk">'
               f'{escape(xlabel)}</text>')
    if ylabel:
        out.append(f'<text transform="translate(12,{top + ph / 2:.0f}) rotate(-90)" text-anchor="middle" '
                   f'class="tk">{escape(ylabel)}</text>')
    for x, label in marks:
        if x0 <= x <= x1:
            out.append(f'<line x1="{sx(x):.1f}" x2="{sx(x):.1f}" y1="{top}" y2="{top + ph}" stroke="#888" '
                       f'stroke-dasharray="4 3"><title>{escape(label)}</title></line>')
    for i, (label, xs, ys, style) in enumerate(series):
        stroke = colour(int(style.get("group", i)))
        dash = style.get("dash") or ""
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        runs = itertools.groupby(zip(xs, ys), key=lambda p: p[1] is None)   # None values are gaps
        segs = [[(sx(x), sy(y)) for x, y in run] for gap, run in runs if not gap]
        for seg in segs:
            d = " ".join(f"{x:.1f},{y:.1f}" for x, y in seg)
            out.append(f'<polyline fill="none" stroke="{stroke}" stroke-width="1.8"{dash_attr} points="{d}"/>')
            out.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.4" fill="{stroke}"/>' for x, y in seg)
        ly = top + ph + 48 + 13 * i
        out.append(f'<line x1="{left}" x2="{left + 16}" y1="{ly - 5}" y2="{ly - 5}" stroke="{stroke}" '
                   f'stroke-width="2.5"{dash_attr}/>'
                   f'<text x="{left + 20}" y="{ly - 2}" class="lg">{escape(label)}</text>')
    out.append("</svg>")
    return "".join(out)
