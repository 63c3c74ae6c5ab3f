"""Evaluation: perplexity across lengths on token arrays, and the same for a run folder
(data checks, ``eval.json``, the results database, plots, the learned-alpha report)."""
