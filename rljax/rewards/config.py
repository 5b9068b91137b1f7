"""The `[reward]` section: the verifier's settings and an optional learned reward model.

`reward_model_config` reads the reward model's config without allocating (what `rljax plan`
sizes); `build_reward_model` loads it, born sharded in a trainer layout when one is given.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from rljax import rewards
from rljax.config_io import bounded
from rljax.errors import ConfigError
from rljax.models import ModelConfig, is_gguf, load_gguf, load_hf, read_gguf_config, read_hf_config, resolve_checkpoint
from rljax.models.auxiliary import FrozenModel, check_vocabulary
from rljax.models.heads import read_head
from rljax.models.hf_io import has_head_bias, head_shapes
from rljax.models.setup import check_local, check_tokenizer
from rljax.rewards.judge import JudgeSpec, split_template
from rljax.rewards.learned import LearnedReward
from rljax.tokenizers import Tokenizer


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
    or `code` (sandboxed unit tests). `answer_methods` orders the extractors tried. `answer_form`
    (math): "value" wants one stated value when the gold is a plain value, "expression" keeps
    symbolic equivalence for simplify/factor/solve answers (`rljax.rewards.math_verify`); neither
    accepts the question restated. `audit`: a stricter second opinion scored beside the reward on
    every rollout, never weighted into it: "exact" (the answer's final statement, extracted by
    `answer_methods`, is a bare number equal to the gold), "last_number" (the answer's last number
    equals the gold value) or "reasoning_gym" (the task's own scorer, for reasoning-gym rows); logged
    as `reward/audit_agreement` and `eval/accuracy_strict` (`rljax.rewards.audit`). Length terms
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
    format_pattern: str = r"(?s)^<think>\s*[^\s<].*</think>\s*<answer>\s*[^\s<].*</answer>\s*$"
    time_limit_s: float = bounded(5.0, gt=0)
    inline: bool = False
    answer_form: Literal["value", "expression"] = "value"
    audit: Literal["off", "exact", "last_number", "reasoning_gym"] = "off"

    def __post_init__(self):
        if self.audit != "off" and self.kind == "code":
            raise ConfigError(f"reward.audit={self.audit!r} checks a final answer, and reward.kind='code' has none "
                              "(its unit tests are the strict check); drop reward.audit")


def reward_model_config(section: RewardModelSection, policy: ModelConfig) -> tuple[ModelConfig, int]:
    """(config, num_labels) of the reward model without allocating: a Bradley-Terry model is a
    sequence classifier with one label, a PRM a token classifier with two; its vocabulary is the
    policy's."""
    path = resolve_checkpoint(section.checkpoint)
    if section.kind == "judge":  # a causal LM
        read = read_gguf_config if is_gguf(path) else read_hf_config
        cfg = read(path, param_dtype=section.param_dtype, compute_dtype=section.compute_dtype)
        check_vocabulary(policy, cfg, "reward model")
        return cfg, None
    kind, labels = read_head(path)
    want = {"bt": ("sequence", 1, "*ForSequenceClassification with num_labels=1 (rljax train-rm writes one)"),
            "prm": ("token", 2, "*ForTokenClassification with num_labels=2 (TRL's PRMTrainer format)")}[section.kind]
    if (kind, labels) != want[:2]:
        raise ConfigError(f"reward.model.checkpoint={section.checkpoint!r} is a {kind}-classification model with "
                          f"{labels} labels; reward.model.kind={section.kind!r} needs a {want[2]}")
    cfg = read_hf_config(path, param_dtype=section.param_dtype, compute_dtype=section.compute_dtype)
    check_vocabulary(policy, cfg, "reward model")
    return cfg, labels


def build_reward_model(section: RewardModelSection, policy: ModelConfig, tokenizer: Tokenizer,
                       layout=None) -> LearnedReward:
    """The learned reward, its model born in the trainer's `layout` like the policy; a tokenizer
    shipped with it must be the policy's (one line otherwise)."""
    cfg, labels = reward_model_config(section, policy)
    path = resolve_checkpoint(section.checkpoint)
    check_tokenizer(path, tokenizer, f"reward.model.checkpoint={section.checkpoint!r}")
    if section.kind == "judge":
        load = load_gguf if is_gguf(path) else load_hf
        shardings = layout.params(head_shapes(cfg, None)) if layout is not None else None
        cfg, params = load(path, param_dtype=section.param_dtype, compute_dtype=section.compute_dtype,
                           shardings=shardings)
        return LearnedReward.create(FrozenModel(cfg, params), weight=section.weight, normalize=section.normalize,
                                    kind="judge", judge=judge_spec(section, tokenizer))
    step_token = None
    if section.kind == "prm":
        ids = tokenizer.encode(section.step_separator)
        if len(ids) != 1:
            raise ConfigError(f"reward.model.step_separator={section.step_separator!r} is {len(ids)} tokens in the "
                              "policy's tokenizer; a step must end with one token: pick a separator that is one")
        step_token = ids[0]
    shardings = layout.params(head_shapes(cfg, labels, has_head_bias(path))) if layout is not None else None
    cfg, params = load_hf(path, param_dtype=section.param_dtype, compute_dtype=section.compute_dtype,
                          shardings=shardings, num_labels=labels)
    return LearnedReward.create(FrozenModel(cfg, params), weight=section.weight, normalize=section.normalize,
                                kind=section.kind, step_token=step_token, step_aggregation=section.step_aggregation,
                                step_discount=section.step_discount, credit=section.credit)


def judge_spec(section: RewardModelSection, tokenizer: Tokenizer) -> JudgeSpec:
    """The judge's template and verdicts as the policy tokenizer's ids (BOS first when it has one)."""
    try:
        prefix, middle, suffix = split_template(section.template)
    except ValueError as err:
        raise ConfigError(f"reward.model.template={section.template!r}: {err}") from None
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    verdicts = tuple((tuple(tokenizer.encode(text)), float(score)) for text, score in section.verdicts.items())
    if not verdicts or any(not ids for ids, _ in verdicts):
        raise ConfigError("reward.model.verdicts maps each verdict's text to its score, e.g. {Yes = 1.0, No = 0.0}")
    return JudgeSpec(prefix=tuple(bos + tokenizer.encode(prefix)), middle=tuple(tokenizer.encode(middle)),
                     suffix=tuple(tokenizer.encode(suffix)), verdicts=verdicts, default=float(section.default_score),
                     max_tokens=section.max_verdict_tokens, eos_ids=tuple(tokenizer.eos_ids), pad_id=tokenizer.pad_id)


def _correct_verifier(kind: str, section: RewardSection):
    limit = None if section.inline else section.time_limit_s
    return {
        "reasoning_gym": lambda: rewards.ReasoningGymAnswer(methods=section.answer_methods, time_limit_s=limit),
        "math": lambda: rewards.MathAnswer(methods=section.answer_methods, time_limit_s=limit,
                                           form=section.answer_form),
        "code": lambda: rewards.CodeTests(),
    }[kind]()


def build_reward(section: RewardSection, sources: tuple = ()) -> rewards.RewardFn:
    """`correct` (by kind) plus an optional weighted format term; parts are reported by name.

    With mixture `sources` (`rljax.data.config.SourceSection`s), `correct` routes each row to its source's verifier (`verifier`, else
    the reward's kind) by the task name its example carries (`rljax.rewards.RoutedVerifier`)."""
    if sources:
        correct = rewards.RoutedVerifier({s.label: _correct_verifier(s.verifier or section.kind, section)
                                          for s in sources})
    else:
        correct = _correct_verifier(section.kind, section)
    terms: dict[str, Any] = {"correct": (section.correct_weight, correct)}
    if section.format_weight:
        terms["format"] = (section.format_weight, rewards.RegexFormat(section.format_pattern))
    if section.audit != "off":  # weight 0: scored and logged, never in the reward
        terms[rewards.AUDIT_PART] = (0.0, rewards.audit_verifier(section.audit, section.answer_methods))
    return rewards.compose(**terms)
