"""The update step and its typed inputs: `RolloutBatch` in, `TrainState` and metrics out.

    batch = RolloutBatch(tokens_bt=..., ..., completion_len=C)
    state, metrics = update_step(state, batch, rng)           # one compiled program

`prepare_batch` (`rljax.update.advantages`: advantages and everything else computed without
gradients) and `microbatch_loss` are public, so a notebook can run any stage on its own.
"""

from rljax.update.advantages import logp_mismatch, prepare_batch
from rljax.update.batch import PreparedBatch, RolloutBatch, TurnReturns, state_values
from rljax.update.config import UpdateConfig
from rljax.update.loss import aggregation_denominator, microbatch_loss
from rljax.update.step import TrainState, init_train_state, reset_reference, update, update_step

__all__ = [
    "RolloutBatch", "TurnReturns", "PreparedBatch", "prepare_batch", "logp_mismatch", "state_values", "UpdateConfig",
    "microbatch_loss", "aggregation_denominator", "TrainState", "init_train_state", "reset_reference",
    "update", "update_step",
]
