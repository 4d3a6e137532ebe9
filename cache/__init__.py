"""KV and state caching: block hashing, pools, paged manager, host tier, multimodal cache."""
