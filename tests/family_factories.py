"""Tiny random checkpoints of the dense families beyond Llama (``worker.model.tiny_families``)."""

from worker.model.tiny_families import FAMILIES, LONG_ROPE_AT, WINDOW, make_family_checkpoint

__all__ = ["FAMILIES", "LONG_ROPE_AT", "WINDOW", "make_family_checkpoint"]
