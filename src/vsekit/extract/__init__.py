"""Feature extraction: backbones, crops, layer taps, grids and regions; the runner and its dask
distribution. ``extract(store, model, kind, ...)`` is the entry point of ``vsekit extract``.

Imports no Click, and torch/dask only when a model or a cluster is used.
"""

from .backbones import build_model, get_backbone, register_backbone, registered_backbones  # noqa: F401
from .images import load_image, make_crops  # noqa: F401
from .plan import KINDS, Plan, make_plan  # noqa: F401
from .runner import ExtractResult, default_name, extract  # noqa: F401
from .taps import list_layers  # noqa: F401
