"""videotrain: memory-efficient training of per-frame video models."""

__version__ = "0.1.0"
