"""Pieces of the trainer (``fibattn.train``): optimiser and schedule, distributed setup,
progress/metrics logging and training-state checkpoints."""
