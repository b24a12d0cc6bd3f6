"""Benchmark: extraction end to end into a store on S3 (a local moto server) against the same work on
local disk, in one run, with a near-free model so that the store is what is measured; and the
requests and bytes per row block on S3 (issue 35).

    .venv/bin/python bench/store_s3.py                    # 256 images, 32 rows per block (~20 s)
    .venv/bin/python bench/store_s3.py --images 1024 --block-rows 64

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--block-rows", type=int, default=32)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "store_s3.md"))
    args = ap.parse_args()

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
              f"commit record {sum(records) // max(1, n):,} B ({n} blocks)."]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
