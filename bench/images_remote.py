"""Benchmark: extraction's decoding with its images on object storage (issue 46) against the same images
on local disk, in one run, with a near-free registered model (test_resnet at 32 px) so that reading and
decoding is what is measured.

    .venv/bin/python bench/images_remote.py                       # 8 shards x 64 images, --workers 2
    .venv/bin/python bench/images_remote.py --shards 32 --rounds 3   # each row the median of 3 rounds

The images are webdataset shards (``ingest webdataset``) on a local moto server, read through a WSGI
middleware in front of moto that counts each request and the bytes it answers and adds 0 or
``--latency-ms`` to every GET (a cloud provider's first-byte latency), against the same shards on disk,
with the same decoding workers (processes: a fork server's where the images are on S3); the store is
on disk each time. The server runs in a process of its own, whose CPU seconds each row reports: a
provider's work is not vsekit's, and a server thread in the driving process would take its GIL
(``--in-process-server``: as before, for comparison). A round runs every row once, in turn; the table
gives each row's median over the rounds, the median of each round's ratio to that round's disk row,
the CPU seconds of the server and of this process (all its threads: with ``--workers 0`` every read and
decode, which a loaded machine does not skew as it skews images/s), and the load average before and after. Then loose images (``ingest folder`` of the same JPEGs): a GET each. Features are equal bit for bit (checked). Targets (issue 46): images per
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
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


class Counted:
    """WSGI middleware in front of moto's app: counts GETs and the bytes they answer, delays each GET
    (its figures in shared values: the server runs in a process of its own)."""

    def __init__(self, app, seconds, gets, nbytes):
        self.app, self.seconds, self.gets, self.bytes = app, seconds, gets, nbytes

    def __call__(self, environ, start_response):
        if environ["REQUEST_METHOD"] != "GET" or "list-type" in environ.get("QUERY_STRING", ""):
            return self.app(environ, start_response)
        time.sleep(self.seconds.value)
        body = b"".join(self.app(environ, start_response))
        with self.gets.get_lock():
            self.gets.value += 1
            self.bytes.value += len(body)
        return [body]


def serve(port, seconds, gets, nbytes) -> None:
    """moto's S3 behind :class:`Counted`, in this (spawned) process: its CPU is measured apart from
    vsekit's and it takes no GIL from the driving process, as a real provider would not. moto's S3 app
    alone, not its all-services dispatcher, which finds each request's service under one lock by
    listing moto's module folders (about 180 stat calls a request: half the server's CPU a GET)."""
    from moto.moto_server.werkzeug_app import MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)   # a line per request otherwise
    app = Counted(create_backend_app("s3"), seconds, gets, nbytes)
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
    port.value = server.server_address[1]
    server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--per-shard", type=int, default=64)
    ap.add_argument("--size", type=int, default=256, help="side of the demo JPEGs")
    ap.add_argument("--workers", type=int, default=2, help="decoding processes (0: in this process)")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--in-process-server", action="store_true",
                    help="moto in a thread of this process, as before (it then shares the driving process's GIL)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "images_remote.md"))
    args = ap.parse_args()

    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    port, delay, gets, nbytes = ctx.Value("i", 0), ctx.Value("d", 0.0), ctx.Value("q", 0), ctx.Value("q", 0)
    if args.in_process_server:
        import threading

        threading.Thread(target=serve, args=(port, delay, gets, nbytes), daemon=True).start()
    else:
        server = ctx.Process(target=serve, args=(port, delay, gets, nbytes), daemon=True)
        server.start()

    import boto3
    import numpy as np
    import psutil
    import torch

    from vsekit.extract import extract
    from vsekit.storage.demo import make_demo_data
    from vsekit.storage.sources.folder import ingest_folder
    from vsekit.storage.sources.webdataset import ingest_webdataset
    from vsekit.storage.store import FeatureStore

    torch.set_num_threads(1)
    while not port.value:
        time.sleep(0.05)
    endpoint = f"http://127.0.0.1:{port.value}"
    served = None if args.in_process_server else psutil.Process(server.pid)
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
        ratios: dict[str, list[float]] = {where: [] for where, *_ in cases}   # each round's, against its disk row
        served_cpu: dict[str, list[float]] = {where: [] for where, *_ in cases}
        own_cpu: dict[str, list[float]] = {where: [] for where, *_ in cases}   # this process's, all threads
        rows = []
        for r in range(args.rounds):
            for k, (where, store, ms) in enumerate(cases):
                delay.value, gets.value, nbytes.value = (ms or 0.0) / 1000, 0, 0
                name = f"run{r}_{k}"
                cpu0 = sum(served.cpu_times()[:2]) if served else 0.0
                t0, own0 = time.perf_counter(), time.process_time()
                res = extract(store, **{**opts, "name": name})
                seconds = time.perf_counter() - t0
                own_cpu[where].append(time.process_time() - own0)
                served_cpu[where].append(sum(served.cpu_times()[:2]) - cpu0 if served else float("nan"))
                assert res.failed == 0, res.errors
                rates[where].append(res.done / seconds)
                ratios[where].append(rates[where][-1] / rates["disk"][-1])
                if r == 0:
                    rows.append((where, gets.value, nbytes.value))
                ref = disk.features(f"run{r}_0").data[:]
                assert np.array_equal(FeatureStore.open(store.path).features(name).data[:], ref), f"{name} differs"
            print(f"round {r + 1} (load {os.getloadavg()[0]:.1f}): " +
                  ", ".join(f"{w}: {v[-1]:.0f}/s {ratios[w][-1]:.2f}x" for w, v in rates.items()), flush=True)
        load.append(os.getloadavg()[0])
    if served:
        server.terminate()
    med = {w: float(np.median(v)) for w, v in rates.items()}
    lines = [f"{n} images ({args.size} px JPEGs, {args.shards} webdataset shards, {shard_bytes:,} B), "
             f"test_resnet at 32 px, 1 crop, `--workers {args.workers}`, batches of 32, the store on disk; "
             f"images on disk and on moto (127.0.0.1, {'a thread of this process' if args.in_process_server else 'a process of its own'}) with 0 and {args.latency_ms:g} ms added "
             f"per GET; features equal bit for bit. {args.rounds} rounds (each round every row once, in turn; "
             f"vs disk: the median of each round's ratio to that round's disk row); load average "
             f"{load[0]:.1f} before, {load[1]:.1f} after.", "",
             "| images | images/s (median) | each round | vs disk | each round | server CPU s (median) "
             "| this process's CPU s (median) | GETs | GETs per image | bytes fetched | vs the shards' bytes |",
             "| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for where, n_gets, n_bytes in rows:
        ratio = f"{n_bytes / shard_bytes:.3f}" if "shards" in where else "-"
        each = ", ".join(f"{v:.0f}" for v in rates[where])
        each_ratio = ", ".join(f"{v:.2f}" for v in ratios[where])
        lines.append(f"| {where} | {med[where]:.0f} | {each} | {np.median(ratios[where]):.2f}x | {each_ratio} "
                     f"| {np.median(served_cpu[where]):.2f} | {np.median(own_cpu[where]):.2f} | {n_gets} | {n_gets / n:.4f} | {n_bytes:,} | {ratio} |")
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
