"""rljax: a JAX-native RL stack that trains language models to reason.

`rljax.update_step` is the compiled update step (`rljax.update.update_step`); submodules are
imported on first use so the CLI starts fast.
"""

__version__ = "0.1.0"


def __getattr__(name):
    if name in ("update_step", "init_train_state", "TrainState", "RolloutBatch"):
        from rljax import update

        return getattr(update, name)
    raise AttributeError(f"module 'rljax' has no attribute {name!r}")
