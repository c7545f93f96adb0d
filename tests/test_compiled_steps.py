"""`CompiledSteps`: programs made once per shape, kept on disk, found again only by the same
identity, loaded instead of compiled, counted; the disk cache stays under its bound."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.compiled_steps import CompiledSteps, StepShape, trim_cache


def _steps(identity: str = "toy-v1") -> CompiledSteps:
    """A toy step: x [T] float32 -> (x * 3 + T, sum of x)."""

    def lower(shape, x):
        return jax.jit(lambda x: (x * 3 + shape.num_tokens, jnp.sum(x))).trace(x).lower()

    return CompiledSteps("toy", lower, lambda s: (np.zeros(s.num_tokens, np.float32),),
                         lambda s: jax.tree.structure((0, 0)), identity, jax.devices()[:1],
                         max_workers=2)


def _check(steps: CompiledSteps, shape: StepShape):
    x = np.random.default_rng().standard_normal(shape.num_tokens).astype(np.float32)
    y, total = steps.run(shape, x)
    # x * 3 + T near 0 cancels: its float32 rounding (one FMA or two roundings) scales with
    # the operands, T, not with the result.
    np.testing.assert_allclose(np.asarray(y), x * 3 + shape.num_tokens, rtol=1e-6,
                               atol=1e-6 * shape.num_tokens)
    # A sum of random signs can land near 0: its rounding error scales with sum |x|.
    np.testing.assert_allclose(float(total), x.sum(), rtol=0, atol=1e-6 * np.abs(x).sum())


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXINFER_EXECUTABLE_CACHE", str(tmp_path))
    return tmp_path


def test_programs_are_loaded_by_the_next_instance_not_compiled(cache):
    shapes = [StepShape("sample", t, 1, 4) for t in (8, 16, 32)]
    first = _steps()
    progress = []
    first.compile_many(shapes + shapes[:1], lambda done, total: progress.append((done, total)))
    assert (first.num_compiled, first.num_loaded, first.num_on_demand) == (3, 0, 0)
    assert progress == [(1, 3), (2, 3), (3, 3)] and first.shapes() == sorted(shapes)
    assert len(list(cache.glob("*.jexe"))) == 3
    for s in shapes:
        _check(first, s)
    assert first.num_on_demand == 0

    second = _steps()  # a new process would do the same: same source, devices, identity
    for s in shapes:
        _check(second, s)
    assert (second.num_compiled, second.num_loaded) == (0, 3)
    assert second.num_on_demand == 3  # nobody had warmed these up in this instance

    other = _steps("toy-v2")  # another model or setting: its own programs
    _check(other, shapes[0])
    assert (other.num_compiled, other.num_loaded) == (1, 0)


def test_arguments_of_other_shapes_get_their_own_program(cache):
    """Two steps of one identity and one shape whose arguments differ in size (a setting
    the identity omits sizes one, as max_num_seqs sizes the runner's last-token slots)
    do not share a program on disk: the second compiles its own and runs."""

    def steps(extra: int) -> CompiledSteps:
        def lower(shape, x, slots):
            return jax.jit(lambda x, slots: (x * 3 + shape.num_tokens, jnp.sum(x) + slots[0])
                           ).trace(x, slots).lower()

        return CompiledSteps("toy", lower, lambda s: (np.zeros(s.num_tokens, np.float32),
                                                      np.zeros(extra, np.float32)),
                             lambda s: jax.tree.structure((0, 0)), "toy-v1",
                             jax.devices()[:1], max_workers=2)

    shape = StepShape("sample", 8, 1, 4)
    x = np.random.default_rng().standard_normal(8).astype(np.float32)
    for extra in (4, 8):
        step = steps(extra)
        y, _ = step.run(shape, x, np.ones(extra, np.float32))
        np.testing.assert_allclose(np.asarray(y), x * 3 + 8, rtol=1e-6, atol=1e-5)
        assert (step.num_compiled, step.num_loaded) == (1, 0)
    assert len(list(cache.glob("*.jexe"))) == 2
    again = steps(4)
    again.run(shape, x, np.ones(4, np.float32))
    assert (again.num_compiled, again.num_loaded) == (0, 1)


def test_a_damaged_file_is_compiled_again(cache):
    shape = StepShape("sample", 8, 1, 4)
    _steps().compile_many([shape])
    (path,) = cache.glob("*.jexe")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    again = _steps()
    _check(again, shape)
    assert (again.num_compiled, again.num_loaded) == (1, 0)


def test_prefetch_compiles_in_the_background(cache, monkeypatch):
    monkeypatch.setenv("JAXINFER_EXECUTABLE_CACHE", "0")
    steps = _steps()
    shape = StepShape("sample", 8, 1, 8)
    steps.prefetch(shape)
    assert steps.has(shape)
    steps._programs[shape].result(timeout=120)  # finished in the background
    _check(steps, shape)
    assert (steps.num_compiled, steps.num_on_demand) == (1, 0)
    assert not list(cache.glob("*.jexe"))


def test_trim_cache_drops_the_programs_used_longest_ago(tmp_path):
    for i, name in enumerate("abcd"):
        path = tmp_path / f"{name}.jexe"
        path.write_bytes(os.urandom(1000))
        os.utime(path, (1000 + i, 1000 + i))
    os.utime(tmp_path / "a.jexe")  # loaded just now: the newest
    (tmp_path / "keep.txt").write_bytes(os.urandom(5000))  # not a program
    trim_cache(tmp_path, max_bytes=2500)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jexe", "d.jexe", "keep.txt"]


def test_a_failed_background_compile_is_tried_again_when_needed(cache):
    steps = _steps()
    lower, calls = steps._lower, []

    def flaky(shape, x):  # the first compile fails (e.g. the device ran out of memory)
        calls.append(shape)
        if len(calls) == 1:
            raise RuntimeError("compile failed")
        return lower(shape, x)

    steps._lower = flaky
    shape = StepShape("sample", 16, 1, 4)
    steps.prefetch(shape)
    with pytest.raises(RuntimeError):
        steps._programs[shape].result(timeout=120)
    _check(steps, shape)
    assert len(calls) == 2 and steps.num_on_demand == 1


def test_a_compile_without_memory_to_autotune_falls_back_untuned(cache):
    """On the GPU, a compile that runs out of memory autotuning its GEMMs (beside the KV
    cache) compiles again with XLA's default GEMM configurations, kept in memory only."""
    calls = []

    class Lowered:
        def __init__(self, lowered):
            self.lowered = lowered

        def compile(self, options=None):
            calls.append(options)
            if options is None:
                raise jax.errors.JaxRuntimeError(
                    "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1018.00MiB")
            return self.lowered.compile()  # the CPU has no autotune option to pass

    class GPU:
        platform = "gpu"

    def lower(shape, x):
        return Lowered(jax.jit(lambda x: (x * 3 + shape.num_tokens, jnp.sum(x))).trace(x)
                       .lower())

    steps = CompiledSteps("toy", lower, lambda s: (np.zeros(s.num_tokens, np.float32),),
                          lambda s: jax.tree.structure((0, 0)), "toy-oom", [GPU()])
    _check(steps, StepShape("sample", 8, 1, 4))
    assert calls == [None, {"xla_gpu_autotune_level": 0}] and steps.num_compiled == 1
    assert not list(cache.glob("*.jexe"))  # not kept: a warm-up with room tunes it
    cpu = CompiledSteps("toy", lower, lambda s: (np.zeros(s.num_tokens, np.float32),),
                        lambda s: jax.tree.structure((0, 0)), "toy-oom-cpu", jax.devices()[:1])
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        cpu.run(StepShape("sample", 8, 1, 4), np.zeros(8, np.float32))


def test_runners_of_other_max_num_seqs_get_their_own_draw(cache):
    """A draw's last-token slots follow max_num_seqs, which none of its arguments shows:
    runners that differ only there sample one batch each from one executable cache, each
    with a draw of its own (a shared one failed the next step's call)."""
    from jaxinfer.engine.request import SamplingParams
    from jaxinfer.engine.runner import ModelRunner
    from jaxinfer.engine.scheduler import SeqChunk
    from jaxinfer.loading.presets import preset_config, random_model

    model = random_model(preset_config("tiny"), jnp.float32)
    params = SamplingParams(temperature=0.9)
    chunks = [SeqChunk(new_tokens=[3, 4, 5], num_cached=0, pages=[0], params=params)]
    for max_num_seqs in (4, 64):
        runner = ModelRunner(model, num_pages=8, page_size=16, max_model_len=64,
                             max_num_seqs=max_num_seqs)
        runner.step(chunks)
        assert runner._prev_tokens.shape == (runner.prev_slots,)
        decode = [SeqChunk(new_tokens=[0], num_cached=3, pages=[0], params=params,
                           prev_row=0)]
        (token,) = runner.step(decode).tokens[:, 0]  # takes the draw's last tokens
        assert 0 <= token < preset_config("tiny").vocab_size
