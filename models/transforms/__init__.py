"""Intensity transforms of a model spec: whole-image and per-tile (streamed) preprocessing, their
step types, and whole-image statistics for networks with global pooling."""
