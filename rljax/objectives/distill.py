"""On-policy distillation: a frozen teacher grades the tokens the student sampled.

Two objectives, registered in `DISTILLATION` (`algorithm.distill`), each one term beside the RL
objective:

- `reverse_kl` (an advantage): the per-token reverse KL on the student's own samples as a dense
  reward (GKD, Agarwal et al., 2024; MiniLLM, Gu et al., 2024; the on-policy distillation recipe
  of Thinking Machines, Lu et al., 2025, used for Qwen3's small models):

      r_t = log pi_T(y_t | y_<t) - log pi_S(y_t | y_<t),    A_t = sum_{k >= t} gamma^(k - t) r_k

  with gamma = `distill_discount` (0 by default: each token is credited with its own grade, as
  the recipe does). Its expectation under the student is -KL(pi_S || pi_T) per token, so the
  policy gradient of these advantages descends the sampled reverse KL. log pi_S is the update's
  behaviour log-prob (the sampler's, or the trainer's own with `recompute_old_logp`).
- `gjsd` (a loss): GKD's generalized Jensen-Shannon divergence over the whole vocabulary at each
  sampled prefix (`rljax.models.divergence`), beta from forward KL (0) to reverse KL (1).

Mixed with RL (`rljax.update.prepare_batch`): A = reward_weight * A_RL + distill_coef * A_distill;
a loss term adds distill_coef * GJSD to the policy loss under the run's aggregation. With
reward_weight = 0 it is pure distillation (the `opd` and `gkd` presets); with distill_coef = 0 it
is the RL objective alone.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal

import jax.numpy as jnp

from rljax.models.divergence import fused_generalized_jsd
from rljax.objectives.advantages import _reverse_discounted_sum
from rljax.objectives.registry import DISTILLATION


@dataclasses.dataclass(frozen=True)
class DistillObjective:
    """A registered distillation objective: `kind` says where it enters the update (`advantage`:
    added to the advantages in `prepare_batch`; `loss`: added to the micro-batch loss)."""

    kind: Literal["advantage", "loss"]
    fn: Callable


def reverse_kl_advantages(student_logp_bt, teacher_logp_bt, loss_mask_bt, *, discount: float = 0.0):
    """A_t = sum_{k >= t, masked} discount^(k - t) (log pi_T - log pi_S)_k; 0 off the mask."""
    m = loss_mask_bt.astype(jnp.float32)
    r_bt = (teacher_logp_bt.astype(jnp.float32) - student_logp_bt.astype(jnp.float32)) * m
    if discount == 0.0:
        return r_bt
    return _reverse_discounted_sum(r_bt, m, discount) * m


def gjsd_tokens(student_h_btd, student_w_vd, teacher_h_btd, teacher_w_vd, *, beta: float, softcap_s=None,
                softcap_t=None, time_chunk=None, vocab_chunk=None):
    """GJSD_beta of each token's distribution, aligned like `rljax.models.token_logprobs`: column t
    compares the two models' predictions of token t (from the hidden states at t - 1); column 0 is 0."""
    jsd = fused_generalized_jsd(student_h_btd[:, :-1], student_w_vd, teacher_h_btd[:, :-1], teacher_w_vd, beta=beta,
                                softcap_s=softcap_s, softcap_t=softcap_t, time_chunk=time_chunk,
                                vocab_chunk=vocab_chunk)
    return jnp.concatenate([jnp.zeros_like(jsd[:, :1]), jsd], axis=1)


DISTILLATION.register("reverse_kl", needs=("teacher_logp",), params=("distill_discount",))(
    DistillObjective("advantage", reverse_kl_advantages))
DISTILLATION.register("gjsd", needs=("teacher_logp", "teacher_hidden"), params=("distill_beta",))(
    DistillObjective("loss", gjsd_tokens))
