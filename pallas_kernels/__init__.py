"""Pallas kernels and their pure-jnp references (KDA, MLA)."""
