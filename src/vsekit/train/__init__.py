"""Datasets over the store, encoders, similarity models, losses, trainer and evaluation."""
