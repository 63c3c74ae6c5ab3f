"""Benchmarks run by ``fibattn bench attention|train|generate``: side-by-side speed ratios
(never timed tests). Each suite module has its own ``configure_parser`` and ``run``."""
