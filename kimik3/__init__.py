"""kimik3: the Kimi-K3 hybrid model (KDA + MLA, LatentMoE, ViT) and its serving stack in JAX."""
