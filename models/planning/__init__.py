"""Planning a run before it starts: parameters, tile and batch sizing, the tile grid and its cost.

Light by design: :mod:`models.planning.params` loads without torch (the batch client uses it).
"""
