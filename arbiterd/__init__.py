"""arbiterd: share one GPU between several resident llama.cpp models and other GPU programs."""

__version__ = "0.1.0"
