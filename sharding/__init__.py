"""Meshes, logical-axis sharding rules, and the sharded prefill/decode layers (issue 8)."""
