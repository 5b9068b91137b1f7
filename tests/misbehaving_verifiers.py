"""Verifiers for the reward tests that misbehave on purpose.

They live in this light module (no jax import) so a pool worker unpickling them starts them at once;
a test module that imports jax would spend the verifier's time limit on the import.
"""

import sys
import time


def slow(metadata, completion):
    """Hangs far past any test's limit."""
    time.sleep(60)
    return 1.0


def crash(metadata, completion):
    """Raises, as a buggy verifier would."""
    raise RuntimeError("verifier bug")


def imported(module):
    """Whether the worker running this has already imported `module`."""
    return module in sys.modules
