"""`kimik3 train` fits the machine it runs on: a run that its memory or its corpus cannot hold is
refused before its first step, with the flags that change it; the memory estimate is XLA's own
figure of the compiled programs, and the batch a refusal suggests fits by that figure; a time
limit ends the whole run by its deadline on the run's clock."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimik3 import checkpoint, config, model, sizing, train

MiB = 2**20


@pytest.fixture
def text_dir(tmp_path, rng):
    """A directory corpus of 24 documents of 8 KiB of words: ~190K train tokens at a held-out
    fraction of 0.1 (the split is by 4 KiB block)."""
    words = np.array("the licence grants permission to copy and modify this software without fee".split())
    d = tmp_path / "text"
    d.mkdir()
    for i in range(24):
        (d / f"doc{i}.txt").write_text(" ".join(rng.choice(words, 1600))[: 8 * 1024])
    return str(d)


def _tc(text_dir, tmp_path, **kw):
    base = dict(
        config="tiny",
        steps=500,  # one schedule for every test: the step programs are the same, compiled once a run
        batch=4,
        seq_len=32,
        warmup_steps=2,
        eval_every=20,
        eval_batches=1,
        corpus=text_dir,
        held_out_fraction=0.1,
        out=str(tmp_path / "out"),
        progress=False,
    )
    return train.TrainConfig(**{**base, **kw})


def _programs(tc, held_shape=None):
    """compile_programs for `tc`; the held-out windows as one micro-batch unless `held_shape`."""
    cfg = config.get_config(tc.config)
    held_shape = held_shape or (1, tc.batch // tc.grad_accum, tc.seq_len + 1)
    return train.compile_programs(tc, cfg, model.abstract_params(cfg, "float32"), held_shape)


def test_mini_on_a_small_memory_budget_is_refused_before_compiling_naming_the_flags(text_dir, tmp_path):
    tc = _tc(text_dir, tmp_path, config="mini", batch=32, seq_len=512, memory_budget=256 * MiB)
    with pytest.raises(train.DoesNotFit) as e:
        train.train(tc)
    msg = str(e.value)
    # mini's params, gradients and Adam moments alone (~0.65 GiB) are past 256 MiB: no batch helps
    assert "training mini at --batch 32 --seq-len 512 needs about 0.6" in msg and "0.25 GiB" in msg
    for flag in ("--batch", "--seq-len", "--config", "--memory-gib"):
        assert flag in msg, flag
    assert not os.path.exists(tc.out)  # refused before writing anything


def test_the_estimate_is_xlas_figure_of_the_step_and_the_evaluation(text_dir, tmp_path):
    tc = _tc(text_dir, tmp_path)
    mem = _programs(tc).memory
    params = sizing.tree_bytes(model.abstract_params(config.tiny(), "float32"))
    assert mem.params == params and mem.optimizer_state == pytest.approx(2 * params, rel=0.01)  # Adam: mu, nu
    # the step's own buffers (params and optimizer state donated: once) plus the resident held-out windows
    assert mem.step.aliased >= params + mem.optimizer_state
    assert mem.total == max(mem.step.peak + mem.held_out, mem.evaluation.peak + mem.optimizer_state)
    assert mem.floor < mem.total < mem.floor + mem.step.temporaries + mem.evaluation.peak


def test_a_refusal_suggests_a_batch_that_fits_by_xlas_figure(text_dir, tmp_path):
    """The suggestion extrapolates activations linearly in a micro-batch's tokens: the batch it
    names must fit by XLA's own figure for that batch, and not by a wide margin (within 2x)."""
    tc = _tc(text_dir, tmp_path)
    mem = _programs(tc).memory
    budget = int(0.6 * mem.total)
    with pytest.raises(train.DoesNotFit) as e:
        train.check_memory(mem, tc, budget, "an injected budget")
    msg = str(e.value)
    assert f"{budget / 2**30:.2f} GiB (an injected budget)" in msg
    for flag in ("--batch", "--seq-len", "--grad-accum", "--memory-gib"):  # tiny: no smaller --config
        assert flag in msg, flag
    batch = int(re.search(r"e\.g\. --batch (\d+)", msg).group(1))
    assert 1 <= batch < tc.batch
    suggested = _programs(_tc(text_dir, tmp_path, batch=batch)).memory
    assert budget / 2 < suggested.total <= budget
    train.check_memory(suggested, tc, budget, "an injected budget")  # no raise


def test_gradient_accumulation_takes_the_same_step_in_less_memory(text_dir, tmp_path):
    rng = np.random.default_rng(0)
    windows = jnp.asarray(rng.integers(0, 256, (4, 33)), jnp.int32)
    drawn = jax.tree.map(  # random weights of the right shapes, without compiling an init
        lambda s: rng.normal(0.0, 0.1, s.shape).astype(s.dtype), model.abstract_params(config.tiny(), "float32")
    )
    out = {}
    for accum in (1, 4):
        tc = _tc(text_dir, tmp_path, grad_accum=accum)
        programs = _programs(tc, held_shape=(1, 4, 33))  # one evaluation program for both
        params = jax.tree.map(jnp.asarray, drawn)
        state = train.optimizer(tc).init(params)
        params, _, loss, gnorm = programs.step(params, state, windows)
        out[accum] = (programs.memory, float(loss), float(gnorm), params)
    (m1, loss1, g1, p1), (m4, loss4, g4, p4) = out[1], out[4]
    assert loss4 == pytest.approx(loss1, rel=1e-5) and g4 == pytest.approx(g1, rel=1e-4)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert m4.step.temporaries < 0.6 * m1.step.temporaries


class TickingClock:
    """A clock that advances `tick` seconds each time it is read: a run's phases take a tick each."""

    def __init__(self, tick: float = 1.0):
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def test_a_time_limit_ends_the_run_by_its_deadline_on_the_runs_clock(text_dir, tmp_path):
    tc = _tc(text_dir, tmp_path, eval_every=2, max_seconds=12)
    result, params = train.train(tc, clock=TickingClock())
    assert result["stopped_early"] and 1 < result["steps_done"] < 12
    # set-up, the evaluations, the steps and the final checkpoint all count, and end by the deadline
    assert result["setup_seconds"] > 0 and result["seconds"] <= tc.max_seconds
    done = result["steps_done"]
    assert result["evals"][-1]["step"] == done and result["history"][-1]["step"] == done
    assert [e["step"] for e in result["evals"][1:-1]] == list(range(2, done, 2))
    restored, _ = checkpoint.restore(result["checkpoint"])
    np.testing.assert_array_equal(np.asarray(restored["embed_vd"]), np.asarray(params["embed_vd"]))


def test_a_limit_near_its_end_runs_no_step_it_cannot_finish(text_dir, tmp_path):
    # a second a phase: set-up and the first evaluation take 2 s; the first step is reckoned at 3
    # (three forwards of a micro-batch, at the evaluation's rate), so 3.5 s leave room for the
    # checkpoint alone, and 8.5 s for a few steps and the final evaluation and checkpoint
    for limit, steps in ((3.5, 0), (8.5, 4)):
        tc = _tc(text_dir, tmp_path / str(limit), max_seconds=limit)
        result, _ = train.train(tc, clock=TickingClock())
        assert result["steps_done"] == steps and [e["step"] for e in result["evals"]] == sorted({0, steps})
        assert result["seconds"] <= limit


def test_a_train_split_smaller_than_a_batch_is_refused_naming_the_flags(text_dir, tmp_path):
    tc = _tc(text_dir, tmp_path, batch=1024, seq_len=256)
    with pytest.raises(train.DoesNotFit, match="a batch needs 1024") as e:
        train.train(tc)
    for flag in ("--batch", "--seq-len", "--corpus"):
        assert flag in str(e.value), flag
    assert not os.path.exists(tc.out)
    with pytest.raises(train.DoesNotFit, match="--max-corpus-mb"):
        train.check_train_windows(np.zeros(100, np.int32), _tc(text_dir, tmp_path, max_corpus_bytes=1000))


def test_a_short_held_out_split_is_evaluated_on_the_windows_it_holds(text_dir, tmp_path, caplog):
    # the licence corpus's 12,291 held-out tokens at --batch 32 --seq-len 512: 24 windows, not 16 batches
    held = np.arange(12_291, dtype=np.int32)
    tc = _tc(text_dir, tmp_path, batch=32, seq_len=512, eval_batches=16)
    windows = train.held_out_windows(held, tc)
    assert windows.shape == (1, 24, 513) and "24 windows" in caplog.text
    np.testing.assert_array_equal(windows[0, 3], held[3 * 512 : 4 * 512 + 1])
    # micro-batches of batch / grad_accum windows; enough text: eval_batches * batch windows
    assert train.held_out_windows(held, _tc(text_dir, tmp_path, batch=8, seq_len=64, grad_accum=2)).shape == (2, 4, 65)
    assert train.held_out_windows(held, _tc(text_dir, tmp_path, batch=8, seq_len=64, eval_batches=3)).shape == (
        3,
        8,
        65,
    )
    with pytest.raises(train.DoesNotFit, match="--seq-len"):
        train.held_out_windows(held[:100], tc)


def test_an_out_directory_holding_a_checkpoint_is_refused_before_training(text_dir, tmp_path):
    tc = _tc(text_dir, tmp_path)
    os.makedirs(os.path.join(tc.out, "checkpoint"))
    with pytest.raises(ValueError, match="another --out"):
        train.train(tc)


def test_the_cli_refuses_mini_up_front_with_the_flags(text_dir, tmp_path, capsys):
    from serving import cli

    out = str(tmp_path / "runs")
    argv = ["train", "--config", "mini", "--corpus", text_dir, "--memory-gib", "0.25", "--out", out]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kimik3: error: training mini at --batch 32 --seq-len 512")
    assert "--config" in err and "--memory-gib" in err and not os.path.exists(out)


def test_train_config_refuses_a_grad_accum_that_does_not_divide_the_batch():
    with pytest.raises(ValueError, match="grad_accum"):
        train.TrainConfig(batch=6, grad_accum=4)
    with pytest.raises(ValueError, match="memory_budget"):
        train.TrainConfig(memory_budget=0)


def test_available_memory_reads_the_device_the_host_and_a_cgroup_limit(tmp_path):
    class Device:
        device_kind, platform = "H100", "gpu"

        def memory_stats(self):
            return {"bytes_limit": 80 * 2**30, "bytes_in_use": 2**30}

    assert sizing.available_memory(Device()) == (79 * 2**30, "H100 memory free")
    free, source = sizing.available_memory(jax.devices("cpu")[0])
    assert free > 0 and ("host" in source or "cgroup" in source)
    (tmp_path / "memory.max").write_text("4294967296\n")
    (tmp_path / "memory.current").write_text(str(2**30))
    assert sizing._cgroup_available(str(tmp_path)) == 3 * 2**30
    (tmp_path / "memory.stat").write_text(f"anon {2**29}\ninactive_file {2**29}\n")  # page cache: reclaimable
    assert sizing._cgroup_available(str(tmp_path)) == 3.5 * 2**30
    (tmp_path / "memory.max").write_text("max\n")
    assert sizing._cgroup_available(str(tmp_path)) is None
