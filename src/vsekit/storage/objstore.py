"""Stores on object storage (``s3://``, ``gs://``, ``az://``, ``memory://``): opening, conditional writes,
the provider probe and the set lease (docs/store.md, "Stores on object storage").

The layer is zarr's own :class:`zarr.storage.ObjectStore` over ``obstore`` (the ``s3`` extra): the
Zarr arrays go through it unchanged, and vsekit's commit protocol uses obstore's two conditional
puts directly, with no HTTP of its own:

- **create-if-absent** (``If-None-Match: *`` on S3, generation 0 on GCS, ``If-None-Match`` on Azure):
  :meth:`Objects.create` returns None when the object exists;
- **compare-and-swap** (``If-Match: <etag>``): :meth:`Objects.swap` returns None when the object
  changed since it was read.

Credentials and the endpoint come from the standard environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ... as obstore reads them) and
``--storage-option KEY=VALUE``. They live only in this process's memory (and in the job a dask task
is handed): never in the store's attributes, a log line, an error message or a report. A URL is
shown with any ``user:password@`` removed (:func:`public_url`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from .base import LeaseHeld, LeaseLost, StoreError  # noqa: F401 (re-exported)

SCHEMES = ("s3", "gs", "az", "memory")
#: where the refusals of storage send a user: what serves a store on object storage is the CLI's to say
#: (``vsekit.cli.options.URL_COMMANDS``); storage knows only that its leases do
SERVED_BY = ("every command that writes through the store's leases rather than a lock file "
             "(docs/store.md, \"Stores on object storage\", lists them)")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")

#: storage options that go to obstore's retry settings and HTTP client, not to the provider's config
_RETRY_KEYS = {"max_retries": int, "retry_timeout": float}
_CLIENT_KEYS = ("allow_http", "timeout", "connect_timeout")
#: storage options vsekit reads itself (``read_requests``: the trainer's chunk reads in flight,
#: ``storage/chunks.py``; ``single_writer``: the user's word that no other writer uses the store,
#: :func:`require_conditions`), not passed to obstore
SINGLE_WRITER = "single_writer"
_OWN_KEYS = ("read_requests", SINGLE_WRITER)
#: option names whose values are secrets (never shown; none is ever written anywhere)
_SECRET = re.compile(r"(secret|token|password|key|credential|sas)", re.I)


def scheme_of(path: Any) -> str | None:
    """The URL scheme of ``path`` in lower case, or None for a plain path."""
    if not isinstance(path, str):
        return None
    m = _URL.match(path)
    return m.group(1).lower() if m else None


def is_object_url(path: Any) -> bool:
    return scheme_of(path) in SCHEMES


def store_ref(store: Any) -> str:
    """A store as a run records it (evaluate and embed reopen it): an object-store URL without any
    credentials in it, a local path made absolute."""
    from pathlib import Path

    return public_url(str(store)) if is_object_url(str(store)) else str(Path(store).resolve())


def public_url(url: str) -> str:
    """``url`` as it may be shown or recorded: without a ``user:password@`` part and a trailing slash."""
    m = _URL.match(url)
    if not m:
        return url
    rest = re.sub(r"^[^/@]*@", "", m.group(2))
    return f"{m.group(1).lower()}://{rest}".rstrip("/")


def parse_options(pairs: Any) -> dict[str, str]:
    """``--storage-option KEY=VALUE`` pairs (a mapping passes through) as a dict; a pair without ``=``
    is a ValueError naming the option (its value is never shown: it may be a secret)."""
    if isinstance(pairs, Mapping):
        return {str(k): str(v) for k, v in pairs.items()}
    out: dict[str, str] = {}
    for pair in pairs or ():
        key, sep, value = str(pair).partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--storage-option must be KEY=VALUE, got one without '=' "
                             f"(starting {str(pair)[:3]!r}...)")
        out[key.strip().lower()] = value
    return out


def shown_argv(argv: list[str]) -> list[str]:
    """A command line as it may be printed or recorded (`vsekit run`'s plan and stage records): each
    ``--storage-option`` with a secret-looking key as ``KEY=***``, each URL without credentials."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if i and argv[i - 1] == "--storage-option":
            key, sep, _ = arg.partition("=")
            arg = f"{key}={'***'}" if sep and _SECRET.search(key) else arg
        elif is_object_url(arg):
            arg = public_url(arg)
        out.append(arg)
    return out


#: ``--storage-option`` values given to this process's command (under any explicit options)
DEFAULT_OPTIONS: dict[str, str] = {}

_MEMORY: dict[str, Any] = {}      # memory://NAME → one MemoryStore per process (tests, dry runs)
_MEMORY_LOCK = threading.Lock()


def _open_obstore(url: str, options: Mapping[str, str]):
    """The obstore store at ``url`` (its prefix included) with ``options`` over the environment."""
    try:
        from obstore.store import MemoryStore, from_url
    except ImportError:
        raise StoreError(f"--store {public_url(url)}: stores on object storage need the obstore package: "
                         f"pip install 'vsekit[s3]'") from None

    scheme = scheme_of(url)
    if scheme == "memory":
        with _MEMORY_LOCK:
            return _MEMORY.setdefault(public_url(url), MemoryStore())
    config: dict[str, Any] = {}
    retry: dict[str, Any] = {"max_retries": 3, "retry_timeout": 20.0}
    client: dict[str, Any] = {"connect_timeout": "5s", "timeout": "60s"}
    endpoint = options.get("endpoint") or options.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL", "")
    if scheme == "s3" and endpoint.startswith("http://"):
        client["allow_http"] = True    # a local S3 (moto, MinIO) has no TLS
    for key, value in options.items():
        if key in _OWN_KEYS:
            continue
        if key in _RETRY_KEYS:
            retry[key] = _RETRY_KEYS[key](value)
        elif key in _CLIENT_KEYS:
            client[key] = value
        elif key == "endpoint_url":
            config["endpoint"] = value
        else:
            config[key] = value
    from datetime import timedelta

    retry_config = {"max_retries": int(retry["max_retries"]), "backoff": {"init_backoff": timedelta(seconds=0.1),
                    "max_backoff": timedelta(seconds=2), "base": 2.0},
                    "retry_timeout": timedelta(seconds=float(retry["retry_timeout"]))}
    try:
        return from_url(url, config=config or None, client_options=client, retry_config=retry_config)
    except Exception as exc:   # an unknown option name, an unparsable URL
        raise StoreError(f"--store {public_url(url)}: cannot open it: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:300]


#: where each provider's SDK looks for credentials when none are given (the cloud's instance-metadata
#: service): a request that failed there failed for want of credentials, not for the store
_METADATA_PROBES = ("/latest/api/token", "/latest/meta-data", "metadata.google.internal", "computeMetadata",
                    "/metadata/identity")
_NO_CREDENTIALS = {
    "s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or --storage-option access_key_id=... "
          "--storage-option secret_access_key=...)",
    "gs": "GOOGLE_SERVICE_ACCOUNT (or --storage-option service_account=PATH)",
    "az": "AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY (or --storage-option account_key=...)"}


def _reason(exc: BaseException, scheme: str | None = None) -> str:
    """Why a request failed, in words (the provider's error code when it gave one). A failure of the
    SDK's instance-metadata probe means no credentials were found, and is worded so, without the
    SDK's text (it names an internal address the user never gave)."""
    text = str(exc)
    if any(probe in text for probe in _METADATA_PROBES):
        where = _NO_CREDENTIALS.get(scheme or "", "the provider's credential variables")
        return (f"no credentials were found: set {where}, or run where the machine has its own "
                f"(an instance role)")
    for code, words in (("NoSuchBucket", "the bucket does not exist"),
                        ("ContainerNotFound", "the container does not exist"),
                        ("AuthenticationFailed", "the provider refused the credentials (wrong account key or token)"),
                        ("AuthorizationFailure", "the provider refused the credentials (wrong account key or token, "
                                                 "or no access to the container)"),
                        ("InvalidAccessKeyId", "the access key is not known to the provider (wrong credentials)"),
                        ("SignatureDoesNotMatch", "the secret key does not match (wrong credentials)"),
                        ("AccessDenied", "access denied (check the credentials and the bucket's policy)"),
                        ("Connection refused", "the endpoint refused the connection (is the server up?)"),
                        ("error sending request", "the endpoint cannot be reached")):
        if code in text:
            return words
    return f"{type(exc).__name__}: {_first_line(exc)}"


@dataclass
class Objects:
    """The objects of one store (a URL's prefix), with vsekit's conditional writes.

    Every failure of the provider is a :class:`StoreError` naming the store's URL (never a secret).
    """

    url: str
    options: dict[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.url = public_url(self.url)
        self.options = {**DEFAULT_OPTIONS, **self.options}
        self.store = _open_obstore(self.url, self.options)

    @contextlib.contextmanager
    def _request(self, what: str) -> Iterator[None]:
        """A failed request as one error line naming the store's URL and the cause, never the object
        (a lease, a swap mark, a chunk: vsekit's own bookkeeping, which the user never named)."""
        try:
            yield
        except Exception as exc:
            raise StoreError(f"{self.url}: cannot {what} the store: {_reason(exc, scheme_of(self.url))}") from None

    def zarr_store(self, read_only: bool = False):
        from zarr.storage import ObjectStore

        return ObjectStore(self.store, read_only=read_only)

    def get(self, key: str) -> tuple[bytes, str | None] | None:
        """The object's bytes and ETag, or None when it does not exist."""
        import obstore

        with self._request("read"):
            try:
                res = obstore.get(self.store, key)
                return bytes(res.bytes()), res.meta.get("e_tag")
            except FileNotFoundError as exc:
                if "NoSuchBucket" in str(exc) or "ContainerNotFound" in str(exc):
                    raise
                return None

    def put(self, key: str, data: bytes) -> str | None:
        import obstore

        with self._request("write"):
            return obstore.put(self.store, key, data).get("e_tag")

    def create(self, key: str, data: bytes) -> str | None:
        """Write ``key`` only if it does not exist: its ETag, or None when it existed already."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        with self._request("create"):
            try:
                return obstore.put(self.store, key, data, mode="create").get("e_tag") or "created"
            except (AlreadyExistsError, PreconditionError):
                return None

    def swap(self, key: str, data: bytes, etag: str) -> str | None:
        """Replace ``key`` only if its ETag is still ``etag``: the new ETag, or None when it changed."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        with self._request("update"):
            try:
                return obstore.put(self.store, key, data, mode={"e_tag": etag}).get("e_tag")
            except (AlreadyExistsError, PreconditionError, FileNotFoundError):
                return None

    def delete(self, key: str) -> None:
        import obstore

        with self._request("delete"), contextlib.suppress(FileNotFoundError):
            obstore.delete(self.store, key)

    def copy(self, src: str, dst: str) -> None:
        """Copy the object ``src`` to ``dst`` on the provider (no bytes pass through this process)."""
        import obstore

        with self._request("copy"):
            obstore.copy(self.store, src, dst)

    def children(self, prefix: str) -> list[str]:
        """The names of the "folders" directly under ``prefix`` (one listing, not every object)."""
        import obstore

        with self._request("list"):
            got = obstore.list_with_delimiter(self.store, prefix=prefix.rstrip("/") or None)
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in got["common_prefixes"])

    def keys(self, prefix: str) -> list[str]:
        import obstore

        with self._request("list"):
            return sorted(m["path"] for batch in obstore.list(self.store, prefix=prefix) for m in batch)

    def get_json(self, key: str) -> tuple[dict, str | None] | None:
        got = self.get(key)
        if got is None:
            return None
        try:
            return json.loads(got[0]), got[1]
        except ValueError:
            return {}, got[1]


_CACHED: dict[tuple, Objects] = {}


def objects_for(url: str, options: Mapping[str, str] | None = None) -> Objects:
    """One :class:`Objects` per URL and options in this process (``options`` over the process's
    ``--storage-option`` values; a dask task passes those its driver handed it)."""
    key = (public_url(url), tuple(sorted((options or {}).items())))
    if key not in _CACHED:
        _CACHED[key] = Objects(key[0], dict(options or {}))
    return _CACHED[key]


def reset_options() -> None:
    """Forget the ``--storage-option`` values of an earlier command in this process (each CLI
    invocation starts from none: a second command run in one process, as tests and notebooks do, must
    not reuse the first one's credentials)."""
    DEFAULT_OPTIONS.clear()
    _CACHED.clear()


def dumps(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


# --- the provider probe ---------------------------------------------------------------------------
_PROBED: dict[str, bool] = {}


def honours_conditions(objects: Objects) -> bool:
    """Whether the provider refuses a second create-if-absent of one object (once per store and
    process). Some S3-compatible services accept ``If-None-Match`` and overwrite anyway: on them two
    writers cannot be kept apart, and vsekit runs only one (:func:`require_conditions`)."""
    if objects.url in _PROBED:
        return _PROBED[objects.url]
    key = f".vsekit/probe/{uuid.uuid4().hex}"
    first = objects.create(key, b"1")
    second = objects.create(key, b"2")
    objects.delete(key)
    _PROBED[objects.url] = bool(first) and second is None
    return _PROBED[objects.url]


def single_writer(objects: Objects) -> bool:
    """Whether the user said that this store has one writer (``--storage-option single_writer=true``)."""
    return str(objects.options.get(SINGLE_WRITER, "")).strip().lower() in ("1", "true", "yes", "on")


def require_conditions(objects: Objects, what: str, multi: bool = False) -> None:
    """Refuse ``what`` (any writer; ``multi``: one with several processes writing) on a provider that
    ignores conditional writes: there no lease keeps two writers apart, so even two in-process runs
    would both hold it and undo each other's commits. A single writer in one process runs only when
    the user says so (``--storage-option single_writer=true``); a multi-writer run never does."""
    if honours_conditions(objects) or (not multi and single_writer(objects)):
        return
    how = ("run it without --cluster (in one process) with --storage-option single_writer=true, once no other "
           "vsekit writes this store" if multi else
           "if no other vsekit writes this store while it runs, say so with --storage-option single_writer=true")
    raise StoreError(
        f"{objects.url}: this object store overwrote an object that was written with create-if-absent "
        f"(If-None-Match), so it cannot keep two writers apart; {what} is refused there; {how}")


# --- the set lease --------------------------------------------------------------------------------
from .leases import DEFAULT_TTL_S, Backend, Lease, holder_words  # noqa: E402,F401 (one ttl: DEFAULT_TTL_S re-exported)


def lease_key(name: str) -> str:
    return f".vsekit/leases/{re.sub(r'[^A-Za-z0-9._-]', '_', name)}.json"


class LeaseObject(Backend):
    """The object-storage backend of the one lease (:class:`.leases.Lease`): ONE object per guard (a
    set's, the store's, a block's) holding the holder's record and ``expires``; created with
    create-if-absent, replaced (taken over, renewed, or freed) by compare-and-swap on the ETag read or
    last written, so once anyone else wrote it the holder knows it lost it for good; deleted while it
    holds the holder's token (a delete cannot be conditional on every provider)."""

    def __init__(self, objects: Objects, key: str):
        self.objects, self.key = objects, key

    def create(self, body: dict, expires: float) -> str | None:
        return self.objects.create(self.key, dumps({**body, "expires": expires}))

    def read(self) -> tuple[dict, str | None, float] | None:
        got = self.objects.get_json(self.key)
        return None if got is None else (got[0], got[1], float(got[0].get("expires", 0)))

    def replace(self, body: dict, expires: float, version: str | None) -> str | None:
        if not version:
            return None
        return self.objects.swap(self.key, dumps({**body, "expires": expires} if expires else body), version)

    def delete(self, token: str) -> None:
        got = self.objects.get_json(self.key)
        if got is not None and got[0].get("token") == token:
            self.objects.delete(self.key)


class SetLease(Lease):
    """One writer per feature set (and per store: ``.store``) on object storage: the one lease over a
    :class:`LeaseObject`, renewed every ``ttl / 3`` from a daemon thread. :meth:`check` renews it at
    once and raises :class:`LeaseLost` when the object changed (another run took it over after it
    expired) or when less than half the ttl would be left: every commit record is written right after
    a successful check, so a holder paused past its expiry never commits (``tests/test_objstore.py``).
    A job array's tasks hold it jointly as a :class:`.leases.JointLease` (:meth:`hand_over`)."""

    def __init__(self, objects: Objects, name: str, stage: str, ttl: float | None = None,
                 token: str | None = None):
        super().__init__(LeaseObject(objects, lease_key(name)), ttl=ttl, token=token)
        self.objects, self.name, self.stage, self.key = objects, name, stage, lease_key(name)
        self.lost: str | None = None
        self.extra: dict[str, Any] = {}    # what a hand-over to a job array adds (:meth:`hand_over`)
        self.handed = False

    def body(self) -> dict:
        self.record = {"host": socket.gethostname(), "pid": os.getpid(), "stage": self.stage, **self.extra}
        return super().body()

    def acquire(self) -> "SetLease":
        held = self.take(tries=2)
        if held:
            raise LeaseHeld(f"feature set {self.name!r} in {self.objects.url} is being written by "
                            f"{holder_live(held)}")
        if held is not None:
            raise LeaseHeld(f"feature set {self.name!r} in {self.objects.url}: another run took its "
                            f"lease at the same moment; rerun later")
        return self.keep_renewed(self.ttl / 3, errors=(StoreError,))

    def renew(self) -> bool:
        if not self.lost and super().renew():
            return True
        self.lost = self.lost or (f"lost the lease of feature set {self.name!r} in {self.objects.url} (it "
                                  f"expired and another run took it over); this run stops without "
                                  f"committing more blocks")
        raise LeaseLost(self.lost)

    def check(self) -> None:
        """Renew now; raise :class:`LeaseLost` unless this run still holds the lease for half a ttl."""
        self.renew()
        if time.time() > self.expires - self.ttl / 2:   # the renewal itself took too long
            raise LeaseLost(f"the lease of {self.name!r} in {self.objects.url} is about to expire; "
                            f"not committing")

    def hand_over(self, token: str, extra: Mapping[str, Any], handed: bool = True) -> None:
        """Rewrite the lease (compare-and-swap) as a job array's: its ``token`` and ``extra`` (the job
        id and scheduler, ``pid: 0`` so that this process ending does not free it). ``handed``: this
        process no longer releases it (the array's tasks renew it jointly); False hands it back (a
        refused submission)."""
        before = (self.token, self.extra, self.version)
        self.token, self.extra = token, dict(extra)
        if self.lost or not Lease.renew(self):
            self.token, self.extra, self.version = before
            raise LeaseLost(self.lost or f"lost the lease of feature set {self.name!r} in {self.objects.url} "
                                         f"before handing it to the job array")
        self.handed = handed

    def release(self) -> None:
        if self.lost or self.handed:   # a job array's: it expires after its job has ended
            self._stop.set()
            return
        super().release()


def holder_live(info: Mapping[str, Any]) -> str | None:
    """Who holds a set lease ``info`` (words for an Error line), or None when another run may take it
    (:func:`.leases.holder_words` over the one takeover rule)."""
    return holder_words(dict(info), float(info.get("expires", 0)))


#: a tokenize that replaces the tokens on object storage (tokenize/runner.py): its staged tokens are
#: complete and a swap into ``tokens/`` is to be finished
TOKENS_SWAP = ".vsekit/swaps/tokens.json"


# --- block commit records -------------------------------------------------------------------------
def record_key(name: str, generation: str, index: int) -> str:
    return f".vsekit/commits/{name}/{generation}/{int(index):08d}.json"
