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
than one device are not written either (see below); they compile as before, and few repeat.

Memory. A worker runs hundreds of tests; JAX keeps every compiled program (and its constants)
alive in its caches, and glibc keeps freed heap mapped, so a worker grew to 7.9 GB RSS over a
full run (two workers and their CLI children on a 24 GB machine with no swap). XLA:CPU segfaulted
in such workers, never alone, in compiling or serialising large programs (below): an allocation
that failed under that pressure is the likeliest cause. So after each test module the worker
clears JAX's caches, collects, and returns free heap to the OS (`malloc_trim`); the programs a
later module needs again come back from the persistent cache.

Sharded sampler programs (`@pytest.mark.isolated`) run in a fresh Python process. In full
two-worker runs of this suite, jaxlib 0.10.2's XLA:CPU segfaulted in a long-lived worker while
compiling (`backend_compile_and_load`) or serialising (`LoadedExecutable.serialize`, JAX's cache
write) the one-program static sampler over a multi-device mesh, in five runs on 2026-11-26,
in three different sharded-sampler tests (faulthandler traces); every one passes alone and in a
fresh process. A child killed by a signal is run once more, with a warning in the summary; any
other failure fails the test with the child's output.
"""

import atexit
import ctypes
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="rljax-test-xla-cache-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
# tests/ mirrors the package (tests/<package>/test_<module>.py); its helper modules (factories,
# stand-ins) live here, and a test module may import another's shared setup by its unique name
# (`from test_iteration import CONTROLS`), whichever folder pytest reached first.
_TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_TESTS] + sorted(os.path.join(_TESTS, d) for d in os.listdir(_TESTS)
                                 if os.path.isdir(os.path.join(_TESTS, d))
                                 and any(f.startswith("test_") for f in os.listdir(os.path.join(_TESTS, d))))

import jax  # noqa: E402
import pytest  # noqa: E402
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


# ----------------------------------------------------------------------------- isolated tests

_ISOLATED = "RLJAX_TEST_ISOLATED"  # set in the child to the node id it runs


def pytest_configure(config):
    config.addinivalue_line("markers", "isolated: runs in a fresh Python process (see this module's docstring)")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker("isolated") is None or os.environ.get(_ISOLATED) == pyfuncitem.nodeid:
        return None
    cmd = [sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider", pyfuncitem.nodeid]
    env = {**os.environ, _ISOLATED: pyfuncitem.nodeid}
    for attempt in (1, 2):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(pyfuncitem.config.rootpath),
                              timeout=900)
        if proc.returncode >= 0:
            break
        warnings.warn(f"{pyfuncitem.nodeid}: the isolated child died of signal {-proc.returncode} "
                      f"(attempt {attempt}); {'running it again' if attempt == 1 else 'giving up'}", stacklevel=1)
    if proc.returncode != 0:
        pytest.fail(f"isolated child exited {proc.returncode}:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}",
                    pytrace=False)
    return True


# ----------------------------------------------------------------------------- memory


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_the_module():
    yield
    jax.clear_caches()
    gc.collect()
    _malloc_trim()
