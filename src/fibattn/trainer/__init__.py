"""Pieces of the trainer (``fibattn.trainer.trainer``): optimiser and schedule, distributed setup,
progress/metrics logging and training-state checkpoints."""
