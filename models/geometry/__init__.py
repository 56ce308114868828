"""Spatial geometry: how an input maps onto a model's grid (spacing, orientation, alignment) and how
outputs map back onto the input's own grid."""
