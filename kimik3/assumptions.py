"""Every fact about full-scale Kimi-K3 that the public record does not fix.

The public record fixes: ~2.8T parameters, ~1.6 TB of weights, a 3:1 KDA:MLA
hybrid stack, a LatentMoE with 896 routed experts of which 16 are active plus 2
shared experts, MXFP4 routed experts, SiTU-GLU expert activations, DeepSeek-V3
MLA shapes with NoPE, and the KDA gate form with lower bound -5.

Everything below is a named assumption.  `kimik3.config.kimi_k3()` reads these
and nothing else, so changing an assumption is a one-line edit here; the
capacity planner and the sharding plans follow.
"""

KIMI_K3_ASSUMPTIONS: dict[str, object] = {
    # Width and depth follow Kimi-K2 (d_model 7168, 61 layers); with the MoE
    # sizes below the total lands within 1% of 2.8T parameters and 1.6 TB.
    "d_model": 7168,
    "n_layers": 61,
    "vocab_size": 163_840,
    "max_seq_len": 262_144,
    # KDA: head_dim 128 as in Kimi Linear; heads scale with width.
    "kda_heads": 64,
    "kda_head_dim": 128,
    # MLA: DeepSeek-V3 ranks; 96 heads (one data-parallel decode rank holds all).
    "mla_heads": 96,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_dim": 128,
    "qk_rope_dim": 64,
    "v_head_dim": 128,
    # LatentMoE: latent width 4096 (d / 1.75), expert intermediate 4096.
    "moe_latent_dim": 4096,
    "moe_expert_dim": 4096,
    "moe_shared_dim": 4096,  # per shared expert, on the full width
    "dense_ffn_dim": 18_432,  # layer 0 (Kimi-K2's dense intermediate)
    "routed_scaling_factor": 2.827,  # Kimi-K2's value
    # The routed branch ends in an RMSNorm over the latent combine, which would
    # erase a scaling applied before it; we therefore apply the routed scaling
    # factor to the routed branch after the latent up-projection.
    "routed_scaling_after_up_projection": True,
    # SiTU-GLU: s1*tanh(gate/s1)*sigmoid(gate) * s2*tanh(up/s2).  The public
    # descriptions give the form, not the caps; we take 10 for both.  All FFNs
    # (dense layer 0, shared and routed experts) use it.
    "situ_gate_cap": 10.0,
    "situ_up_cap": 10.0,
    # ViT: a SigLIP-so400m-like encoder (MoonViT is of that class), 2x2 merge.
    "vit_width": 1152,
    "vit_depth": 27,
    "vit_heads": 16,
    "vit_mlp_dim": 4304,
    "vit_patch_size": 14,
    "vit_image_size": 448,
    "vit_merge": 2,
}
