"""The profile reader sums a trace's device ops per step, by the model part their scope names."""

import jax
import pytest
from jax.profiler import ProfileData

from benchmarks import profile

SPACE = """
planes { id: 1 name: "/host:CPU"
  lines { id: 1 name: "python" events { metadata_id: 1 offset_ps: 0 duration_ps: 9000000000 } }
  event_metadata { key: 1 value { id: 1 name: "host work" } }
}
planes { id: 2 name: "/device:GPU:0"
  lines { id: 1 name: "XLA Modules" events { metadata_id: 4 offset_ps: 0 duration_ps: 99000000000 } }
  lines { id: 2 name: "XLA Ops" timestamp_ns: 0
    events { metadata_id: 1 offset_ps: 0 duration_ps: 4000000000 stats { metadata_id: 10 str_value: "KimiK3/layer_0/layer_0.mix/kda" } }
    events { metadata_id: 1 offset_ps: 0 duration_ps: 4000000000 stats { metadata_id: 10 str_value: "KimiK3/layer_0/layer_0.mix/kda" } }
    events { metadata_id: 2 offset_ps: 0 duration_ps: 6000000000 stats { metadata_id: 10 str_value: "KimiK3/layer_1/layer_1.ffn/moe" } }
    events { metadata_id: 3 offset_ps: 0 duration_ps: 2000000000 stats { metadata_id: 10 str_value: "KimiK3/layer_1/layer_1.mix/mla" } }
    events { metadata_id: 3 offset_ps: 0 duration_ps: 1000000000 stats { metadata_id: 10 str_value: "KimiK3/final_norm" } }
    events { metadata_id: 5 offset_ps: 0 duration_ps: 3000000000 }
  }
  event_metadata { key: 1 value { id: 1 name: "kda_decode" } }
  event_metadata { key: 2 value { id: 2 name: "moe_gemm" } }
  event_metadata { key: 3 value { id: 3 name: "fusion.7" } }
  event_metadata { key: 4 value { id: 4 name: "jit_decode" } }
  event_metadata { key: 5 value { id: 5 name: "copy.1" } }
  stat_metadata { key: 10 value { id: 10 name: "tf_op" } }
}
"""


def test_device_ops_are_summed_per_step_by_layer_kind_and_half():
    times = profile.op_times(ProfileData.from_text_proto(SPACE))
    assert times[("KimiK3/layer_0/layer_0.mix/kda", "kda_decode")] == (8e6, 2)  # host plane and modules line left out
    out = profile.summarize(times, 2, profile.model_part(("kda", "mla")))
    assert out["total_ms"] == 10.0  # 20 ms of ops over 2 steps
    assert out["parts_ms"] == {"kda mixer": 4.0, "mla ffn": 3.0, "other": 1.5, "mla mixer": 1.0, "embed and head": 0.5}
    assert out["top_ops"][0] == ["kda mixer", "kda_decode", 4.0, 1]


def test_a_backend_without_a_device_plane_gives_no_profile():
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU has no device plane")
    f = jax.jit(lambda x: x * 2)
    assert profile.device_profile(lambda: f(1.0), 2, profile.model_part(())) is None
