"""Streaming generation: per-layer key/value caches (a ring of the last ``max(D) + 1`` rows
for a sparse layer) and the decode loop over any fibattn-shaped model."""
