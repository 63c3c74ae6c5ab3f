"""Benchmarks run by ``fibattn bench attention|train|generate|hf-cache``: side-by-side speed ratios
(never timed tests) and cache sizes. Each suite module has its own ``configure_parser`` and ``run``."""
