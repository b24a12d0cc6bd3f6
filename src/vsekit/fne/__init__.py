"""FNE post-processing: per-feature standardisation and ternary discretisation, out of core.

Implements the post-processing of the Full-Network Embedding (Garcia-Gasulla et al., "An
out-of-the-box full-network embedding for convolutional neural networks", 2018, §3), as used in
Vilalta et al.'s multimodal pipeline: z-standardise every feature with train-split statistics, then
map z to {-1, 0, 1} with thresholds -0.25 / 0.15. Both stages are dask graphs over the store.
"""

from .combined import fne  # noqa: F401
from .derived import Result  # noqa: F401
from .discretize import DEFAULT_THRESHOLDS, Discretize, discretize  # noqa: F401
from .pack import features_of, pack, packed_width, unpack, unpack_torch  # noqa: F401
from .standardize import Standardize, load_stats, standardize  # noqa: F401

__all__ = ["standardize", "discretize", "fne", "pack", "unpack", "unpack_torch", "packed_width",
           "features_of", "load_stats", "Standardize", "Discretize", "Result", "DEFAULT_THRESHOLDS"]
