"""The memory plan before launch (`rljax plan`): per-device bytes of a run from abstract inputs,
whether it fits a named accelerator, and which setting to change when it does not.

Imports are lazy, so `rljax plan` can set the simulated device count before jax is imported.
"""

_EXPORTS = {
    "MemoryPlan": "memory", "StateMemory": "memory", "ProgramMemory": "memory", "plan_memory": "memory",
    "state_memory": "memory", "update_memory": "memory",
    "Advice": "advice", "advise": "advice", "check_fits": "advice",
    "ACCELERATORS": "accelerators", "SLICES": "accelerators",
    "NAMED_SHAPES": "shapes", "model_config": "shapes",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"rljax.plan.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'rljax.plan' has no attribute {name!r}")
