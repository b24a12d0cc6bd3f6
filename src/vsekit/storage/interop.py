"""Export a store to the files other code reads: VSE++ / SCAN precomp folders (``{split}_ims.npy``,
``{split}_caps.txt``, ``{split}_ids.txt``, the layouts VSE++'s and SCAN's ``PrecompDataset`` load)
and HDF5 (one dataset per store array, provenance as attributes), streamed one store chunk at a
time. The files and their options: docs/store.md, "Export: vsekit export".
"""

from __future__ import annotations

import json
import pickle
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from ..words import plural
from .integrity import SUMS
from .objcommit import swap_dir
from .remake import remake_command, root_set
from .splits import refuse_stale
from .base import no_tokens
from .store import FAILED, SPLITS, FeatureStore, StoreError, write_array, write_strings

SPLIT_PREFIX = {"train": "train", "val": "dev", "test": "test", "restval": "restval"}
LAYOUTS = ("vsepp", "scan")


def _open(store: FeatureStore | str | Path) -> FeatureStore:
    return store if isinstance(store, FeatureStore) else FeatureStore.open(store)


def retry_advice(store: FeatureStore, name: str) -> str:
    """How to retry the failed rows of ``name``: the extract command with --retry-failed (and the
    derived stages after it, with --overwrite)."""
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


def _complete_set(store: FeatureStore, features: str, drop_failed: bool = False, layout: str = "vsepp"):
    fs = store.features(features, complete=True)
    refuse_stale(fs)
    failed = fs.counts()["failed"]
    if failed and not drop_failed:
        row = int(np.flatnonzero(fs.status_values() == FAILED)[0])
        ids = store.image_ids() if store.n_images == fs.n_rows else None
        why = (f"; first: row {row}{f' (id {ids[row]})' if ids is not None else ''}: "
               f"{fs.errors().get(row, 'no reason recorded')}")
        raise StoreError(f"feature set {features!r} has {plural(failed, 'failed row')}{why}. The {layout} layout "
                         f"needs features for every image: pass --drop-failed to leave them and their captions "
                         f"out, or retry them (`vsekit info {store.path} {features}` shows how)")
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
                   dtype: str | None = None, testall: bool | None = None, restval_into_train: bool = False,
                   vocab_name: str | None = None, overwrite: bool = False,
                   drop_failed: bool = False) -> dict[str, Any]:
    """Write ``{split}_ims.npy``, ``{split}_caps.txt`` and ``{split}_ids.txt`` of each split into ``out``,
    replaced whole and only with ``overwrite``; the options (``testall``, ``restval_into_train``,
    ``vocab_name``, ``drop_failed``) and ``summary["warnings"]``: docs/store.md, "VSE++ / SCAN layouts"."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown precomp layout {layout!r}; valid choices: {', '.join(LAYOUTS)}")
    store = _open(store)
    fs = _complete_set(store, features, drop_failed, layout)
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
    final = Path(out)
    refuse_existing(final, overwrite)
    codes = store.image_splits()
    wanted = list(splits) if splits else [s for i, s in enumerate(SPLITS) if np.any(codes == i)]
    for s in wanted:
        if s not in SPLITS:
            raise ValueError(f"--splits: unknown split {s!r}; valid choices: {', '.join(SPLITS)}")
    final.parent.mkdir(parents=True, exist_ok=True)
    out = final.with_name(f".{final.name}.partial-{uuid.uuid4().hex[:8]}")
    out.mkdir()
    try:
        summary = _write_precomp(store, fs, out, layout, wanted, shape, captions_per_image, dtype, testall,
                                 restval_into_train, vocab_name, drop_failed)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    swap_dir(out, final)
    summary["out"] = str(final)
    summary["vocab"] = [str(final / Path(p).name) for p in summary.get("vocab", [])]
    if not summary["vocab"]:
        summary.pop("vocab")
    return summary


def refuse_existing(out: Path, overwrite: bool) -> None:
    """An output that exists (a file, or a folder with files in it) needs ``--overwrite``."""
    if overwrite or not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    raise ValueError(f"{out} already exists; pass --overwrite to replace it (it is replaced whole: "
                     f"nothing of it is kept)")


def _write_precomp(store, fs, out: Path, layout: str, wanted: list[str], shape: tuple, captions_per_image: int,
                   dtype: str | None, testall: bool | None, restval_into_train: bool,
                   vocab_name: str | None, drop_failed: bool = False) -> dict[str, Any]:
    out_dtype = np.dtype(dtype) if dtype else fs.data.dtype
    ids = store.image_ids()
    failed = np.asarray(fs.status_values() == FAILED) if drop_failed else None
    plan = _file_plan(store, wanted, testall, restval_into_train, failed)
    summary: dict[str, Any] = {"out": str(out), "layout": layout, "splits": {},
                               "warnings": _loader_warnings(plan, captions_per_image)}
    if failed is not None and failed.any():
        summary["dropped"] = _write_dropped(store, fs, out, failed, wanted, restval_into_train)
    targets = []
    text = None
    for prefix, rows in plan:
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
    if vocab_name:
        summary["vocab"] = [str(p) for p in export_vocab(store, out, vocab_name)]
    return summary


DROPPED_FILE = "dropped_failed.tsv"


def _write_dropped(store: FeatureStore, fs, out: Path, failed: np.ndarray, wanted: Sequence[str],
                   restval_into_train: bool) -> dict[str, Any]:
    """List the failed images left out of the export (and how many captions went with them)."""
    splits = set(wanted) | ({"restval"} if restval_into_train and "train" in wanted else set())
    codes = store.image_splits()
    rows = [int(r) for r in np.flatnonzero(failed) if SPLITS[codes[r]] in splits]
    ids, errors = store.image_ids(), fs.errors()
    per_image = np.bincount(store.caption_images(), minlength=store.n_images)
    lines = ["split\timage_id\trow\tcaptions\treason\n"]
    for r in rows:
        reason = " ".join(str(errors.get(r, "failed")).split())
        lines.append(f"{SPLITS[codes[r]]}\t{ids[r]}\t{r}\t{int(per_image[r])}\t{reason}\n")
    (out / DROPPED_FILE).write_text("".join(lines), encoding="utf-8")
    return {"images": len(rows), "captions": int(per_image[rows].sum()) if rows else 0, "file": DROPPED_FILE}


COCO_1K = 1000      # images in coco_precomp's test_* (one fold of testall)
DEV_CAPTIONS = 5000  # both reference loaders set the dev set's length to 5,000 captions


def _file_plan(store: FeatureStore, wanted: Sequence[str], testall: bool | None,
               restval_into_train: bool, failed: np.ndarray | None = None) -> list[tuple[str, np.ndarray]]:
    """(file prefix, sorted image rows) of each file set to write; ``failed`` rows are left out."""
    if restval_into_train:
        wanted = [s for s in wanted if s != "restval"]
    plan = []
    for s in wanted:
        rows = store.split_rows(["train", "restval"] if s == "train" and restval_into_train else s)
        if not len(rows):
            raise StoreError(f"split {s!r} has no images in {store.path}")
        if failed is not None:
            rows = rows[~failed[rows]]
            if not len(rows):
                raise StoreError(f"split {s!r} has no images left once its failed rows are dropped; "
                                 f"export the other splits with --splits, or re-split: `vsekit split --store "
                                 f"{store.path} ...`")
        if s == "test":
            on = ("coco" in store.dataset.lower() and len(rows) > COCO_1K) if testall is None else testall
            if on:
                plan += [("testall", rows), ("test", rows[:COCO_1K])]
                continue
        plan.append((SPLIT_PREFIX[s], rows))
    return plan


def _loader_warnings(plan: list[tuple[str, np.ndarray]], cpi: int) -> list[str]:
    """What VSE++/SCAN's PrecompDataset and fold-5 evaluation would get wrong with these files."""
    out = []
    for prefix, rows in plan:
        n_caps = len(rows) * cpi
        if prefix == "dev" and n_caps < DEV_CAPTIONS:
            out.append(f"dev has {n_caps} captions, fewer than the {DEV_CAPTIONS} that VSE++'s and SCAN's "
                       f"PrecompDataset assume for dev (data_split == 'dev' sets length 5000): their "
                       f"validation will fail with an IndexError; patch that line or export a larger val split")
        elif prefix == "dev" and n_caps > DEV_CAPTIONS:
            out.append(f"dev has {n_caps} captions; VSE++ and SCAN validate on the first {DEV_CAPTIONS} "
                       f"only ({DEV_CAPTIONS // cpi} images)")
        if prefix == "testall" and len(rows) != 5 * COCO_1K:
            out.append(f"testall has {len(rows)} images; the reference fold5 evaluation slices 5 folds of "
                       f"{COCO_1K} images (5,000 in all) and would misread it")
    return out


def export_vocab(store: FeatureStore | str | Path, out: str | Path, name: str) -> tuple[Path, Path]:
    """``{name}_vocab.json`` (SCAN's ``deserialize_vocab`` form) and ``{name}_vocab.pkl`` (VSE++)."""
    itos = stored_vocabulary(_open(store))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, pkl_path = out / f"{name}_vocab.json", out / f"{name}_vocab.pkl"
    json_path.write_text(json.dumps(vsepp_vocab_json(itos), ensure_ascii=False), encoding="utf-8")
    pkl_path.write_bytes(vsepp_vocab_pickle(itos))
    return json_path, pkl_path


def stored_vocabulary(store: FeatureStore) -> list[str]:
    """The words of the vocabulary ``vsekit tokenize`` stored (``tokens`` attrs), id order."""
    if "tokens" not in store.root or "vocabulary" not in store.root["tokens"].attrs:
        raise StoreError(no_tokens(store.path))
    return [str(w) for w in store.root["tokens"].attrs["vocabulary"]]


def vsepp_vocab_json(itos: Sequence[str]) -> dict[str, Any]:
    """The ``vocab.json`` form of VSE++ / SCAN: ``word2idx``, ``idx2word`` (string keys), ``idx``."""
    return {"word2idx": {w: i for i, w in enumerate(itos)}, "idx2word": {str(i): w for i, w in enumerate(itos)},
            "idx": len(itos)}


def vsepp_vocab_pickle(itos: Sequence[str]) -> bytes:
    """A pickle of VSE++'s ``vocab.Vocabulary`` holding ``itos`` (``word2idx``, ``idx2word`` with int
    keys, ``idx``), protocol 2 (readable by Python 2 and 3).

    VSE++ saves the object itself and loads it with ``pickle.load`` while its own ``vocab`` module is
    importable. vsekit builds an object of the same shape (:class:`_VseppVocabulary`: their
    ``__init__`` and ``add_word``) and pickles it with Python's own pickler, naming the class
    ``vocab.Vocabulary``; so the bytes are those of ``pickle.dumps(their_vocab, protocol=2)`` for
    their object built from the same words under Python 3, memo and all. Loading it needs VSE++'s
    ``vocab.py`` on the path, as their own pickles do.
    """
    import io

    buf = io.BytesIO()
    _VocabPickler(buf, protocol=2).dump(_VseppVocabulary(itos))
    return buf.getvalue()


class _VseppVocabulary:
    """An object with the attribute layout of VSE++'s ``vocab.Vocabulary``, filled as its
    ``add_word`` fills it (so ``__dict__`` holds word2idx, idx2word, idx in that order)."""

    def __init__(self, itos: Sequence[str]):
        self.word2idx: dict[str, int] = {}
        self.idx2word: dict[int, str] = {}
        self.idx = 0
        for word in itos:
            if word not in self.word2idx:
                self.word2idx[word] = self.idx
                self.idx2word[self.idx] = word
                self.idx += 1


class _VocabPickler(pickle._Pickler):
    """Python's own (pure-Python) pickler, writing :class:`_VseppVocabulary` as the global
    ``vocab.Vocabulary``: VSE++'s module must be importable to read the pickle, not to write it."""

    def save_global(self, obj, name=None):
        if obj is _VseppVocabulary:
            self.write(pickle.GLOBAL + b"vocab\nVocabulary\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)


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
                level: int = 4, overwrite: bool = False) -> dict[str, Any]:
    """Write the store (all feature sets, or those named) to one HDF5 file, chunk by chunk."""
    import h5py

    store = _open(store)
    names = list(features) if features else store.feature_names()
    for n in names:
        store.features(n)  # a clear error for an unknown name
    out = Path(out)
    refuse_existing(out, overwrite)
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


def ingest_hdf5(h5_path: str | Path, store_path: str | Path, *, overwrite: bool = False,
                drop_features: bool = False) -> FeatureStore:
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
        with FeatureStore.building(store_path, overwrite=overwrite, drop_features=drop_features, dataset=attrs.get("dataset", ""),
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

