"""Datasets over the store, encoders, similarity models, losses, trainer and evaluation.

Entry points: ``train(store, features, model, out, ...)`` and ``evaluate(runs, ...)``; models are
created by name through ``create_model`` (see ``base.py`` for the contract every model meets).
"""

from ..models import RetrievalModel, create_model, model_names, register_model  # noqa: F401
from .config import PRESETS, TrainConfig, resolve_config  # noqa: F401
from .evaluation import compute_ranks, metrics_from_ranks  # noqa: F401
from .evaluate_run import evaluate  # noqa: F401
from .trainer import train  # noqa: F401
