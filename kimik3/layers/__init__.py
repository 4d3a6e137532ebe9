"""Layers of the hybrid model: each a Flax module over a pure-jnp core."""
