"""gpulease: GPUs leased to notebook cells for exactly as long as their training function runs."""

__version__ = "0.1.0"
