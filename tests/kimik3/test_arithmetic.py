"""Where runs that reuse state and runs that recompute it must agree to the bit."""

import jax
import jax.numpy as jnp

from kimik3 import arithmetic


def test_fp32_weights_on_the_cpu_are_exact_and_bf16_weights_never_are():
    assert jax.default_backend() == "cpu"
    assert arithmetic.exact_arithmetic({"embed_vd": jnp.zeros((2, 2), jnp.float32)})
    assert not arithmetic.exact_arithmetic({"embed_vd": jnp.zeros((2, 2), jnp.bfloat16)})


def test_the_matmul_precision_setting_is_read_where_it_is_set():
    assert arithmetic.matmul_precision() == "default"
    with jax.default_matmul_precision("highest"):
        assert arithmetic.matmul_precision() == "highest"
