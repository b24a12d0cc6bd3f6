"""Benchmark: extraction end to end into a store on S3 (a local moto server) against the same work on
local disk, in one run, with a near-free model so that the store is what is measured; the requests
and bytes per row block on S3; and the trainer's batches per second from the S3 store against the
same set on local disk, with the requests and bytes per block its reads cost (issue 35).

    .venv/bin/python bench/store_s3.py                    # 256 images, 32 rows per block (~20 s)
    .venv/bin/python bench/store_s3.py --images 1024 --block-rows 64
    .venv/bin/python bench/store_s3.py --part train       # the trainer's reads only

The trainer's part times ``PairStream`` epochs (the batches ``vsekit train`` consumes: windows of
chunks, each block checked against its commit record) over a random global float32 set, loader only
and with a linear-encoder step as the consumer, at ``read_requests`` 16 (the default) and 1; and once
more through a second server over the same moto backend that holds every GET for ``--latency-ms``
before answering, standing in for a cloud provider's first-byte latency.

Requests are counted at the server (moto's request log, by HTTP method); bytes are those the
store's objects hold once the run is done. moto is a Python server on the same machine, so the
seconds show vsekit's request pattern on a fast local link, not a cloud provider's latency.
Writes a Markdown table to bench/results/store_s3.md (``--out``).
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import re
import sys
import tempfile
import time
from pathlib import Path

# bench/ holds scripts named like stdlib modules (tokenize.py): keep it off the import path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


class RequestCount(logging.Handler):
    """Counts the requests moto's server logs, by method, for the keys under ``prefix``."""

    LINE = re.compile(r'"(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP')

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def emit(self, record):
        m = self.LINE.search(record.getMessage())
        if m:
            self.counts[m.group(1)] += 1


class Latency:
    """WSGI middleware in front of moto's app: every GET waits ``seconds`` before it is served."""

    def __init__(self, app, seconds: float):
        self.app, self.seconds = app, seconds

    def __call__(self, environ, start_response):
        if environ["REQUEST_METHOD"] == "GET":
            time.sleep(self.seconds)
        return self.app(environ, start_response)


def latency_server(seconds: float):
    """A second HTTP server over this process's moto backend (the same buckets), with :class:`Latency`;
    returns (endpoint URL, server)."""
    import threading

    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    app = Latency(DomainDispatcherApplication(create_backend_app), seconds)
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


def train_part(args, counter: RequestCount, tmp: Path) -> list[str]:
    """The trainer's batches per second from S3 against disk (module docstring); Markdown lines."""
    import numpy as np
    import torch

    from vsekit.storage.store import FeatureStore
    from vsekit.train.data import FeatureSource, PairStream, Tokens

    n, dim, block = args.train_images, args.train_dim, args.train_block_rows
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    url = "s3://bench/train.zarr"
    for where in (tmp / "train.zarr", url):
        with FeatureStore.building(where, dataset="bench") as st:
            st.write_images([str(i) for i in range(n)], [f"{i}.jpg" for i in range(n)], ["train"] * n)
            st.write_captions(["x"] * (5 * n), np.repeat(np.arange(n), 5))
        st = FeatureStore.open(where, mode="r+")
        with st.writer("f", stage="bench"):
            fs = st.create_features("f", (dim,), "float32", attrs={"kind": "global"}, block_rows=block)
            for b in fs.blocks():
                fs.write_block(b, rows[b.start:b.stop])
    lengths = np.full(5 * n, 12)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = Tokens(rng.integers(4, 1000, int(offsets[-1])), offsets, [str(i) for i in range(1000)])
    fc = torch.nn.Linear(dim, 1024, bias=False)

    def step(batch):   # the image side of a training step: a linear map and its backward
        fc(batch.feats).square().mean().backward()

    endpoint, slow = latency_server(args.latency_ms / 1000)
    cases = [("local disk", tmp / "train.zarr", {}),
             ("S3 (moto)", url, {"read_requests": "16"}),
             ("S3 (moto)", url, {"read_requests": "1"}),
             (f"S3 (moto) + {args.latency_ms:g} ms per GET", url, {"read_requests": "16", "endpoint": endpoint}),
             (f"S3 (moto) + {args.latency_ms:g} ms per GET", url, {"read_requests": "1", "endpoint": endpoint})]
    results, first = [], None
    for consumer, fn in (("loader only", None), ("linear-encoder step", step)):
        base = None
        for where, store, opts in cases:
            st = FeatureStore.open(store, storage_options=opts or None)
            src = FeatureSource(st.features("f"))
            stream = PairStream(src, tokens, st.split_rows("train"), st.caption_images(), batch_size=128,
                                captions="one", window_chunks=args.train_window, seed=0)
            best, gets, batches = 0.0, 0, 0
            for epoch in range(args.epochs):
                counter.counts.clear()
                t0 = time.perf_counter()
                batches = 0
                for batch in stream.epoch(epoch):
                    if fn is not None:
                        fn(batch)
                    batches += 1
                best = max(best, batches / (time.perf_counter() - t0))
                gets = counter.counts.get("GET", 0)
            base = base or best
            out_first = first = first or (batches, len(st.features("f").blocks()))
            results.append((consumer, where, opts.get("read_requests", "-"), best, best / base,
                            gets / out_first[1] if opts else None))
    slow.shutdown()
    block_bytes = block * dim * 4
    lines = ["", f"The trainer's reads: `PairStream` epochs (batch 128, one caption per image, windows of "
             f"{args.train_window} chunks read one window ahead) over {n} x {dim} random float32 rows, "
             f"{block} rows per block ({first[1]} blocks of {block_bytes:,} B, stored raw: one GET of "
             f"{block_bytes:,} B per block), best of {args.epochs} epochs of {first[0]} batches; the same "
             f"batches from both stores (tests/test_objstore_train.py):", "",
             "| consumer | store | read_requests | batches/s | vs disk | GETs per block per epoch |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for consumer, where, req, rate, ratio, per in results:
        lines.append(f"| {consumer} | {where} | {req} | {rate:.1f} | {ratio:.2f} | "
                     f"{'-' if per is None else f'{per:.2f}'} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--block-rows", type=int, default=32)
    ap.add_argument("--part", choices=["all", "extract", "train"], default="all")
    ap.add_argument("--train-images", type=int, default=8192)
    ap.add_argument("--train-dim", type=int, default=1024)
    ap.add_argument("--train-block-rows", type=int, default=256)
    ap.add_argument("--train-window", type=int, default=8, help="chunks per shuffle window of the trainer's part")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="added to each GET by the second server")
    ap.add_argument("--epochs", type=int, default=2, help="epochs of the trainer's part (the best is kept)")
    ap.add_argument("--out", default=None,
                    help="Markdown file [default: bench/results/store_s3.md, store_s3_train.md with --part train]")
    args = ap.parse_args()
    results = Path(__file__).parent / "results"
    args.out = args.out or str(results / ("store_s3_train.md" if args.part == "train" else "store_s3.md"))

    import boto3
    import numpy as np
    import torch
    from moto.server import ThreadedMotoServer

    from vsekit.extract import extract
    from vsekit.fne import standardize
    from vsekit.storage.demo import make_demo_data
    from vsekit.storage.sources.karpathy import ingest_karpathy
    from vsekit.storage.store import FeatureStore

    torch.set_num_threads(1)
    counter = RequestCount()
    log = logging.getLogger("werkzeug")
    log.setLevel(logging.INFO)
    log.propagate = False
    log.addHandler(counter)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1")
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    s3.create_bucket(Bucket="bench")
    if args.part == "train":
        with tempfile.TemporaryDirectory() as tmp:
            lines = train_part(args, counter, Path(tmp))
        server.stop()
        return _write(args.out, lines[1:])
    opts = dict(model="test_resnet", kind="global", weights="none", input_size=32, resize=36, crops=1,
                batch_size=16, block_rows=args.block_rows, workers=0, progress=False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        make_demo_data(data, images=args.images, seed=0, size=64)
        disk, _ = ingest_karpathy(data / "dataset_demo.json", data, Path(tmp) / "disk.zarr")
        url = "s3://bench/disk-vs-s3.zarr"
        ingest_karpathy(data / "dataset_demo.json", data, url)
        extract(disk, **{**opts, "block_rows": 8})          # warm-up: model build, imports, page cache
        disk.delete_features("test_resnet_global")
        for where, store in (("local disk", disk), ("S3 (moto)", url)):
            counter.counts.clear()
            t0 = time.perf_counter()
            res = extract(store, **opts)
            seconds = time.perf_counter() - t0
            requests = dict(counter.counts)
            blocks = res.blocks_run
            rows.append((where, seconds, res.done, blocks, requests))
        std_rows = []
        for where, store in (("local disk", disk), ("S3 (moto)", url)):
            counter.counts.clear()
            t0 = time.perf_counter()
            res = standardize(store, "test_resnet_global")
            seconds = time.perf_counter() - t0
            std_rows.append((where, seconds, res.rows, res.blocks_written, dict(counter.counts)))
        width = disk.features("test_resnet_global").shape[1]
        ref = disk.features("test_resnet_global").data[:]
        got = FeatureStore.open(url).features("test_resnet_global").data[:]
        assert np.array_equal(ref, got), "S3 and disk features differ"
        assert np.array_equal(disk.features("test_resnet_global.z").data[:],
                              FeatureStore.open(url).features("test_resnet_global.z").data[:]), "standardize differs"
        objs = [o for page in s3.get_paginator("list_objects_v2").paginate(Bucket="bench",
                                                                          Prefix="disk-vs-s3.zarr/")
                for o in page.get("Contents", [])]
        chunk = sum(o["Size"] for o in objs if "/features/test_resnet_global/data/c/" in o["Key"])
        status = sum(o["Size"] for o in objs if "/features/test_resnet_global/status/c/" in o["Key"])
        records = [o["Size"] for o in objs if "/.vsekit/commits/test_resnet_global/" in o["Key"]]
        train_lines = train_part(args, counter, Path(tmp)) if args.part == "all" else []
    server.stop()

    def table(rows):
        base = rows[0][1]
        out = ["| store | seconds | rows/s | vs disk | blocks | requests (by method) | requests per block |",
               "| --- | ---: | ---: | ---: | ---: | --- | ---: |"]
        for where, seconds, done, blocks, requests in rows:
            per = f"{sum(requests.values()) / blocks:.1f}" if requests and blocks else "-"
            shown = ", ".join(f"{k} {v}" for k, v in sorted(requests.items())) or "-"
            out.append(f"| {where} | {seconds:.2f} | {done / seconds:.0f} | {seconds / base:.2f}x | {blocks} | "
                       f"{shown} | {per} |")
        return out

    lines = [f"Extraction of {args.images} demo images (test_resnet at 32 px, 1 crop, {width}-d global float32, "
             f"{args.block_rows} rows per block, in-process, 1 torch thread), the same run into a store on local "
             f"disk and on S3 (moto on 127.0.0.1); features equal bit for bit.", "", *table(rows), "",
             "FNE standardize of that set (train-split statistics, then every block), in this process; the "
             "same arrays on both:", "", *table(std_rows)]
    n = len(records)
    lines += ["", "Requests include the run's fixed ones (the provider probe is not run in-process; the lease, the "
              "set's creation and publication, its attributes).",
              "", f"Bytes per block on S3: data chunk {chunk // max(1, n):,} B, status chunk {status // max(1, n):,} B, "
              f"commit record {sum(records) // max(1, n):,} B ({n} blocks).", *train_lines]
    _write(args.out, lines)


def _write(out: str, lines: list[str]) -> None:
    text = "\n".join(lines) + "\n"
    print(text)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)


if __name__ == "__main__":
    main()
