"""Hydra configs of the trainer, installed as the package data ``flashtrain.conf`` (never a top-level ``conf``)."""
