"""Export a store to the files other code reads: VSE++ / SCAN precomp folders and HDF5.

* ``vsepp`` (Faghri et al., VSE++): ``{split}_ims.npy`` (N, D), one row per image, and
  ``{split}_caps.txt`` with ``captions_per_image`` consecutive captions per image — the files
  VSE++'s ``PrecompDataset`` loads (it divides the caption index by 5 to find the image row).
* ``scan`` (Lee et al., SCAN; also read by SGRAF): the same names with ``{split}_ims.npy`` of
  (N, K, C) regions (grids (N, G, G, C) are flattened to G*G regions), padded rows zero.
* ``hdf5``: one HDF5 dataset per store array (``images/id``, ``captions/text``,
  ``features/<name>/data``...), provenance as HDF5 attributes (non-scalar values as JSON text, their
  names listed in the ``_json_attrs`` attribute), chunked and gzip-compressed.

Split files are named ``train``, ``dev`` (val), ``test`` and ``restval``, and every precomp export
also writes ``{split}_ids.txt`` (one image id per line) so that ``vsekit ingest precomp`` gives back
the same image ids. Everything is streamed one store chunk at a time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from .integrity import SUMS
from .store import SPLITS, FeatureStore, StoreError, write_array, write_strings

SPLIT_PREFIX = {"train": "train", "val": "dev", "test": "test", "restval": "restval"}
LAYOUTS = ("vsepp", "scan")


def _open(store: FeatureStore | str | Path) -> FeatureStore:
    return store if isinstance(store, FeatureStore) else FeatureStore.open(store)


def retry_advice(store: FeatureStore, name: str) -> str:
    """How to retry the failed rows of ``name``: the extract command with --retry-failed (and the
    derived stages after it, with --overwrite)."""
    from .remake import remake_command, root_set

    root = root_set(store, name)
    ra = store.features(root).attrs
    if "crop_size" not in ra or ra.get("stage"):   # made by an ingester, not by `vsekit extract`
        return (f"The failed rows of {root!r} were not extracted by vsekit (see `vsekit info "
                f"{store.path} {root}`); fix its source and ingest it again")
    text = f"Fix the files, then retry those rows: {remake_command(store, root, '--retry-failed')}"
    if root != name:
        chain, seen = [], name
        while seen != root:
            chain.append(remake_command(store, seen, "--overwrite"))
            seen = store.features(seen).attrs["parent"]
        text += " and remake the derived sets: " + " ; ".join(reversed(chain))
    return text


def _complete_set(store: FeatureStore, features: str):
    fs = store.features(features, complete=True)
    failed = fs.counts()["failed"]
    if failed:
        first = sorted(fs.errors().items())[:1]
        why = f" (first: row {first[0][0]}: {first[0][1]})" if first else ""
        raise StoreError(f"feature set {features!r} has {failed} failed rows{why}; exports need every "
                         f"row. {retry_advice(store, features)}, or export another set")
    if fs.n_rows != store.n_images:
        raise StoreError(f"feature set {features!r} has {fs.n_rows} rows but the store has "
                         f"{store.n_images} images")
    return fs


def _captions_by_image(store: FeatureStore, rows: np.ndarray, cpi: int) -> list[list[int]]:
    """The first ``cpi`` caption indices of each image row, in store order; refuse images with fewer."""
    owners = store.caption_images()
    order = np.argsort(owners, kind="stable")
    sorted_owners = owners[order]
    lo, hi = np.searchsorted(sorted_owners, rows, "left"), np.searchsorted(sorted_owners, rows, "right")
    out = []
    ids = None
    for r, a, b in zip(rows, lo, hi):
        if b - a < cpi:
            ids = store.image_ids() if ids is None else ids
            raise StoreError(f"image row {r} (id {ids[r]}) has {b - a} captions; the precomp layout needs "
                             f"{cpi} per image (--captions-per-image)")
        out.append(order[a:a + cpi].tolist())
    return out


def export_precomp(store: FeatureStore | str | Path, features: str, out: str | Path, *, layout: str = "vsepp",
                   splits: Sequence[str] | None = None, captions_per_image: int = 5,
                   dtype: str | None = None) -> dict[str, Any]:
    """Write ``{split}_ims.npy``, ``{split}_caps.txt`` and ``{split}_ids.txt`` for each split."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown precomp layout {layout!r}; valid choices: {', '.join(LAYOUTS)}")
    store = _open(store)
    fs = _complete_set(store, features)
    if fs.attrs.get("packed"):
        raise StoreError(f"feature set {features!r} is 2-bit packed; export its unpacked parent "
                         f"{fs.attrs.get('parent')!r} or a set made without --pack")
    shape = fs.shape[1:]
    if layout == "vsepp" and len(shape) != 1:
        raise StoreError(f"feature set {features!r} has rows of shape {shape}; the vsepp layout holds one "
                         f"vector per image (use `export scan` for regions and grids)")
    if layout == "scan":
        if len(shape) == 3:
            shape = (shape[0] * shape[1], shape[2])
        elif len(shape) != 2:
            raise StoreError(f"feature set {features!r} has rows of shape {shape}; the scan layout holds "
                             f"(K, C) regions per image (use `export vsepp` for global vectors)")
    if not store.n_captions:
        raise StoreError(f"{store.path} has no captions; the {layout} layout needs "
                         f"{captions_per_image} captions per image")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    codes = store.image_splits()
    wanted = list(splits) if splits else [s for i, s in enumerate(SPLITS) if np.any(codes == i)]
    for s in wanted:
        if s not in SPLITS:
            raise ValueError(f"--splits: unknown split {s!r}; valid choices: {', '.join(SPLITS)}")
    out_dtype = np.dtype(dtype) if dtype else fs.data.dtype
    ids = store.image_ids()
    summary: dict[str, Any] = {"out": str(out), "layout": layout, "splits": {}}
    targets = []
    text = None
    for s in wanted:
        rows = store.split_rows(s)
        if not len(rows):
            raise StoreError(f"split {s!r} has no images in {store.path}")
        prefix = SPLIT_PREFIX[s]
        caps = _captions_by_image(store, rows, captions_per_image)
        text = store.caption_text() if text is None else text
        with open(out / f"{prefix}_caps.txt", "w", encoding="utf-8") as f:
            for group in caps:
                for m in group:
                    f.write(" ".join(str(text[m]).split()) + "\n")
        (out / f"{prefix}_ids.txt").write_text("".join(f"{ids[r]}\n" for r in rows), encoding="utf-8")
        ims = open(out / f"{prefix}_ims.npy", "wb")  # written front to back, block by block
        np.lib.format.write_array_header_1_0(ims, {"descr": np.lib.format.dtype_to_descr(out_dtype),
                                                   "fortran_order": False, "shape": (len(rows), *shape)})
        targets.append((rows, ims))
        summary["splits"][prefix] = {"images": int(len(rows)), "captions": int(len(rows) * captions_per_image)}
    try:
        for block in fs.blocks():  # one pass over the set, one block in memory
            data = None
            for rows, ims in targets:
                a, b = np.searchsorted(rows, block.start), np.searchsorted(rows, block.stop)
                if a == b:
                    continue
                if data is None:
                    data = fs.data[block.start:block.stop]
                part = data[rows[a:b] - block.start].reshape(b - a, *shape).astype(out_dtype, copy=False)
                ims.write(np.ascontiguousarray(part).tobytes())
    finally:
        for _, ims in targets:
            ims.close()
    return summary


def export_vsepp(store, features: str, out, **kw) -> dict[str, Any]:
    """The VSE++ precomp layout (see :func:`export_precomp`)."""
    return export_precomp(store, features, out, layout="vsepp", **kw)


def export_scan(store, features: str, out, **kw) -> dict[str, Any]:
    """The SCAN / SGRAF precomp layout (see :func:`export_precomp`)."""
    return export_precomp(store, features, out, layout="scan", **kw)


# HDF5 ---------------------------------------------------------------------------------------------
def _set_attrs(obj, attrs: dict[str, Any]) -> None:
    as_json = []
    for key, value in attrs.items():
        if isinstance(value, (bool, int, float, str)) and not (isinstance(value, str) and "\x00" in value):
            obj.attrs[key] = value
        else:
            obj.attrs[key] = json.dumps(value)
            as_json.append(key)
    if as_json:
        obj.attrs["_json_attrs"] = json.dumps(as_json)


def _get_attrs(obj) -> dict[str, Any]:
    as_json = set(json.loads(obj.attrs.get("_json_attrs", "[]")))
    out = {}
    for key, value in obj.attrs.items():
        if key == "_json_attrs":
            continue
        value = value.item() if isinstance(value, np.generic) else value
        out[key] = json.loads(value) if key in as_json else value
    return out


def _copy_to_h5(parent, name: str, arr, level: int) -> None:
    import h5py

    is_str = arr.dtype.kind in "OUT" or str(arr.dtype).startswith("<U") or "str" in str(arr.dtype).lower()
    dtype = h5py.string_dtype("utf-8") if is_str else np.dtype(str(arr.dtype))
    shape = tuple(arr.shape)
    row_bytes = int(np.prod(shape[1:] or (1,))) * (16 if is_str else dtype.itemsize)
    rows = max(1, min(shape[0] if shape else 1, (1 << 20) // max(1, row_bytes)))
    kw = {"chunks": (rows, *shape[1:]), "compression": "gzip", "compression_opts": level,
          "shuffle": not is_str} if shape and shape[0] else {}
    ds = parent.create_dataset(name, shape=shape, dtype=dtype, **kw)
    step = int(arr.chunks[0]) if shape else 1
    for a in range(0, shape[0] if shape else 0, step):
        block = arr[a:a + step]
        ds[a:a + len(block)] = np.asarray(block, dtype=object) if is_str else block


def _arrays(group) -> Iterable[tuple[str, Any]]:
    for key in sorted(group.array_keys()):
        yield key, group[key]


def export_hdf5(store: FeatureStore | str | Path, out: str | Path, *, features: Sequence[str] | None = None,
                level: int = 4) -> dict[str, Any]:
    """Write the store (all feature sets, or those named) to one HDF5 file, chunk by chunk."""
    import h5py

    store = _open(store)
    names = list(features) if features else store.feature_names()
    for n in names:
        store.features(n)  # a clear error for an unknown name
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    with h5py.File(tmp, "w") as h5:
        _set_attrs(h5, store.attrs)
        for gname in ("images", "captions", "tokens"):
            if gname in store.root:
                zg, hg = store.root[gname], h5.create_group(gname)
                _set_attrs(hg, dict(zg.attrs))
                for key, arr in _arrays(zg):
                    _copy_to_h5(hg, key, arr, level)
        fg = h5.create_group("features")
        for n in names:
            fs = store.features(n)
            hg = fg.create_group(n)
            _set_attrs(hg, fs.attrs)
            for key, arr in _arrays(fs.group):
                if key != SUMS:   # checksums of this store's chunk files; the import records its own
                    _copy_to_h5(hg, key, arr, level)
    tmp.replace(out)
    return {"out": str(out), "features": names}


def ingest_hdf5(h5_path: str | Path, store_path: str | Path, *, overwrite: bool = False) -> FeatureStore:
    """Rebuild a store from an :func:`export_hdf5` file (the inverse, chunk by chunk)."""
    import h5py

    from .sources.common import IngestError

    h5_path = Path(h5_path)
    if not h5_path.is_file():
        raise IngestError(f"{h5_path}: no such file")
    try:
        h5 = h5py.File(h5_path, "r")
    except OSError as exc:
        raise IngestError(f"{h5_path}: not an HDF5 file ({exc})") from None
    with h5:
        attrs = _get_attrs(h5)
        if "vsekit_format" not in attrs or "images" not in h5:
            raise IngestError(f"{h5_path}: not a vsekit HDF5 export (no vsekit_format attribute or images group)")
        with FeatureStore.building(store_path, overwrite=overwrite, dataset=attrs.get("dataset", ""),
                                   source_files=[str(h5_path.resolve())]) as store:
            keep = {k: v for k, v in attrs.items() if k not in ("complete", "vsekit_format", "vsekit_version")}
            store.root.attrs.update(keep)
            for gname in ("images", "captions", "tokens"):
                if gname in h5:
                    zg = store.root.require_group(gname)
                    zg.attrs.update(_get_attrs(h5[gname]))
                    for key, ds in h5[gname].items():
                        _copy_from_h5(zg, key, ds)
            for name, hg in h5.get("features", {}).items():
                fattrs = _get_attrs(hg)
                data = hg["data"]
                extra = {k: (ds.shape[1:], ds.dtype) for k, ds in hg.items() if k not in ("data", "status", SUMS)}
                fs = store.create_features(name, data.shape[1:], data.dtype, attrs=fattrs,
                                           n_rows=data.shape[0], block_rows=fattrs.get("block_rows"),
                                           extra=extra)
                for block in fs.blocks():
                    aux = {k: hg[k][block.start:block.stop] for k in extra}
                    fs.write_block(block, data[block.start:block.stop],
                                   status=hg["status"][block.start:block.stop], **aux)
    return store


def _copy_from_h5(group, name: str, ds) -> None:
    import h5py

    if h5py.check_string_dtype(ds.dtype) is not None:
        values = [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in ds.asstr()[:]]
        write_strings(group, name, values)
    else:
        write_array(group, name, ds[:])

