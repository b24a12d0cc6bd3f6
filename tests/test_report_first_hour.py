"""The report shows metrics.json's warnings beside the figures, its table fits a 1400 px page, loss
curves of different scales get their own charts, and attention is named in words (issue 29, item 4)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from test_report import METRICS_A, _chrome, chromium, make_run, small_store  # noqa: F401 (fixtures)
from vsekit.report import loss_scales, report
from vsekit.report.attention import _word_title, module_in_words
from vsekit.report.page import CSS

WARNING_5K = ("--protocol coco-5k is defined on a 5000-image test split, but split 'test' has 2 usable "
              "images: its figures are not comparable to the papers' (use --protocol all to label them as "
              "what they are)")


# end to end (CLI runs, extraction, training, subprocesses): in `make test`, not in `make test-fast`
pytestmark = pytest.mark.e2e


def _with_warnings(metrics):
    return {**metrics, "warnings": [WARNING_5K, "2 test images have no caption"]}


def test_every_warning_of_metrics_json_is_shown_next_to_its_figures(small_store, tmp_path):
    run = make_run(tmp_path / "run", small_store, metrics=_with_warnings(METRICS_A))
    s = report([run], tmp_path / "out", n_captions=0, n_images=0, n_attention=0)
    html = s.path.read_text()
    rows = re.findall(r'<tr class="warning" data-run="([^"]*)" data-protocol="([^"]*)"><td colspan="\d+">'
                      r'&#9888; warning of these figures \(metrics.json\): ([^<]*)</td></tr>', html)
    by_protocol = {}
    for _, proto, text in rows:
        by_protocol.setdefault(proto, []).append(text.replace("&#x27;", "'"))
    # the coco-5k warning under the coco-5k row only; the one naming no protocol under every row
    assert by_protocol["coco-5k"] == [WARNING_5K, "2 test images have no caption"]
    assert by_protocol["coco-1k"] == ["2 test images have no caption"]
    # each warning row follows its figures' row directly, and the rsum carries a mark
    table = html[html.index('id="metrics"'):html.index("</table>")]
    five_k_row = re.search(r'<tr>(?:(?!</tr>).)*data-protocol="coco-5k" data-metric="rsum"[^>]*>224\.0 '
                           r'<span class="warn"(?:(?!</tr>).)*</tr><tr class="warning"', table)
    assert five_k_row, table


def test_metrics_table_is_laid_out_to_fit_the_page():
    # names wrap inside their cells; the table takes the page's width instead of its content's
    assert re.search(r"table\.metrics\{[^}]*width:100%", CSS)
    assert re.search(r"table\.metrics td\.run\{[^}]*white-space:normal[^}]*overflow-wrap:anywhere", CSS)


def test_metrics_table_fits_1400_px_in_chromium(small_store, tmp_path, chromium):  # noqa: F811
    metrics = _with_warnings(METRICS_A)
    runs = [make_run(tmp_path / f"sweep-{i}-fne-sh-demo-lr0.0002-margin0.2-max-violation-seed{i}-of-a-long-grid",
                     small_store, metrics=metrics)
            for i in range(6)]
    s = report(runs, tmp_path / "out", n_captions=0, n_images=0, n_attention=0)
    probe = tmp_path / "out" / "probe.html"
    probe.write_text(s.path.read_text().replace(
        "</body>", "<script>const w=document.querySelector('.tablewrap');document.body.setAttribute("
                   "'data-fit', w.scrollWidth + ' ' + w.clientWidth + ' ' + "
                   "document.documentElement.scrollWidth);</script></body>"))
    dom = _chrome(chromium, tmp_path / "profile", "--window-size=1400,1000", "--dump-dom", probe.resolve().as_uri())
    m = re.search(r'data-fit="(\d+) (\d+) (\d+)"', dom.stdout)
    assert m, dom.stderr[-2000:]
    table_w, wrap_w, page_w = map(int, m.groups())
    assert table_w <= wrap_w and page_w <= 1400, (table_w, wrap_w, page_w)   # no horizontal scrollbar


def _series(label, scale, n=4):
    xs = [float(e) for e in range(1, n + 1)]
    return (label, xs, [scale / e for e in range(1, n + 1)], {})


def test_losses_of_different_scales_get_their_own_charts(small_store, tmp_path):
    groups = loss_scales([_series("a", 10.0), _series("b", 0.05), _series("c", 14.0), ("d", [1.0], [None], {})])
    assert [[s[0] for s in g] for g in groups] == [["b", "d"], ["a", "c"]]   # no values: the first chart
    assert [[s[0] for s in g] for g in loss_scales([_series("a", 10.0), _series("c", 30.0)])] == [["a", "c"]]
    a = make_run(tmp_path / "a", small_store, metrics=METRICS_A)
    b = make_run(tmp_path / "b", small_store, metrics=METRICS_A)
    with open(b / "metrics.jsonl", "w") as f:   # a loss 1000 times smaller
        for e in range(1, 4):
            f.write(json.dumps({"epoch": e, "train_loss": 0.01 / e, "val": {"rsum": 50.0 * e}}) + "\n")
    html = report([a, b], tmp_path / "out", n_captions=0, n_images=0, n_attention=0).path.read_text()
    titles = re.findall(r'aria-label="(training loss[^"]*)"', html)
    assert titles == ["training loss (b)", "training loss (a)"], titles


def test_attention_is_labelled_in_words_not_module_names():
    assert module_in_words("txt_enc.att.0") == "caption encoder, attention 1"
    import torch

    model = torch.nn.Module()
    model.txt_enc = torch.nn.Module()
    title = _word_title(model, "txt_enc.att.0", 1, 2)
    assert title == "word weights (caption encoder, attention 1)"
    assert not re.search(r"\w\.\w|_", title)
