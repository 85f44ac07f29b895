"""Tidal: colocated reinforcement fine-tuning of language models on torchrun."""

__version__ = "0.1.0"
