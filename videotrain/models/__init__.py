"""Per-frame backbones, temporal heads, and the video classifier that joins them."""
