"""The retrieval models: encoders, similarities and losses, and the registry that creates them by name.

``create_model(name, ...)`` builds any registered model (``base.py`` states the contract every model
meets): ``vse``/``order`` (``vse.py``), ``seam-e``/``seam-c``/``seam-g`` (``seam.py``), ``sman``/
``sman-sim`` (``sman.py``), ``saf``/``sgr`` (``sgraf.py``, with the T-EMDE global module of
``temde.py``). The training harness (data, trainer, runs, evaluation) is ``vsekit.train``.
"""

from .base import RetrievalModel, create_model, model_names, register_model  # noqa: F401
