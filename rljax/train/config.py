"""The training recipe: one frozen, typed, validated config for `rljax train`.

Recipes live in `rljax/configs/*.toml` (linked as `configs/`; `--config ppo` names one).
`rljax train --config FILE key=value ...` overrides any field by its dotted path
(`rl.iterations=20`, `algorithm.algorithm=dapo`). An unknown key or a bad value is one error line
that lists the valid choices (see `rljax.config_io`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from rljax.config_io import apply_overrides, bounded, build, load_toml, to_dict
from rljax.errors import ConfigError
from rljax.lora import LoraConfig
from rljax.storage import copy_locally_hint, is_remote
from rljax.objectives.config import AlgorithmConfig
from rljax.objectives.advantages import takes_turn_returns
from rljax.objectives.shaping import RewardShaping
from rljax.optim import OptimConfig
from rljax.update import UpdateConfig
from rljax.sampling.controls import SampleControls


def check_local(key: str, value: str | None) -> None:
    """A model is read from a local path: a bucket URI is one line naming the copy to make."""
    if value is not None and is_remote(value):
        raise ConfigError(f"{key}={value!r}: a model is read from a local directory; copy it first "
                          f"({copy_locally_hint(value)}) and set {key} to the copy")


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Where the policy comes from: a HF checkpoint directory, or a from-scratch architecture.

    `tokenizer`: a path/name for `rljax.tokenizers.load` (default: the checkpoint directory), or
    `chars:<alphabet>` for a character tokenizer (tiny from-scratch jobs). `attention` picks the
    full-sequence attention (training, scoring, prefill) and `decode_attention` the decode steps'
    ("auto": the backend's fused kernel where it serves the model; docs/api/models.md).
    """

    checkpoint: str | None = None
    tokenizer: str | None = None
    hidden_size: int = bounded(128, ge=1)
    intermediate_size: int = bounded(256, ge=1)
    num_layers: int = bounded(3, ge=1)
    num_heads: int = bounded(4, ge=1)
    num_kv_heads: int = bounded(2, ge=1)
    head_dim: int = bounded(32, ge=1)
    max_positions: int = bounded(256, ge=1)
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    attention: Literal["auto", "xla", "cudnn", "splash"] = "auto"
    decode_attention: Literal["auto", "xla", "pallas"] = "auto"

    def __post_init__(self):
        if self.checkpoint is None and self.tokenizer is None:
            raise ConfigError("model: set model.checkpoint (a HF directory) or model.tokenizer "
                              "(e.g. 'chars:0123456789+-= ') for a from-scratch model")
        for name in ("checkpoint", "tokenizer"):
            check_local(f"model.{name}", getattr(self, name))


@dataclasses.dataclass(frozen=True)
class TeacherSection:
    """A frozen distillation teacher (`algorithm.distill`; `rljax.objectives.distill`): a HF
    directory, a GGUF file or a packaged model's name, of any supported family and size that
    shares the policy's vocabulary and tokenizer (a tokenizer in its directory is compared with
    the policy's). It is held in the trainer's layout beside the policy, in `param_dtype`, and
    scores in `compute_dtype`."""

    checkpoint: str | None = None
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self):
        check_local("teacher.checkpoint", self.checkpoint)


@dataclasses.dataclass(frozen=True)
class SourceSection:
    """One task of a mixture (`[[data.sources]]`).

    kind: `reasoning_gym` (task + task_kwargs at difficulty `level`), `jsonl` or `parquet` (path +
    fields). `weight` weighs it for `uniform` and `band`; `verifier` grades it (default: the
    `[reward]` kind); `name` labels its metrics and routes its reward (default: the task, with
    `@L{level}` when the level is not 0, or the file's stem). `size` training problems and
    `eval_size` held-out ones; `prompt_template` defaults to `data.prompt_template`.

    `fresh = true` (reasoning-gym only) draws never-seen questions from the generator instead of
    a fixed pool: with a pool of repeats a small policy memorises training questions (training
    reward rises while held-out accuracy stays flat, issue 24); fresh questions cannot be
    memorised. The pool of `size` problems is still made, for the warm start. `fresh_draws`:
    `distinct` (never a pool question, never one twice) or `iid` (the generator's own
    distribution, the held-out split's, skipping only held-out questions); see
    `rljax.data.mixture.FreshStream`.
    """

    kind: Literal["reasoning_gym", "jsonl", "parquet"] = "reasoning_gym"
    name: str | None = None
    task: str = "chain_sum"
    task_kwargs: dict = dataclasses.field(default_factory=dict)
    level: int = bounded(0, ge=0)
    weight: float = bounded(1.0, ge=0)
    verifier: Literal["reasoning_gym", "math", "code"] | None = None
    path: str | None = None
    fields: dict = dataclasses.field(default_factory=dict)
    size: int = bounded(2000, ge=1)
    eval_size: int = bounded(100, ge=0)
    fresh: bool = False
    fresh_draws: Literal["distinct", "iid"] = "distinct"
    prompt_template: str | None = None

    def __post_init__(self):
        if self.kind != "reasoning_gym" and self.path is None:
            raise ConfigError(f"data.sources: a {self.kind} source needs path = '...'")
        if self.fresh and self.kind != "reasoning_gym":
            raise ConfigError(f"data.sources: fresh = true needs a reasoning_gym source, not {self.kind}; "
                              "set fresh = false")

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        if self.kind == "reasoning_gym":
            return self.task if self.level == 0 else f"{self.task}@L{self.level}"
        return Path(self.path).stem


@dataclasses.dataclass(frozen=True)
class DataSection:
    """The task: a source, its held-out split and how an example becomes a prompt.

    source: `reasoning_gym` (task + task_kwargs), `jsonl` / `parquet` (path + fields), or `tfds`
    (tfds_name + tfds_data_dir). `eval_size` problems are held out by question text; training never
    sees them. `prompt_template` is a format string over {question} and metadata keys.

    A mixture lists its tasks as `[[data.sources]]` (`SourceSection`); then the single-source
    keys above other than the seed, prompt and token settings are unused. `selection` names the
    policy that picks each prompt's task (`rljax.data.selection`: uniform, band, bandit,
    schedule, auto_curriculum) with `selection_options` as its settings (levels and weights
    default to the sources'); `band_max_redraws` bounds how often `band` replaces a rejected
    prompt. A single-source run with a non-uniform selection is a mixture of one.
    """

    source: Literal["reasoning_gym", "jsonl", "parquet", "tfds"] = "reasoning_gym"
    task: str = "chain_sum"
    task_kwargs: dict = dataclasses.field(default_factory=dict)
    path: str | None = None
    fields: dict = dataclasses.field(default_factory=dict)
    tfds_name: str | None = None
    tfds_data_dir: str | None = None
    tfds_split: str = "train"
    size: int = bounded(20000, ge=1)
    eval_size: int = bounded(400, ge=0)
    eval_path: str | None = None
    seed: int = bounded(1, ge=0)
    prompt_template: str = "{question}"
    chat: bool = False
    system_prompt: str | None = None
    add_bos: bool = True
    max_prompt_tokens: int = bounded(64, ge=1)
    prompt_buckets: tuple[int, ...] = bounded((), ge=1)
    sources: tuple[SourceSection, ...] = ()
    selection: str = "uniform"
    selection_options: dict = dataclasses.field(default_factory=dict)
    band_max_redraws: int = bounded(4, ge=0)

    def __post_init__(self):
        from rljax.data.selection import POLICIES

        POLICIES.get(self.selection)  # an unknown name: one line listing the registered ones
        labels = [s.label for s in self.sources]
        if len(set(labels)) != len(labels):
            raise ConfigError(f"data.sources names {labels} repeat; give each source a distinct name = '...'")

    @property
    def is_mixture(self) -> bool:
        return bool(self.sources) or self.selection != "uniform" or bool(self.selection_options)


@dataclasses.dataclass(frozen=True)
class RewardModelSection:
    """A learned reward model (`[reward] model = {...}`; `rljax.rewards.learned`), sharing the
    policy's tokenizer, scored inside the update. `kind`: "bt", a Bradley-Terry outcome reward
    model (`checkpoint` a HF `*ForSequenceClassification` with one label, scored at each row's
    last real token; `rljax train-rm` writes one), or "prm", a process reward model (a
    `*ForTokenClassification` with 2 labels, read at the `step_separator` token that ends each
    step: `credit = "token"` puts each step's score on its token for the dense estimators,
    `"outcome"` aggregates a row's steps by `step_aggregation` min / last / discounted sum with
    `step_discount`), or "judge", a generative judge (`checkpoint` a causal LM, e.g. the policy's
    own base checkpoint): each row's prompt and completion fill `template` ({prompt}, then
    {completion}), the judge greedily decodes `max_verdict_tokens`, and a decode that starts with
    a key of `verdicts` scores its value, any other `default_score` (counted as
    `reward_model/judge_unparsed`). `weight` is its weight against the verifier's total; an
    outcome score is normalised by `normalize` (`none`, `group`, `running`)."""

    checkpoint: str | None = None
    kind: Literal["bt", "prm", "judge"] = "bt"
    weight: float = bounded(1.0, ge=0)
    normalize: Literal["none", "group", "running"] = "group"
    step_separator: str = "\n"
    step_aggregation: Literal["min", "last", "sum"] = "min"
    step_discount: float = bounded(1.0, ge=0, le=1)
    credit: Literal["outcome", "token"] = "outcome"
    template: str = "Question: {prompt}\nAnswer: {completion}\nIs the answer correct? "
    verdicts: dict = dataclasses.field(default_factory=lambda: {"Yes": 1.0, "No": 0.0})
    default_score: float = bounded(0.0)  # any real score
    max_verdict_tokens: int = bounded(4, ge=1)
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self):
        check_local("reward.model.checkpoint", self.checkpoint)

    @property
    def enabled(self) -> bool:
        return bool(self.checkpoint)


@dataclasses.dataclass(frozen=True)
class RewardSection:
    """The reward: a correctness verifier plus an optional format term, scored on the host.

    kind: `reasoning_gym` (the task's own scorer), `math` (math-verify on the extracted answer),
    or `code` (sandboxed unit tests). `answer_methods` orders the extractors tried. Length terms
    (DAPO's overlong punishment, a length cost) are applied on device by the `[shaping]` section
    (`rljax.objectives.shaping.RewardShaping`). `correct_weight` weighs the correctness part in the
    total (0 with a `model`: the learned reward replaces the verifier, which is still scored and
    logged, e.g. as the reward model's `reward_model/pair_agreement` with it).
    """

    kind: Literal["reasoning_gym", "math", "code"] = "reasoning_gym"
    correct_weight: float = bounded(1.0, ge=0)
    model: RewardModelSection = RewardModelSection()
    answer_methods: tuple[str, ...] = ("answer_tag", "final_line")
    format_weight: float = bounded(0.0, ge=0)
    format_pattern: str = r"(?s)^<think>.*</think>\s*<answer>.*</answer>\s*$"
    time_limit_s: float = bounded(5.0, gt=0)
    inline: bool = False


@dataclasses.dataclass(frozen=True)
class WarmStartSection:
    """Optional supervised warm start on reference answers before RL (steps=0: none).

    `target_accuracy` > 0 stops it early once greedy accuracy on `validation_size` training
    problems (not the held-out split) reaches the target, checked every `check_every` steps.
    `max_seconds` > 0 stops it after that wall time (used by the supervised-only control run).
    `patience` > 0 stops it once, in `patience` checks, that validation accuracy has not risen by
    `min_delta` and the validation NLL has not fallen by `nll_rel_delta` (relative): a task that
    cannot reach the target within the budget stops on the plateau, and one still learning below
    1-digit accuracies does not (`rljax.train.warm_start.stop_reason`). Validation problems are
    held out of the warm start's SFT set (`rljax.data.splits.warm_start_split`).
    """

    steps: int = bounded(0, ge=0)
    batch_size: int = bounded(64, ge=1)
    learning_rate: float = bounded(1e-3, gt=0)
    warmup_steps: int = bounded(0, ge=0)
    target_accuracy: float = bounded(0.0, ge=0, le=1)
    validation_size: int = bounded(200, ge=1)
    check_every: int = bounded(25, ge=1)
    max_seconds: float = bounded(0.0, ge=0)  # > 0: also stop after this wall time (for equal-time SFT controls)
    patience: int = bounded(0, ge=0)
    min_delta: float = bounded(0.01, ge=0)
    nll_rel_delta: float = bounded(0.01, ge=0)


@dataclasses.dataclass(frozen=True)
class ReplaySection:
    """Replay of successful trajectories (`rljax.data.replay`; ARPO, RePO 2025); capacity 0: off.
    Successes of groups with pass rate < `max_pass_rate` are stored (at most `per_prompt` per
    prompt); up to `fraction` of each batch's groups, those that all failed, get one back.
    Replay is keyed on the prompt, so it needs prompts that come back: a pool, not `fresh`
    questions."""

    capacity: int = bounded(0, ge=0)
    fraction: float = bounded(0.25, ge=0, le=1)
    per_prompt: int = bounded(2, ge=1)
    max_pass_rate: float = bounded(0.5, ge=0, le=1)


@dataclasses.dataclass(frozen=True)
class RLSection:
    """The RL schedule. `dynamic_sampling` over-samples `oversample` x prompts and keeps groups
    whose rewards differ (DAPO, 2025). `reference_reset_every` > 0 resets the KL reference to the
    current policy (and restarts the optimiser moments) every that many iterations (ProRL, 2025).

    `resample_round_size` > 0 resamples instead (DAPO's own scheme, `rljax.data.resampling`):
    rounds of that many prompts until `prompts_per_iteration` groups have reward variance, at
    most `resample_max_rounds` rounds. It and `replay` run the iteration as sample -> host ->
    update (`rljax.train.batching`).

    `mode` picks how sampling and training overlap (`rljax.train.overlap`; the overlapped modes
    need `mesh.sampler_devices` > 0, a sampler on its own devices, or for `async` across
    processes `mesh.sampler_processes` > 0, `rljax.train.remote`):
    - `sync`: sample, then update, every iteration (one program, or two with mesh.sampler=tensor).
    - `one_step_off`: batch k+1 is sampled with the params before update k while update k runs
      (verl's one-step off-policy pipeline); deterministic, and resumed exactly.
    - `async`: a producer thread samples into a queue of at most `queue_batches` batches and the
      trainer takes them; rows more than `max_staleness` policy versions old are dropped (AReaL's
      bounded staleness eta, Fu et al., 2025). `stale_rows = "wait"` (AReaL's admission rule)
      holds the sampler back so no batch goes stale in the queue; `"drop"` lets it run ahead
      (bounded by the queue) and the trainer drops, and counts, the stale rows.

    `partial_rollouts` (async only, static scheduler; AReaL's interruptible rollouts): the sampler
    checks for new params every `segment_steps` decode steps and, when a newer version arrived,
    recomputes the KV cache under it and goes on; unfinished rows keep their tokens, each token
    keeps the version and log-prob it was drawn with (`rljax.sampling.interruptible`)."""

    iterations: int = bounded(60, ge=0)
    prompts_per_iteration: int = bounded(64, ge=1)
    dynamic_sampling: bool = False
    oversample: float = bounded(2.0, ge=1)
    reference_reset_every: int = bounded(0, ge=0)
    resample_round_size: int = bounded(0, ge=0)
    resample_max_rounds: int = bounded(4, ge=1)
    replay: ReplaySection = ReplaySection()
    mode: Literal["sync", "one_step_off", "async"] = "sync"
    max_staleness: int = bounded(1, ge=0)
    queue_batches: int = bounded(2, ge=1)
    stale_rows: Literal["wait", "drop"] = "wait"
    partial_rollouts: bool = False
    segment_steps: int = bounded(8, ge=1)

    def __post_init__(self):
        if self.resample_round_size and self.dynamic_sampling:
            raise ConfigError("rl.resample_round_size resamples instead of rl.dynamic_sampling's fixed pool; "
                              "set one of them")
        if self.resample_round_size and self.prompts_per_iteration > self.resample_round_size * self.resample_max_rounds:
            raise ConfigError(f"rl.resample_max_rounds={self.resample_max_rounds} rounds of "
                              f"{self.resample_round_size} prompts cannot fill {self.prompts_per_iteration} groups; "
                              "raise either")

    @property
    def host_batching(self) -> bool:
        """Whether the iteration is sample -> host -> update (resampling or replay)."""
        return bool(self.resample_round_size or self.replay.capacity)


@dataclasses.dataclass(frozen=True)
class EvalSection:
    every: int = bounded(10, ge=1)
    size: int = bounded(400, ge=1)
    pass_k: tuple[int, ...] = bounded((1, 4), ge=1)
    num_samples: int = bounded(4, ge=1)
    seeds: int = bounded(3, ge=1)
    temperature: float = bounded(1.0, ge=0)


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    every: int = bounded(20, ge=1)
    keep_last: int = bounded(2, ge=1)
    best_metric: str | None = "eval/accuracy"


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """The device mesh: the trainer's axis sizes (-1: the rest of the devices) over the first
    `devices` devices (0: all; a multi-process run needs all). One device means no sharding.

    `sampler` picks where sampling runs:
    - `shared`: in the trainer's layout (FSDP params); the whole iteration is ONE program.
    - `tensor`: in its own layout, a mesh of data=-1 x tensor=`sampler_tensor` (0: the trainer's
      tensor size) over the same devices, params replicated over data and split over heads and
      the MLP on tensor, so decoding needs no per-token all-gathers. Each iteration then reshards
      the params on device (`time/weight_sync_s`), runs a sampling program and an update program.

    `sampler_devices` > 0 gives the sampler devices of its own (ReaLHF, Mei et al., 2024): the last
    that many devices (a float in (0, 1): that fraction of them) form the sampler's mesh (data=-1 x
    tensor=`sampler_tensor`), the rest the trainer's, so `rl.mode` can overlap the two.

    `sampler_processes` = k > 0 (a multi-process `rl.mode = "async"` run) makes the last k
    processes sampler hosts and the others trainer hosts (`rljax.train.remote`): each side's mesh
    is its own process's devices, weights and rollouts move over `rljax.sharding.transport`, and a
    peer silent for `transport_timeout_s` seconds stops the run.
    """

    data: int = bounded(1, ge=1, also=(-1,))
    fsdp: int = bounded(-1, ge=1, also=(-1,))
    tensor: int = bounded(1, ge=1, also=(-1,))
    devices: int = bounded(0, ge=0)
    sampler: Literal["shared", "tensor"] = "shared"
    sampler_tensor: int = bounded(0, ge=0)
    sampler_devices: int | float = bounded(0, ge=0)
    sampler_processes: int = bounded(0, ge=0)
    transport_timeout_s: float = bounded(120.0, gt=0)

    def __post_init__(self):
        if self.sampler_processes and self.sampler_devices:
            raise ConfigError("mesh.sampler_processes gives the sampler whole processes; drop mesh.sampler_devices "
                              "(set it to 0)")
        if not (self.sampler_devices == 0 or (isinstance(self.sampler_devices, int) and self.sampler_devices > 0)
                or 0 < self.sampler_devices < 1):
            raise ConfigError(f"mesh.sampler_devices={self.sampler_devices} must be a device count >= 1, a fraction "
                              "in (0, 1), or 0 (the sampler shares the trainer's devices)")
        if self.sampler_tensor and self.sampler == "shared" and not self.sampler_devices:
            raise ConfigError("mesh.sampler_tensor only applies to a separate sampler layout; "
                              "set mesh.sampler='tensor' (or mesh.sampler_devices) or drop mesh.sampler_tensor")


@dataclasses.dataclass(frozen=True)
class MetricsSection:
    """Where metrics go. Every `samples_every` iterations (0: never) a few sampled completions
    with their rewards are logged (samples.jsonl, TensorBoard text, a wandb table)."""

    tensorboard: bool = True
    wandb_project: str | None = None
    progress_bar: bool = True
    samples_every: int = bounded(50, ge=0)


@dataclasses.dataclass(frozen=True)
class PlanSection:
    """The memory check `rljax train` runs before it allocates anything (`rljax.plan`): the
    plan's per-device peak against the device memory, which is `device_memory_gib` when > 0,
    else the named `accelerator`'s (v5e 16, v5p 95, v6e 32, h100 80, h200 141 GiB), else what
    the devices report (`memory_stats()["bytes_limit"]` on GPU and TPU; CPU reports none, so
    there is no check). A plan that does not fit stops the run with one line naming the setting
    to change. `check = false` skips it (the plan compiles the run's programs once more)."""

    accelerator: Literal["v5e", "v5p", "v6e", "h100", "h200"] | None = None
    device_memory_gib: float = bounded(0.0, ge=0)
    check: bool = True


@dataclasses.dataclass(frozen=True)
class EnvSection:
    """Multi-turn episodes with a tool (`rljax.envs`; the rollout is `rljax.train.episodes`).

    Unset or empty `name` (the default) keeps single-turn rollouts. `name` picks a registered environment
    (calculator, python, reasoning_gym_tool), `format` its tool-call format (tags, qwen, hermes);
    `options` are further keyword arguments of the environment's factory. `max_episode_tokens` is
    the per-episode token budget (model and environment tokens together; `sampling.max_new_tokens`
    does not apply), `max_observation_tokens` the cap on one observation (cut with
    `truncation_marker`, which the tokenizer must spell). `void_turn_filter` drops trajectories
    with a void turn from the loss (SimpleTIR); `turn_discount` is gamma of the episode return
    sum_k gamma^k r_k over its turns (1: the plain sum). `credit` is "episode" (every model token
    of an episode gets its return's advantage) or "turn" (turn k's tokens get the advantage of its
    return-to-go against the group's episodes that reached turn k; needs advantage grpo or dr_grpo).
    """

    name: str | None = None
    format: str = "tags"
    max_turns: int = bounded(3, ge=1)
    max_episode_tokens: int = bounded(64, ge=1)
    max_observation_tokens: int = bounded(16, ge=1)
    truncation_marker: str = "..."
    void_turn_filter: bool = True
    turn_discount: float = bounded(1.0, gt=0, le=1)
    credit: Literal["episode", "turn"] = "episode"
    options: dict = dataclasses.field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        """An environment is named (`env.name=''` on the command line turns a recipe's off)."""
        return bool(self.name)


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
    mesh: MeshSection = MeshSection()
    plan: PlanSection = PlanSection()
    # Low-rank adapters on the frozen policy (`rljax.lora`); rank 0, the default, trains every weight.
    lora: LoraConfig = LoraConfig()
    # Multi-turn episodes with a tool; unset, rollouts are single completions.
    env: EnvSection = EnvSection()
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
        if self.env.enabled and (self.rl.dynamic_sampling or self.mesh.sampler != "shared"):
            raise ConfigError("env: multi-turn rollouts run in the fused iteration without dynamic sampling; set "
                              "rl.dynamic_sampling=false and mesh.sampler=\"shared\"")
        if self.env.enabled and self.host_batching:
            raise ConfigError("env: multi-turn rollouts do not combine with a mixture, resampling or replay yet; "
                              "remove [[data.sources]]/data.selection, rl.resample_round_size and rl.replay, or [env]")
        if self.env.enabled and self.env.credit == "turn":
            self._check_turn_credit()
        self._check_mode()
        self._check_teacher()
        self._check_reward_model()
        if n % self.update.chunks:
            raise ConfigError(f"rl.prompts_per_iteration * sampling.num_samples = {n} must be divisible by "
                              f"update.num_minibatches * num_microbatches = {self.update.chunks}")

    def _check_turn_credit(self) -> None:
        """`env.credit="turn"` needs an estimator that takes turn returns, and rewards the rollout
        alone produces: refused at load, before the warm start, rather than at the first compile."""
        if not takes_turn_returns(self.algorithm.advantage):
            raise ConfigError(f"env.credit='turn' needs an advantage estimator that takes turn returns (grpo, "
                              f"dr_grpo), not {self.algorithm.advantage!r}; set env.credit='episode' or change it")
        if self.algorithm.kl_in_reward or self.shaping.active:
            raise ConfigError("env.credit='turn' computes advantages from the env's turn rewards; it does not combine "
                              "with algorithm.kl_in_reward or [shaping]: drop them or set env.credit='episode'")

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

    def _check_mode(self) -> None:
        """The overlapped modes run the single-source pipeline with a sampler on its own devices."""
        mode = self.rl.mode
        if self.rl.partial_rollouts and mode != "async":
            raise ConfigError(f"rl.partial_rollouts continues rollouts across weight updates, which only "
                              f"rl.mode=async has; set rl.mode=async or rl.partial_rollouts=false (got {mode})")
        if self.rl.partial_rollouts and self.sampling.scheduler != "static":
            raise ConfigError(f"rl.partial_rollouts decodes with the static scheduler; set sampling.scheduler="
                              f"'static' or rl.partial_rollouts=false (got {self.sampling.scheduler!r})")
        if self.mesh.sampler_processes and mode != "async":
            raise ConfigError(f"mesh.sampler_processes={self.mesh.sampler_processes} runs the sampler hosts "
                              f"asynchronously; set rl.mode=async (got {mode}) or mesh.sampler_processes=0")
        if self.mesh.sampler_processes and self.data.prompt_buckets:
            raise ConfigError("mesh.sampler_processes moves rollouts of one prompt length between hosts; drop "
                              "data.prompt_buckets or set mesh.sampler_processes=0")
        if self.rl.partial_rollouts and self.mesh.sampler_processes:
            raise ConfigError("rl.partial_rollouts runs in the single-process async driver only for now; set "
                              "mesh.sampler_processes=0 or rl.partial_rollouts=false")
        if mode == "sync":
            return
        if not (self.mesh.sampler_devices or self.mesh.sampler_processes):
            raise ConfigError(f"rl.mode={mode} overlaps sampling and training on separate devices; set "
                              "mesh.sampler_devices (e.g. 1) or rl.mode=sync")
        if self.env.enabled or self.host_batching:
            raise ConfigError(f"rl.mode={mode} runs the single-source pipeline; remove [env], [[data.sources]]/"
                              "data.selection, rl.resample_round_size and rl.replay, or set rl.mode=sync")
        if self.rl.dynamic_sampling:
            raise ConfigError(f"rl.mode={mode} does not support rl.dynamic_sampling yet; set "
                              "rl.dynamic_sampling=false or rl.mode=sync")
        if mode == "one_step_off" and self.data.prompt_buckets:
            raise ConfigError("rl.mode=one_step_off checkpoints the pending batch, which needs one prompt length; "
                              "drop data.prompt_buckets or set rl.mode=sync")

    @property
    def host_batching(self) -> bool:
        """Whether iterations are sample -> host -> update (`rljax.train.batching`): a mixture, a
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
