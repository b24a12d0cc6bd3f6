"""Feature extraction: backbones, crops, layer taps, grids and regions; the runner and its dask
distribution. ``extract(store, model, kind, ...)`` (or ``run_job(store, ExtractOptions(...),
Execution(...))``) is the entry point of ``vsekit extract``; docs/architecture.md follows a block
from the command line to the disk.

Imports no Click, and torch/dask only when a model or a cluster is used.
"""

from .backbones import build_model, get_backbone, register_backbone, registered_backbones  # noqa: F401
from .images import load_image, make_crops  # noqa: F401
from .plan import KINDS, Plan, make_plan  # noqa: F401
from .job import Execution, ExtractOptions  # noqa: F401
from .runner import ExtractResult, default_name, extract, run_job  # noqa: F401
from .taps import list_layers  # noqa: F401
