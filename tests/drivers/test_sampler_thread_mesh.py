"""The async driver's sampler thread traces under the run's mesh (`rljax.drivers.overlap`).

JAX's `jax.set_mesh` mesh is per thread. `rljax.sharding.placement.build_layouts` sets an expert
or context mesh as JAX's mesh (globally, in the main thread) because the MoE block and the
context-parallel forward read it; a plain `threading.Thread` does not see it.
"""

from __future__ import annotations

import threading

import jax
import pytest

from rljax.drivers.overlap import thread_in_callers_mesh


def _axes_seen(make_thread) -> tuple:
    seen = {}
    thread = make_thread(lambda: seen.update(axes=jax.sharding.get_abstract_mesh().axis_names), "probe")
    thread.start()
    thread.join()
    return seen["axes"]


@pytest.fixture
def expert_mesh():
    mesh = jax.make_mesh((2, 4), ("fsdp", "expert"))
    jax.set_mesh(mesh)  # as build_layouts sets it: global, not a `with`
    yield mesh
    jax.set_mesh(None)


def test_the_sampler_thread_sees_the_runs_expert_mesh(expert_mesh):
    """Catches: `AsyncDriver.start` creating a plain thread (the thread sees an empty mesh, so the
    MoE block traces without its all-to-all; this test's first assertion shows the plain
    thread's view)."""
    plain = lambda target, name: threading.Thread(target=target, name=name)  # noqa: E731
    assert _axes_seen(plain) == ()
    assert _axes_seen(thread_in_callers_mesh) == ("fsdp", "expert")


def test_without_a_run_mesh_the_thread_has_none():
    """A dense one-device run sets no mesh: the thread runs with none (no stale mesh invented)."""
    jax.set_mesh(None)
    assert _axes_seen(thread_in_callers_mesh) == ()


def test_the_async_driver_starts_its_sampler_with_it():
    """`AsyncDriver.start` builds its producer thread with `thread_in_callers_mesh`.
    Catches: the driver going back to `threading.Thread(target=self._produce, ...)`."""
    import inspect

    from rljax.drivers import overlap

    source = inspect.getsource(overlap.AsyncDriver.start)
    assert "thread_in_callers_mesh(self._produce" in source and "threading.Thread(" not in source
