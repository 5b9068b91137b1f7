"""The objective's config: a frozen, validated dataclass whose `algorithm` names a preset of pieces.

    AlgorithmConfig(algorithm="dapo")                       # the DAPO recipe
    AlgorithmConfig(algorithm="grpo", aggregation="token-mean", kl_coef=0.0)   # override pieces

Fields left at None take the preset's value; every piece is looked up in its registry, so an
unknown name fails with one line listing the valid choices. What the pieces read is declared on
their registry entries (`rljax.objectives.registry`), and the checks here read those
declarations: gamma or lam != 1 on an estimator that does not declare it is a one-line error.
`check_turn_credit` is the one check of multi-turn turn-level credit (`env.credit = "turn"`),
called by the config loader and by the update.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rljax.config_io import bounded
from rljax.errors import ConfigError
from rljax.objectives import distill as _distill  # noqa: F401  (registers the distillation objectives)
from rljax.objectives import entropy_control as _entropy_control  # noqa: F401  (registers clip_cov, kl_cov)
from rljax.objectives import rollout_correction as _rollout_correction  # noqa: F401  (icepop, seq_reject, mask_kl)
from rljax.objectives.registry import (ADVANTAGES, AGGREGATIONS, DISTILLATION, KL_ESTIMATORS, OFF_POLICY,
                                       POLICY_LOSSES, ROLLOUT_NEEDS)
from rljax.objectives.shaping import RewardShaping

_BASE: dict[str, Any] = dict(advantage="grpo", policy_loss="ppo_clip", aggregation="seq-mean-token-mean",
                             clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.0, kl_estimator="k3",
                             kl_in_reward=False, std_normalize=True, whiten_advantages=False,
                             value_coef=0.0, distill="none", reward_weight=1.0)

PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeekMath (2024): group-normalised advantage, sequence-then-token mean, k3 KL loss.
    "grpo": dict(kl_coef=0.04),
    # Understanding R1-Zero-like training (2025): no std, constant-length normalisation, no KL.
    "dr_grpo": dict(advantage="dr_grpo", aggregation="seq-mean-token-sum-norm"),
    # DAPO (2025): clip-higher, token-level loss, no KL (soft overlong punishment: set shaping.overlong_*).
    "dapo": dict(aggregation="token-mean", clip_eps_high=0.28),
    # Back to Basics (2024): leave-one-out baseline.
    "rloo": dict(advantage="rloo"),
    # REINFORCE++ (2025): batch-normalised returns with a k1 KL penalty folded into the reward.
    "reinforce_pp": dict(advantage="reinforce_pp", aggregation="token-mean", kl_coef=0.01,
                         kl_estimator="k1", kl_in_reward=True),
    # ReMax (2023): greedy-reward baseline, REINFORCE summed over tokens.
    "remax": dict(advantage="remax", policy_loss="pg", aggregation="seq-mean-token-sum"),
    # PPO (2017) with GAE (2016), whitened advantages and a clipped value loss.
    "ppo": dict(advantage="gae", aggregation="token-mean", value_coef=0.5, whiten_advantages=True),
    # GSPO (2025): sequence-level ratio with the paper's tight clip range.
    "gspo": dict(policy_loss="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4),
    # MiniMax-M1 (2025): clipped stop-gradient IS weight, no lower bound, token-level loss.
    "cispo": dict(policy_loss="cispo", aggregation="token-mean", clip_eps_low=1.0, clip_eps_high=0.28),
    # TOPR (2025): tapered off-policy REINFORCE with a group-mean baseline, no KL.
    "topr": dict(advantage="dr_grpo", policy_loss="topr", aggregation="seq-mean-token-sum"),
    # On-policy distillation (Thinking Machines, 2025; GKD and MiniLLM, 2024): the teacher's
    # per-token reverse KL on the student's samples is the whole advantage (needs [teacher]).
    "opd": dict(distill="reverse_kl", reward_weight=0.0, aggregation="token-mean"),
    # GKD (Agarwal et al., 2024): the generalized JSD to the teacher over the whole vocabulary at
    # each sampled prefix is the whole loss (needs [teacher]).
    "gkd": dict(distill="gjsd", reward_weight=0.0, aggregation="token-mean"),
}


# (field, default, registry, AlgorithmConfig field naming the entry): parameters read only by the
# entries that declare them in `params`
_DECLARED_PARAMS = (
    ("cov_ratio", 0.01, POLICY_LOSSES, "policy_loss"), ("clip_cov_lb", 1.0, POLICY_LOSSES, "policy_loss"),
    ("clip_cov_ub", 5.0, POLICY_LOSSES, "policy_loss"), ("kl_cov_coef", 1.0, POLICY_LOSSES, "policy_loss"),
    ("off_policy_low", None, OFF_POLICY, "off_policy"), ("off_policy_high", None, OFF_POLICY, "off_policy"),
    ("off_policy_mean", "geometric", OFF_POLICY, "off_policy"),
    ("off_policy_kl_coef", 0.1, OFF_POLICY, "off_policy"),
)


ROUTING_REPLAY = ("off", "rollout")


@dataclasses.dataclass(frozen=True)
class RolloutNeeds:
    """What the objective needs besides tokens, sampler log-probs and rewards, collected from the
    registry entries' declarations and the coefficients: the rollout produces `greedy_baseline`;
    the update step scores `reference_logp` and `values` with the train state's models."""

    greedy_baseline: bool = False
    values: bool = False
    reference_logp: bool = False
    teacher_logp: bool = False
    teacher_hidden: bool = False
    routes: bool = False  # the sampler's MoE routing record (`algorithm.routing_replay = "rollout"`)


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """The pieces of an RL objective (the TOML `[algorithm]` section).

    Pieces (None: from the `algorithm` preset): `advantage`, `policy_loss`, `aggregation`,
    `kl_estimator`, clip range `clip_eps_low`/`clip_eps_high`, `kl_coef`, `kl_in_reward`,
    `std_normalize` (GRPO), `value_coef` (> 0 trains a value model; PPO). `whiten_advantages`
    whitens the advantages over the batch's completion tokens (PPO/GAE, as verl and OpenAI
    baselines do); `kl_clamp` bounds the per-token KL estimate to [-c, c] (verl clamps k3 at 10).
    `norm_length` is Dr. GRPO's constant length (None: the rollout's completion budget,
    `max_new_tokens`, as the paper and verl use). `recompute_old_logp` rescores the batch with
    the current params before updating and treats the sampler's log-probs as the behaviour policy
    for the `off_policy` correction ('none', 'tis', 'mis', or AReaL's 'decoupled' PPO, whose
    trust region is the recomputed proximal policy, at `off_policy_level` token|sequence);
    `off_policy_cap` is each correction's cap (>= 1; `inf`: uncapped). The rollout corrections of
    `rljax.objectives.rollout_correction` ('icepop', 'seq_reject', 'mask_kl') read the ratio band
    `off_policy_low`/`off_policy_high` (unset: each one's default), seq_reject the sequence mean
    `off_policy_mean` (geometric|arithmetic), mask_kl its KL weight `off_policy_kl_coef`.

    Entropy control (`rljax.objectives.entropy_control`): `policy_loss = 'clip_cov' | 'kl_cov'`
    (Cui et al., 2025) select `cov_ratio` of each mini-batch's tokens by covariance (Clip-Cov
    within `clip_cov_lb < cov < clip_cov_ub`; KL-Cov weighs |log r| by `kl_cov_coef`);
    `top_entropy_quantile` = rho keeps the policy loss on the highest-entropy share rho of each
    mini-batch's tokens (1: off); `entropy_target` (nats) adapts the entropy bonus's coefficient,
    starting at `entropy_coef`, by `entropy_coef_step` per update toward it (Skywork-OR1).

    On-policy distillation from a frozen teacher (`[teacher]`; `rljax.objectives.distill`):
    `distill` names the objective ('none', 'reverse_kl', 'gjsd'), `distill_coef` its weight
    (lambda) and `reward_weight` the RL advantages' weight: A = reward_weight * A_RL +
    distill_coef * A_distill, or for 'gjsd' the loss gains distill_coef * GJSD.
    `distill_discount` is reverse_kl's gamma over later tokens (0: each token its own grade),
    `distill_beta` GJSD's beta (0: forward KL, 1: reverse KL).

    An MoE policy (`rljax.models.moe_losses`): `router_aux_coef` weighs the load-balancing loss
    (Switch Transformer; transformers' `load_balancing_loss_func`), `router_z_coef` the router
    z-loss (ST-MoE, Zoph et al., 2022); both are added to the update's loss (0: off) and logged.
    `routing_replay = "rollout"` (routing replay, "R3": verl, slime's `--use-rollout-routing-replay`)
    has the sampler record every token's experts per layer and every trainer forward of those
    tokens (old and reference log-probs, the update) compute each token with them, the gates
    still from the trainer's router; "off" routes by the trainer's own top-k (docs/moe.md).

    The update schedule and compile switches live in `rljax.update.UpdateConfig`, reward shaping
    in `rljax.objectives.shaping.RewardShaping`.
    """

    algorithm: str = "grpo"
    advantage: str | None = None
    policy_loss: str | None = None
    aggregation: str | None = None
    kl_estimator: str | None = None
    clip_eps_low: float | None = bounded(None, ge=0)
    clip_eps_high: float | None = bounded(None, ge=0)
    dual_clip: float | None = bounded(None, gt=1)
    kl_coef: float | None = bounded(None, ge=0)
    kl_in_reward: bool | None = None
    kl_clamp: float | None = bounded(None, gt=0)
    std_normalize: bool | None = None
    whiten_advantages: bool | None = None
    value_coef: float | None = bounded(None, ge=0)
    entropy_coef: float = bounded(0.0, ge=0)
    value_clip: float | None = bounded(0.2, gt=0)
    gamma: float = bounded(1.0, ge=0, le=1)
    lam: float = bounded(1.0, ge=0, le=1)
    eps: float = bounded(1e-6, gt=0)
    norm_length: int | None = bounded(None, ge=1)
    off_policy: str = "none"
    off_policy_level: str = "token"
    off_policy_cap: float = bounded(2.0, ge=1)
    recompute_old_logp: bool = False
    negative_advantage_scale: float = bounded(1.0, ge=0, le=1)
    distill: str | None = None
    distill_coef: float = bounded(1.0, ge=0)
    reward_weight: float | None = bounded(None, ge=0)
    distill_discount: float = bounded(0.0, ge=0, le=1)
    distill_beta: float = bounded(0.5, ge=0, le=1)
    cov_ratio: float = bounded(0.01, gt=0, le=1)
    clip_cov_lb: float = bounded(1.0)  # any real: a covariance bound
    clip_cov_ub: float = bounded(5.0)
    kl_cov_coef: float = bounded(1.0, ge=0)
    top_entropy_quantile: float = bounded(1.0, gt=0, le=1)
    entropy_target: float | None = bounded(None, ge=0)
    entropy_coef_step: float = bounded(1e-3, ge=0)
    off_policy_low: float | None = bounded(None, gt=0)
    off_policy_high: float | None = bounded(None, gt=0)
    off_policy_mean: str = "geometric"
    off_policy_kl_coef: float = bounded(0.1, ge=0)
    router_aux_coef: float = bounded(0.0, ge=0)
    router_z_coef: float = bounded(0.0, ge=0)
    routing_replay: str = "off"

    def __post_init__(self):
        if self.algorithm not in PRESETS:
            raise ConfigError(
                f"unknown algorithm {self.algorithm!r}; choose one of {', '.join(sorted(PRESETS))}")
        for name, value in {**_BASE, **PRESETS[self.algorithm]}.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        ADVANTAGES.get(self.advantage)
        POLICY_LOSSES.get(self.policy_loss)
        AGGREGATIONS.get(self.aggregation)
        KL_ESTIMATORS.get(self.kl_estimator)
        OFF_POLICY.get(self.off_policy)
        if self.distill != "none":
            DISTILLATION.get(self.distill)

        def need(ok: bool, msg: str):
            if not ok:
                raise ConfigError(msg)

        need(self.clip_eps_low >= 0 and self.clip_eps_high >= 0, "clip_eps_low/high must be >= 0")
        need(self.dual_clip is None or self.dual_clip > 1,
             f"dual_clip={self.dual_clip} must be > 1 (or None)")
        need(self.kl_coef >= 0, f"kl_coef={self.kl_coef} must be >= 0")
        need(self.kl_clamp is None or self.kl_clamp > 0, f"kl_clamp={self.kl_clamp} must be > 0 (or None)")
        need(self.value_coef >= 0, f"value_coef={self.value_coef} must be >= 0")
        need(0 <= self.negative_advantage_scale <= 1,
             f"negative_advantage_scale={self.negative_advantage_scale} must lie in [0, 1] (1: symmetric)")
        need(0 <= self.gamma <= 1 and 0 <= self.lam <= 1, "gamma and lam must lie in [0, 1]")
        # gamma and lam != 1 on an estimator whose entry does not declare them would be silently ignored
        reads = ADVANTAGES.params(self.advantage)
        need(self.gamma == 1.0 or "gamma" in reads,
             f"gamma={self.gamma} has no effect on advantage={self.advantage!r} (a sequence-level "
             f"estimator); discounting applies to {', '.join(ADVANTAGES.declaring('gamma'))}: set gamma=1")
        need(self.lam == 1.0 or "lam" in reads,
             f"lam={self.lam} has no effect on advantage={self.advantage!r}; only "
             f"{', '.join(ADVANTAGES.declaring('lam'))} uses lambda: set lam=1")
        need(self.norm_length is None or self.norm_length >= 1, f"norm_length={self.norm_length} must be >= 1")
        need(self.off_policy_level in ("token", "sequence"),
             f"off_policy_level={self.off_policy_level!r}; choose one of token, sequence")
        need(self.off_policy_cap >= 1, f"off_policy_cap={self.off_policy_cap} must be >= 1 (inf: uncapped)")
        need(self.off_policy == "none" or self.recompute_old_logp,
             f"off_policy={self.off_policy!r} needs recompute_old_logp=True (it compares the trainer's "
             "log-probs with the sampler's)")
        need(self.distill != "none" or self.reward_weight == 1.0,
             f"reward_weight={self.reward_weight} weighs the RL advantages against a distillation term; with "
             "distill='none' set reward_weight=1 (or name algorithm.distill)")
        need(self.distill_discount == 0.0
             or (self.distill != "none" and "distill_discount" in DISTILLATION.params(self.distill)),
             f"distill_discount={self.distill_discount} applies to distill="
             f"{', '.join(map(repr, DISTILLATION.declaring('distill_discount')))} only; set it to 0")
        # a piece's parameter set away from its default on a piece that does not read it is an error
        for field, default, registry, entry in _DECLARED_PARAMS:
            value, name = getattr(self, field), getattr(self, entry)
            need(value == default or field in registry.params(name),
                 f"{field}={value} has no effect on {entry}={name!r}; it applies to "
                 f"{', '.join(map(repr, registry.declaring(field)))} only: remove it")
        need(self.clip_cov_lb < self.clip_cov_ub,
             f"clip_cov_lb={self.clip_cov_lb} must be below clip_cov_ub={self.clip_cov_ub}")
        need(self.off_policy_low is None or self.off_policy_high is None or self.off_policy_low < self.off_policy_high,
             f"off_policy_low={self.off_policy_low} must be below off_policy_high={self.off_policy_high}")
        need(self.off_policy_mean in ("geometric", "arithmetic"),
             f"off_policy_mean={self.off_policy_mean!r}; choose one of geometric, arithmetic")
        need(0 < self.top_entropy_quantile <= 1,
             f"top_entropy_quantile={self.top_entropy_quantile} must lie in (0, 1] (1: every token)")
        need(self.entropy_target is None or self.entropy_target >= 0,
             f"entropy_target={self.entropy_target} must be >= 0 nats (or unset: a fixed entropy_coef)")
        need(self.routing_replay in ROUTING_REPLAY,
             f"routing_replay={self.routing_replay!r}; choose one of {', '.join(ROUTING_REPLAY)}")
        need("values" not in ADVANTAGES.needs(self.advantage) or self.value_coef > 0,
             f"advantage={self.advantage!r} needs a value model: set value_coef > 0")

    @property
    def off_policy_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the `off_policy` correction: cap and level, and the bounds and
        mean when set (unset: the correction's own defaults)."""
        kw = dict(cap=self.off_policy_cap, level=self.off_policy_level, mean=self.off_policy_mean)
        kw.update({k: v for k, v in (("low", self.off_policy_low), ("high", self.off_policy_high)) if v is not None})
        return kw

    @property
    def off_policy_kl(self) -> bool:
        """Whether the correction adds a KL term on the tokens it zeroed (`mask_kl`)."""
        return "off_policy_kl_coef" in OFF_POLICY.params(self.off_policy) and self.off_policy_kl_coef > 0

    @property
    def token_controls(self) -> bool:
        """Whether the update scores each mini-batch first to select tokens mini-batch-wide: a
        policy loss that declares a selection (clip_cov, kl_cov) or the high-entropy mask."""
        return POLICY_LOSSES.selects(self.policy_loss) is not None or self.top_entropy_quantile < 1.0

    @property
    def adaptive_entropy(self) -> bool:
        """Whether the entropy coefficient adapts toward `entropy_target` (carried in the state)."""
        return self.entropy_target is not None

    @property
    def uses_reference(self) -> bool:
        """Whether the objective needs a frozen reference policy (a KL term)."""
        return self.kl_coef > 0

    @property
    def uses_values(self) -> bool:
        """Whether a value model is trained (and scored for the advantages)."""
        return self.value_coef > 0

    @property
    def needs(self) -> RolloutNeeds:
        """What this objective needs from the rollout, from its registry entries' declarations."""
        declared = set(ADVANTAGES.needs(self.advantage))
        declared |= {"values"} if self.uses_values else set()
        declared |= {"reference_logp"} if self.uses_reference else set()
        declared |= set(DISTILLATION.needs(self.distill)) if self.distill != "none" else set()
        return RolloutNeeds(**{name: name in declared for name in ROLLOUT_NEEDS},
                            routes=self.routing_replay == "rollout")

    def replace(self, **changes) -> AlgorithmConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AlgorithmConfig:
        """Builds a config from a mapping (e.g. a YAML section); unknown keys are a ConfigError."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ConfigError(
                f"unknown algorithm config key(s) {unknown}; valid keys: {', '.join(sorted(fields))}")
        return cls(**d)


def check_turn_credit(algorithm: AlgorithmConfig, shaping: RewardShaping, *, token_rewards: bool = False) -> None:
    """Refuses, in one line naming the fix, what turn-level credit (`env.credit = "turn"`) cannot use.

    Turn credit replaces each row's reward by its turns' returns-to-go G_{i,k} (formed in the
    rollout from the env's per-turn rewards, `rljax.envs.discounted_turn_returns`), which only an
    estimator that declares `reads=("turn_returns",)` on its registry entry uses
    (`turn_group_advantages`). Anything that acts on the row's one reward or adds a per-token one
    would be silently dropped: the KL folded into the reward (`algorithm.kl_in_reward`), a PRM's
    per-step rewards (`token_rewards`: reward.model.credit = "token", known to the update only)
    and the [shaping] length terms. The one check of turn credit: the config loader calls it
    at load, before any warm start; `prepare_batch` for a batch that carries turn returns.
    """
    if "turn_returns" not in ADVANTAGES.reads(algorithm.advantage):
        raise ConfigError(f"env.credit='turn' needs an advantage that takes turn returns "
                          f"({', '.join(ADVANTAGES.reading('turn_returns'))}), not algorithm.advantage="
                          f"{algorithm.advantage!r}; change the algorithm or set env.credit='episode'")
    if algorithm.kl_in_reward:
        raise ConfigError("turn-level credit does not fold a per-token reward (algorithm.kl_in_reward) into its "
                          "turn returns; set algorithm.kl_in_reward=false (a KL loss) or env.credit='episode'")
    if token_rewards:
        raise ConfigError("turn-level credit does not fold a per-token reward (reward.model.credit='token') into its "
                          "turn returns; set reward.model.credit='outcome' or env.credit='episode'")
    if shaping.active:
        raise ConfigError("env.credit='turn' reads per-turn returns, which the [shaping] length terms do not reach; "
                          "remove [shaping] or set env.credit='episode'")
