"""The retrieval models: encoders, similarities and losses, and the registry that creates them by name.

``create_model(name, ...)`` builds any registered model (``base.py`` states the contract every model
meets): ``vse``/``order`` (``vse.py``), ``seam-e``/``seam-c``/``seam-g`` (``seam.py``), ``sman``/
``sman-sim`` (``sman.py``), ``saf``/``sgr`` (``sgraf.py``, with the T-EMDE global module of
``temde.py``). The training harness (data, trainer, checkpoints, evaluation) is ``vsekit.train``.
"""

from __future__ import annotations

from typing import Any

# The built-in models register themselves when imported; importing them here by name (not through
# importlib inside ``base``) keeps ``base`` free of imports of the modules that build on it.
from . import seam, sgraf, sman, vse  # noqa: F401
from .base import _MODELS, RetrievalModel, lookup, register_model  # noqa: F401


def model_names() -> list[str]:
    return sorted(_MODELS)


def create_model(name: str, **kwargs: Any) -> RetrievalModel:
    return lookup(_MODELS, "model", name)(**kwargs)
