"""Benchmark: extraction's decoding with its images on object storage (issue 46) against the same images
on local disk, in one run, with a near-free registered model (test_resnet at 32 px) so that reading and
decoding is what is measured.

    .venv/bin/python bench/images_remote.py                       # 8 shards x 64 images, --workers 2
    .venv/bin/python bench/images_remote.py --shards 32 --rounds 3   # each row the median of 3 rounds

The images are webdataset shards (``ingest webdataset``) on a local moto server, read through a WSGI
middleware in front of moto that counts each request and the bytes it answers and adds 0 or
``--latency-ms`` to every GET (a cloud provider's first-byte latency), against the same shards on disk,
with the same decoding workers (processes: a fork server's where the images are on S3); the store is
on disk each time. A round runs every row once, in turn; the table gives each row's median over the
rounds and the load average before and after. Then loose images (``ingest folder``
of the same JPEGs): a GET each. Features are equal bit for bit (checked). Targets (issue 46): images per
second at 20 ms >= 0.9 of disk; GETs per image <= 1/16 for shards and 1 for loose files; bytes fetched
<= 1.05 x the shards' bytes. Writes Markdown to bench/results/images_remote.md (``--out``).
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


class Counted:
    """WSGI middleware in front of moto's app: counts GETs and the bytes they answer, delays each GET."""

    def __init__(self, app):
        self.app, self.seconds, self.gets, self.bytes, self.lock = app, 0.0, 0, 0, threading.Lock()

    def __call__(self, environ, start_response):
        if environ["REQUEST_METHOD"] != "GET" or "list-type" in environ.get("QUERY_STRING", ""):
            return self.app(environ, start_response)
        time.sleep(self.seconds)
        body = b"".join(self.app(environ, start_response))
        with self.lock:
            self.gets += 1
            self.bytes += len(body)
        return [body]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--per-shard", type=int, default=64)
    ap.add_argument("--size", type=int, default=256, help="side of the demo JPEGs")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "images_remote.md"))
    args = ap.parse_args()

    import boto3
    import numpy as np
    import torch
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    from vsekit.extract import extract
    from vsekit.storage.demo import make_demo_data
    from vsekit.storage.sources.folder import ingest_folder
    from vsekit.storage.sources.webdataset import ingest_webdataset
    from vsekit.storage.store import FeatureStore

    torch.set_num_threads(1)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)   # a line per request otherwise
    app = Counted(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_REGION="us-east-1")
    s3 = boto3.client("s3", endpoint_url=endpoint)
    s3.create_bucket(Bucket="bench")
    opts = dict(model="test_resnet", kind="global", weights="none", input_size=32, resize=36, crops=1,
                batch_size=32, block_rows=256, workers=args.workers, progress=False)
    n = args.shards * args.per_shard
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_demo_data(tmp / "demo", images=n, seed=0, size=args.size)
        jpgs = sorted((tmp / "demo" / "images").glob("*.jpg"))
        (tmp / "wds").mkdir()
        for s in range(args.shards):   # webdataset's layout: KEY.jpg and KEY.txt side by side
            with tarfile.open(tmp / "wds" / f"{s:05d}.tar", "w") as tf:
                for i, jpg in enumerate(jpgs[s * args.per_shard:(s + 1) * args.per_shard]):
                    for name, data in ((f"{s:05d}{i:04d}.jpg", jpg.read_bytes()),
                                       (f"{s:05d}{i:04d}.txt", f"image {s} {i}".encode())):
                        info = tarfile.TarInfo(name)
                        info.size = len(data)
                        tf.addfile(info, io.BytesIO(data))
        shard_bytes = 0
        for f in sorted((tmp / "wds").glob("*.tar")):
            s3.put_object(Bucket="bench", Key=f"wds/{f.name}", Body=f.read_bytes())
            shard_bytes += f.stat().st_size
        for jpg in jpgs:
            s3.put_object(Bucket="bench", Key=f"loose/{jpg.name}", Body=jpg.read_bytes())
        table = tmp / "captions.tsv"
        table.write_text("".join(f"{j.name}\timage {j.stem}\n" for j in jpgs))
        pattern = f"{{00000..{args.shards - 1:05d}}}.tar"
        disk, _ = ingest_webdataset([str(tmp / "wds" / pattern)], tmp / "disk.zarr", split="train")
        remote_store, _ = ingest_webdataset([f"s3://bench/wds/{pattern}"], tmp / "s3.zarr", split="train")
        loose, _ = ingest_folder("s3://bench/loose", table, tmp / "loose.zarr", ratios="1,0,0")
        for store in (disk, remote_store):
            extract(store, **{**opts, "name": "warm"})   # imports, page cache, the fork server
        load = [os.getloadavg()[0]]
        cases = (("disk", disk, None), ("S3 shards, 0 ms", remote_store, 0.0),
                 (f"S3 shards, {args.latency_ms:g} ms per GET", remote_store, args.latency_ms),
                 (f"S3 loose JPEGs, {args.latency_ms:g} ms per GET", loose, args.latency_ms))
        rates: dict[str, list[float]] = {where: [] for where, *_ in cases}
        rows = []
        for r in range(args.rounds):
            for k, (where, store, ms) in enumerate(cases):
                app.seconds, app.gets, app.bytes = (ms or 0.0) / 1000, 0, 0
                name = f"run{r}_{k}"
                t0 = time.perf_counter()
                res = extract(store, **{**opts, "name": name})
                seconds = time.perf_counter() - t0
                assert res.failed == 0, res.errors
                rates[where].append(res.done / seconds)
                if r == 0:
                    rows.append((where, app.gets, app.bytes))
                ref = disk.features(f"run{r}_0").data[:]
                assert np.array_equal(FeatureStore.open(store.path).features(name).data[:], ref), f"{name} differs"
            print(f"round {r + 1}: " + ", ".join(f"{w}: {v[-1]:.0f}/s" for w, v in rates.items()), flush=True)
        load.append(os.getloadavg()[0])
    server.shutdown()
    med = {w: float(np.median(v)) for w, v in rates.items()}
    base = med["disk"]
    lines = [f"{n} images ({args.size} px JPEGs, {args.shards} webdataset shards, {shard_bytes:,} B), "
             f"test_resnet at 32 px, 1 crop, `--workers {args.workers}`, batches of 32, the store on disk; "
             f"images on disk and on moto (127.0.0.1) with 0 and {args.latency_ms:g} ms added per GET; features "
             f"equal bit for bit. Median of {args.rounds} rounds (each round every row once, in turn); load "
             f"average {load[0]:.1f} before, {load[1]:.1f} after.", "",
             "| images | images/s (median) | each round | vs disk | GETs | GETs per image | bytes fetched "
             "| vs the shards' bytes |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for where, gets, nbytes in rows:
        ratio = f"{nbytes / shard_bytes:.3f}" if "shards" in where else "-"
        each = ", ".join(f"{v:.0f}" for v in rates[where])
        lines.append(f"| {where} | {med[where]:.0f} | {each} | {med[where] / base:.2f}x | {gets} | {gets / n:.4f} "
                     f"| {nbytes:,} | {ratio} |")
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
