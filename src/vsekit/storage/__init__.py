"""The Zarr store, dataset sources and interop."""

from .store import (  # noqa: F401
    DONE, FAILED, PENDING, SPLITS, SPLIT_CODES, Block, FeatureSet, FeatureStore, FormatVersionError,
    ProvenanceError, StoreError, config_hash, row_chunk_for, split_code, write_array, write_strings,
)
