"""Auxiliary models: frozen models a run holds beside the policy (a distillation teacher; a
reward model), each with its own architecture.

A `FrozenModel` is a pytree of its params with its `ModelConfig` static, so it rides inside the
train state through `jit`: the update scores with it inside the compiled iteration (no host
round trip), the trainer's layout places its params by the same path rules as the policy's
(`rljax.sharding.Layout.tree`), and the optimiser never sees it (it is not `TrainState.trainable`),
so it holds no optimiser state and an update returns it unchanged. It is not checkpointed: a run
reloads it from its own checkpoint when it resumes.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax

from rljax.errors import ConfigError
from rljax.models.config import ModelConfig


@flax.struct.dataclass
class FrozenModel:
    """A frozen model: `cfg` (static) and `params`."""

    cfg: ModelConfig = flax.struct.field(pytree_node=False)
    params: Any

    @property
    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(self.params))


def check_vocabulary(policy: ModelConfig, other: ModelConfig, role: str) -> None:
    """An auxiliary model that reads the policy's token ids must share its vocabulary: one line
    naming both sizes otherwise (re-tokenising between vocabularies is not supported)."""
    if other.vocab_size != policy.vocab_size:
        raise ConfigError(f"{role}: its vocabulary has {other.vocab_size} ids, the policy's {policy.vocab_size}; "
                          f"it must share the policy's tokenizer (re-tokenisation is not supported): pick a {role} "
                          "of the policy's family and tokenizer")
