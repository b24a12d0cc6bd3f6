"""The Zarr store, dataset sources and interop."""

from .store import (  # noqa: F401
    DONE, FAILED, PENDING, SPLITS, SPLIT_CODES, Block, FeatureSet, FeatureStore, FormatVersionError,
    ProvenanceError, StoreError, config_hash, row_chunk_for, split_code, write_array, write_strings,
)
from .sources.butd import ingest_butd  # noqa: F401,E402
from .sources.coco import ingest_coco  # noqa: F401,E402
from .sources.common import IngestError, IngestReport  # noqa: F401,E402
from .sources.folder import ingest_folder  # noqa: F401,E402
from .sources.karpathy import ingest_karpathy  # noqa: F401,E402
from .sources.precomp import ingest_precomp  # noqa: F401,E402
