"""Running a plan: the tiled passes (with test-time augmentation and out-of-memory retries) and the
shared batches that put tiles of several requests into one forward pass."""
