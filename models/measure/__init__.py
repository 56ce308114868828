"""What tilewise measures about a network: receptive field, calibrated halo, footprint, tile dependence,
seams, warm-up checks, and the on-disk cache that keeps those measurements across restarts."""
