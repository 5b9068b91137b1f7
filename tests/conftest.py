"""Shared test setup: 8 simulated CPU devices, f32 matmuls at full precision, tests/ importable.

XLA's CPU backend compiles at LLVM -O0 (`--xla_backend_optimization_level=0`): the suite is mostly
compiling tiny programs, and LLVM's optimisation passes are a large part of each compile (about a
quarter of the suite's CPU time). XLA's own passes (fusion, buffer assignment) do not change, so
memory analyses are byte-identical, and values agree with -O2 kernels up to f32 rounding; no
accelerator runs these kernels. Comparisons that sat within a few ulps of their tolerance were
measured again at -O0 (see their docstrings). Set XLA_FLAGS to run the suite with other flags.

Compiled programs go to a persistent XLA cache shared by this session's processes (the CLI and
notebook subprocesses inherit the environment): many tests build the same tiny programs again
(a new `jax.jit` per `train` call, a new process per CLI run), and a cache hit replaces seconds of
compilation by a file read. The same compiled code runs either way, so results are unchanged.
Programs with host callbacks (the fused RL iteration) are never cached by JAX. Programs over more
than one device are not written either: jaxlib 0.10.2's XLA:CPU segfaulted serialising sharded
sampler programs (`LoadedExecutable.serialize`, inside JAX's cache write) in full two-worker runs
of this suite, in three different sharded-sampler tests (2026-11-26, a faulthandler trace from
`put_executable_and_time`); each passes alone. They compile as before, and few repeat across tests.
"""

import atexit
import os
import shutil
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="rljax-test-xla-cache-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
from jax._src import compilation_cache as _compilation_cache  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def _single_device_writes_only(put):
    def put_single_device(cache_key, module_name, executable, *args, **kwargs):
        if len(executable.local_devices()) > 1:  # see the module docstring
            return None
        return put(cache_key, module_name, executable, *args, **kwargs)
    return put_single_device


if hasattr(_compilation_cache, "put_executable_and_time"):
    _compilation_cache.put_executable_and_time = _single_device_writes_only(
        _compilation_cache.put_executable_and_time)
