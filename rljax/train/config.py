"""The training recipe: one frozen, typed, validated config for `rljax train`.

Recipes live in `rljax/configs/*.toml` (linked as `configs/`; `--config ppo` names one).
`rljax train --config FILE key=value ...` overrides any field by its dotted path
(`rl.iterations=20`, `algorithm.algorithm=dapo`). An unknown key or a bad value is one error line
that lists the valid choices (see `rljax.config_io`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rljax.checkpoint.config import CheckpointSection
from rljax.config_io import apply_overrides, bounded, build, load_toml, to_dict
from rljax.data.config import DataSection
from rljax.drivers.config import RLSection
from rljax.drivers.registry import check_features, driver_name
from rljax.envs.config import EnvConfig
from rljax.errors import ConfigError
from rljax.evaluation.config import EvalSection
from rljax.lora import LoraConfig
from rljax.models.setup import ModelSection, TeacherSection
from rljax.objectives.config import AlgorithmConfig, check_turn_credit
from rljax.objectives.shaping import RewardShaping
from rljax.optim import OptimConfig
from rljax.plan.config import PlanSection
from rljax.rewards.config import RewardSection
from rljax.sampling.controls import SampleControls
from rljax.sharding.mesh import MeshConfig
from rljax.train.metrics_writer import MetricsSection
from rljax.update import UpdateConfig
from rljax.warmstart.config import WarmStartSection


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A whole run. `seed` drives init, sampling and shuffling; the same seed and config on the
    same hardware give the same result."""

    seed: int = bounded(0, ge=0)
    output_dir: str = "runs/default"
    model: ModelSection = ModelSection(tokenizer="chars:0123456789+-= ")
    data: DataSection = DataSection()
    reward: RewardSection = RewardSection()
    # The rollout's controls, as the sampler takes them; `[sampling]` in a recipe sets any field.
    # eos_ids / pad_id stay None ("the tokenizer's"): fill them with `cfg.sampling.with_tokenizer(tok)`.
    sampling: SampleControls = SampleControls(max_new_tokens=8, num_samples=8)
    algorithm: AlgorithmConfig = AlgorithmConfig()
    shaping: RewardShaping = RewardShaping()
    update: UpdateConfig = UpdateConfig()
    optim: OptimConfig = OptimConfig()
    warm_start: WarmStartSection = WarmStartSection()
    rl: RLSection = RLSection()
    eval: EvalSection = EvalSection()
    checkpoint: CheckpointSection = CheckpointSection()
    metrics: MetricsSection = MetricsSection()
    mesh: MeshConfig = MeshConfig()
    plan: PlanSection = PlanSection()
    # Low-rank adapters on the frozen policy (`rljax.lora`); rank 0, the default, trains every weight.
    lora: LoraConfig = LoraConfig()
    # Multi-turn episodes with a tool; unset, rollouts are single completions.
    env: EnvConfig = EnvConfig()
    # A frozen teacher for on-policy distillation (`algorithm.distill`); unset, none.
    teacher: TeacherSection = TeacherSection()

    def __post_init__(self):
        n = self.rl.prompts_per_iteration * self.sampling.num_samples
        if self.rl.reference_reset_every and self.lora.enabled:
            raise ConfigError(f"rl.reference_reset_every={self.rl.reference_reset_every}: a LoRA run's reference is "
                              "its frozen base model and cannot be reset; set rl.reference_reset_every=0")
        if self.rl.reference_reset_every and not self.algorithm.needs.reference_logp:
            raise ConfigError(f"rl.reference_reset_every={self.rl.reference_reset_every} needs a KL reference: set "
                              f"algorithm.kl_coef > 0, or rl.reference_reset_every=0")
        if self.rl.replay.capacity and not (self.algorithm.recompute_old_logp
                                            and self.algorithm.off_policy in ("tis", "mis", "decoupled")):
            raise ConfigError("rl.replay mixes off-policy rows: set algorithm.recompute_old_logp=true and "
                              "algorithm.off_policy='tis' (or 'mis', 'decoupled')")
        if self.env.enabled and self.env.credit == "turn":
            self._check_turn_credit()
        check_features(self)  # the driver's table: `rljax.drivers.registry.DRIVERS`
        self._check_partial_rollouts()
        self._check_teacher()
        self._check_reward_model()
        if n % self.update.chunks:
            raise ConfigError(f"rl.prompts_per_iteration * sampling.num_samples = {n} must be divisible by "
                              f"update.num_minibatches * num_microbatches = {self.update.chunks}")

    def _check_turn_credit(self) -> None:
        """`env.credit="turn"` needs an estimator that takes turn returns, and rewards the rollout
        alone produces: refused at load, before the warm start, rather than at the first compile."""
        check_turn_credit(self.algorithm, self.shaping)

    def _check_reward_model(self) -> None:
        if not self.reward.model.enabled:
            return
        clash = [name for name, on in (("rl.dynamic_sampling", self.rl.dynamic_sampling),
                                       ("rl.resample_round_size", self.rl.resample_round_size),
                                       ("rl.replay", self.rl.replay.capacity),
                                       ("[env]", self.env.enabled)) if on]
        if clash:
            raise ConfigError(f"reward.model is scored inside the update, after {clash[0]} has read the verifier's "
                              f"rewards; drop {clash[0]} or reward.model")

    def _check_teacher(self) -> None:
        distills = self.algorithm.distill != "none"
        if distills and not self.teacher.checkpoint:
            raise ConfigError(f"algorithm.distill={self.algorithm.distill!r} grades samples with a teacher: set "
                              "teacher.checkpoint (a HF directory, GGUF file or packaged model sharing the policy's "
                              "tokenizer)")
        if self.teacher.checkpoint and not distills:
            raise ConfigError("teacher.checkpoint is set but algorithm.distill='none': name an objective "
                              "(algorithm.distill='reverse_kl' or 'gjsd', or algorithm.algorithm='opd') or drop "
                              "teacher.checkpoint")
        if self.algorithm.needs.teacher_hidden and self.update.packing:
            raise ConfigError(f"algorithm.distill={self.algorithm.distill!r} reads whole rows' distributions, which "
                              "packed micro-batches do not keep: set update.packing=false or algorithm.distill="
                              "'reverse_kl'")

    def _check_partial_rollouts(self) -> None:
        if self.rl.partial_rollouts and self.sampling.scheduler != "static":
            raise ConfigError(f"rl.partial_rollouts decodes with the static scheduler; set sampling.scheduler="
                              f"'static' or rl.partial_rollouts=false (got {self.sampling.scheduler!r})")

    @property
    def driver(self) -> str:
        """The driver that runs this config (`rljax.drivers.driver_name`)."""
        return driver_name(self)

    @property
    def host_batching(self) -> bool:
        """Whether iterations are sample -> host -> update (`rljax.drivers.host`): a mixture, a
        selection policy, resampling or replay."""
        return self.data.is_mixture or self.rl.host_batching

    def to_dict(self) -> dict[str, Any]:
        out = to_dict(self)
        if self.data.sources:  # a list of sections, which to_dict leaves as dataclasses
            out["data"]["sources"] = [to_dict(s) for s in self.data.sources]
        return out


# The recipes ship inside the package, so a wheel install has them; the checkout's top-level
# `configs/` is a link to this directory (one source, readable where users look first).
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def recipe_path(path: str | Path | None) -> Path:
    """A recipe file: `path` as given when it exists, else a packaged recipe by name (`ppo`,
    `ppo.toml`); None is the packaged default job."""
    if path is None:
        return CONFIG_DIR / "default.toml"
    given = Path(path)
    if given.exists():
        return given
    packaged = CONFIG_DIR / (given.name if given.suffix == ".toml" else f"{given.name}.toml")
    if len(given.parts) == 1 or given.parent.name == "configs":
        if packaged.exists():
            return packaged
    names = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.toml")))
    raise ConfigError(f"config file {given} does not exist; pass a TOML file or a packaged recipe by name: {names}")


# Keys that left `[algorithm]` when it was split by concern; an old recipe gets the new home.
_MOVED = {**{k: "update" for k in ("num_epochs", "num_minibatches", "num_microbatches", "remat", "unroll_layers")},
          **{k: "shaping" for k in ("overlong_max_length", "overlong_buffer", "length_penalty")}}


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Loads a recipe (default: the packaged tiny CPU job; a bare name such as `ppo` picks a
    packaged recipe) and applies `key=value` overrides."""
    mapping = apply_overrides(load_toml(recipe_path(path)), list(overrides))
    moved = sorted(set(mapping.get("algorithm", {})) & set(_MOVED))
    if moved:
        key = moved[0]
        raise ConfigError(f"algorithm.{key} moved to the [{_MOVED[key]}] section; write {_MOVED[key]}.{key} instead")
    cfg = build(TrainConfig, mapping)
    if "total_steps" not in mapping.get("optim", {}):
        # The schedule spans the run unless the recipe says otherwise: one optimiser step per
        # mini-batch per epoch per iteration.
        total = cfg.rl.iterations * cfg.update.num_epochs * cfg.update.num_minibatches
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, total_steps=max(total, 1)))
    return cfg
