"""Advantage estimators: rewards (and values) in, per-token advantages [B, T] out.

All estimators share one signature so the update step finds them by name:

    fn(rewards_b, group_ids_b, loss_mask_bt, *, token_rewards_bt=None, baseline_b=None,
       values_bt=None, turn_bt=None, turn_returns_bk=None, gamma=1.0, lam=1.0,
       std_normalize=True, eps=1e-6) -> adv_bt

`group_ids_b` holds integers in [0, B) naming each row's prompt group (rows of one prompt share
an id). `token_rewards_bt` is an optional dense per-token reward such as -beta * KL (KL folded
into the reward); sequence-level estimators add its row sum to the row's reward. Advantages are
zero outside `loss_mask_bt`. Groups whose rewards are all equal carry no signal: every group
estimator gives them exactly zero advantage (no 0/0 NaN), and `zero_variance_groups` counts them.
The exception is reinforce_pp_baseline: its zero is then whitened with the rest of the batch, which
shifts it by -mean / std, as in verl and the paper.

`turn_bt` / `turn_returns_bk` are multi-turn episodes' turn-level credit (`env.credit = "turn"`):
each loss token's model turn and each turn's discounted return-to-go. An estimator that uses
them declares it on its registry entry, `reads=("turn_returns",)` (grpo and dr_grpo, see
`turn_group_advantages`); `rljax.objectives.check_turn_credit` refuses them for any other
estimator. Each entry also declares the config fields it reads (`params=`: gae reads gamma and
lam), which `AlgorithmConfig` checks instead of keeping its own list.

`whiten_advantages` is the batch whitening on its own, for PPO's GAE advantages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.objectives.registry import ADVANTAGES


# ----------------------------------------------------------------------------- group statistics


def prompt_major_group_ids(batch_size: int, group_size: int):
    """Group ids for prompt-major rows: row i * n + j is sample j of prompt i -> id i."""
    return jnp.arange(batch_size, dtype=jnp.int32) // group_size


def _group_stats(x_b, group_ids_b):
    """Per-row group count, sum, mean, unbiased std and a zero-variance flag (all [B])."""
    b = x_b.shape[0]
    seg = lambda v: jax.ops.segment_sum(v, group_ids_b, num_segments=b)[group_ids_b]  # noqa: E731
    n_b = seg(jnp.ones_like(x_b))
    sum_b = seg(x_b)
    mean_b = sum_b / n_b
    var_b = seg(jnp.square(x_b - mean_b)) / jnp.maximum(n_b - 1, 1)
    gmax = jax.ops.segment_max(x_b, group_ids_b, num_segments=b)[group_ids_b]
    gmin = jax.ops.segment_min(x_b, group_ids_b, num_segments=b)[group_ids_b]
    return n_b, sum_b, mean_b, jnp.sqrt(var_b), gmax == gmin


def zero_variance_groups(rewards_b, group_ids_b):
    """Number of groups whose rewards are all equal (they give zero advantage)."""
    b = rewards_b.shape[0]
    gmax = jax.ops.segment_max(rewards_b, group_ids_b, num_segments=b)
    gmin = jax.ops.segment_min(rewards_b, group_ids_b, num_segments=b)
    present = jax.ops.segment_sum(jnp.ones_like(rewards_b), group_ids_b, num_segments=b) > 0
    return jnp.sum(present & (gmax == gmin))


def _seq_reward(rewards_b, token_rewards_bt, loss_mask_bt):
    r = rewards_b.astype(jnp.float32)
    if token_rewards_bt is not None:
        r = r + jnp.sum(token_rewards_bt * loss_mask_bt, axis=-1)
    return r


def _to_tokens(adv_b, loss_mask_bt):
    return adv_b[:, None] * loss_mask_bt.astype(jnp.float32)


# ----------------------------------------------------------------------------- sequence-level


@ADVANTAGES.register("grpo", reads=("turn_returns",), params=("std_normalize", "eps"))
def grpo(rewards_b, group_ids_b, loss_mask_bt, *, token_rewards_bt=None, turn_bt=None, turn_returns_bk=None,
         std_normalize=True, eps=1e-6, **_):
    """A_i = (r_i - mean_g r) / (std_g r + eps), std optional (GRPO, DeepSeekMath, Shao et al. 2024).

    std is the unbiased group standard deviation; zero-variance groups give A = 0. Given
    `turn_bt` and `turn_returns_bk` (multi-turn episodes, `env.credit = "turn"`), the same
    normalisation per turn index instead: `turn_group_advantages`, which reads no per-token
    reward (`token_rewards_bt` is not folded into turn returns; `check_turn_credit` refuses the
    configs that would produce one).
    """
    if turn_bt is not None or turn_returns_bk is not None:
        return turn_group_advantages(turn_bt, turn_returns_bk, group_ids_b, loss_mask_bt,
                                     std_normalize=std_normalize, eps=eps)
    r_b = _seq_reward(rewards_b, token_rewards_bt, loss_mask_bt)
    _, _, mean_b, std_b, flat_b = _group_stats(r_b, group_ids_b)
    adv_b = r_b - mean_b
    if std_normalize:
        adv_b = adv_b / (std_b + eps)
    return _to_tokens(jnp.where(flat_b, 0.0, adv_b), loss_mask_bt)


@ADVANTAGES.register("dr_grpo", reads=("turn_returns",))
def dr_grpo(rewards_b, group_ids_b, loss_mask_bt, *, token_rewards_bt=None, turn_bt=None, turn_returns_bk=None,
            **_):
    """A_i = r_i - mean_g r: GRPO without the std division (Dr. GRPO, *Understanding R1-Zero-like
    training*, Liu et al. 2025), which removes the bias toward easy or hard prompts. Per turn
    index with `turn_bt` / `turn_returns_bk` (`turn_group_advantages`, std_normalize=False)."""
    return grpo(rewards_b, group_ids_b, loss_mask_bt, token_rewards_bt=token_rewards_bt, turn_bt=turn_bt,
                turn_returns_bk=turn_returns_bk, std_normalize=False)


@ADVANTAGES.register("rloo")
def rloo(rewards_b, group_ids_b, loss_mask_bt, *, token_rewards_bt=None, **_):
    """A_i = r_i - (sum_g r - r_i) / (n_g - 1): leave-one-out baseline (RLOO, *Back to Basics*,
    Ahmadian et al. 2024). Groups of one sample give A = 0."""
    r_b = _seq_reward(rewards_b, token_rewards_bt, loss_mask_bt)
    n_b, sum_b, _, _, flat_b = _group_stats(r_b, group_ids_b)
    adv_b = r_b - (sum_b - r_b) / jnp.maximum(n_b - 1, 1)
    return _to_tokens(jnp.where(flat_b | (n_b < 2), 0.0, adv_b), loss_mask_bt)


@ADVANTAGES.register("remax", needs=("greedy_baseline",))
def remax(rewards_b, group_ids_b, loss_mask_bt, *, baseline_b=None, token_rewards_bt=None, **_):
    """A_i = r_i - r(greedy response to the same prompt) (ReMax, Li et al. 2023)."""
    if baseline_b is None:
        raise ValueError("remax needs baseline_b: the reward of the greedy response per row")
    r_b = _seq_reward(rewards_b, token_rewards_bt, loss_mask_bt)
    return _to_tokens(r_b - baseline_b.astype(jnp.float32), loss_mask_bt)


@ADVANTAGES.register("reinforce")
def reinforce(rewards_b, group_ids_b, loss_mask_bt, *, token_rewards_bt=None, **_):
    """A_i = r_i - mean_batch r: plain REINFORCE (Williams, 1992) with a batch-mean baseline."""
    r_b = _seq_reward(rewards_b, token_rewards_bt, loss_mask_bt)
    return _to_tokens(r_b - jnp.mean(r_b), loss_mask_bt)


# ----------------------------------------------------------------------------- turn-level


def turn_group_advantages(turn_bt, turn_returns_bk, group_ids_b, loss_mask_bt, *, std_normalize: bool = True,
                          eps: float = 1e-6):
    """Turn-level credit for multi-turn episodes: every token of model turn k of episode i gets

        A_{i,k} = (G_{i,k} - mean_{j in R} G_{j,k}) / (std_{j in R} G_{j,k} + eps),
        R = the episodes of i's prompt group that reached turn k,

    with G_{i,k} = sum_{j >= k} gamma^(j - k) r_{i,j} the turn's discounted return-to-go (the
    rollout computes it, `rljax.envs.discounted_turn_returns`, gamma = `env.turn_discount`). std
    is unbiased and optional (`std_normalize`), as in `grpo`. A turn index that only one episode
    of its group reached, or whose episodes all have equal returns, gives A = 0.

    Why a critic-free turn baseline. ArCHer (Zhou et al., 2024, *ArCHer: Training Language Model
    Agents via Hierarchical Multi-Turn RL*) credits a turn with the rewards that follow it and
    learns a turn-level critic as its baseline. A GRPO group already holds n episodes of the same
    prompt, so those that reached turn k are an empirical baseline for it: no second network, and
    no untrained critic at the start of RL. Whether an episode reaches turn k depends on its
    earlier turns only, not on turn k's action, so conditioning the baseline on it keeps GRPO's
    estimator (which also keeps the sample's own 1/n share of the mean).

    Why not MT-GRPO (Zeng et al., 2025, *Reinforcing Multi-Turn Reasoning in LLM Agents via
    Turn-Level Credit Assignment*): there A = A^turn_k + lambda * A^outcome on a tool turn and
    A^outcome on the final turn, each a group-normalised reward. It assumes every episode of the
    group has the same turns (a tool turn, then the answer), adds lambda, and with no per-turn
    reward it is GRPO again. The return-to-go form takes groups whose episodes end at different
    turns, and with gamma = 1 and only a final reward turn 0 is exactly GRPO (G_{i,0} = R_i) while
    a later turn is compared with the siblings that also got there (among the episodes that
    called the tool, those that then answered right against those that did not). gamma < 1 credits
    an earlier turn with gamma^d of a reward d turns later, so a correct answer in fewer turns
    scores higher at turn 0.

    A = 0 on a turn no sibling reached: nothing from the same point compares with it (as GRPO and
    RLOO give a group of one zero). The choice that led there is still credited at the earlier
    turns, which the siblings share.

    turn_bt: int [B, T], the model turn (0..K-1) of each token, -1 on the prompt, the
    environment's tokens and padding (their advantage is exactly 0; with the loss mask 0 there they
    count in no aggregation denominator). turn_returns_bk: f32 [B, K], G_{b,k}; values at turns a
    row did not reach are ignored. A row with an all-False loss mask (a void-filtered episode)
    still counts in its group's baselines, as `grpo`'s group statistics count every row.
    """
    b, k = turn_returns_bk.shape
    g_bk = turn_returns_bk.astype(jnp.float32)
    turn_bt = turn_bt.astype(jnp.int32)
    slot_bt = jnp.clip(turn_bt, 0, k - 1)
    rows_bt = jnp.broadcast_to(jnp.arange(b)[:, None], turn_bt.shape)
    reached_bk = jnp.zeros((b, k), bool).at[rows_bt, slot_bt].max(turn_bt >= 0)
    w_bk = reached_bk.astype(jnp.float32)
    seg = lambda v: jax.ops.segment_sum(v, group_ids_b, num_segments=b)[group_ids_b]  # noqa: E731
    n_bk = seg(w_bk)
    mean_bk = seg(g_bk * w_bk) / jnp.maximum(n_bk, 1.0)
    var_bk = seg(jnp.square(g_bk - mean_bk) * w_bk) / jnp.maximum(n_bk - 1.0, 1.0)
    gmax_bk = jax.ops.segment_max(jnp.where(reached_bk, g_bk, -jnp.inf), group_ids_b, num_segments=b)[group_ids_b]
    gmin_bk = jax.ops.segment_min(jnp.where(reached_bk, g_bk, jnp.inf), group_ids_b, num_segments=b)[group_ids_b]
    adv_bk = g_bk - mean_bk
    if std_normalize:
        adv_bk = adv_bk / (jnp.sqrt(var_bk) + eps)
    adv_bk = jnp.where(reached_bk & (gmax_bk != gmin_bk), adv_bk, 0.0)
    adv_bt = jnp.where(turn_bt >= 0, jnp.take_along_axis(adv_bk, slot_bt, axis=1), 0.0)
    return adv_bt * loss_mask_bt.astype(jnp.float32)


# ----------------------------------------------------------------------------- token-level


def _reverse_discounted_sum(x_bt, mask_bt, gamma):
    """G_t = x_t + gamma * G_{t'} over masked steps, with t' the next masked step (reverse scan)."""
    def step(g_next, xs):
        x, m = xs
        g = jnp.where(m, x + gamma * g_next, g_next)
        return g, jnp.where(m, g, 0.0)

    _, g_tb = jax.lax.scan(step, jnp.zeros(x_bt.shape[0], jnp.float32),
                           (x_bt.T.astype(jnp.float32), mask_bt.T.astype(bool)), reverse=True)
    return g_tb.T


def _last_token_onehot(loss_mask_bt):
    m = loss_mask_bt.astype(jnp.int32)
    t = m.shape[-1]
    last_b = t - 1 - jnp.argmax(m[:, ::-1], axis=-1)
    return (jnp.arange(t)[None, :] == last_b[:, None]) & (jnp.sum(m, axis=-1, keepdims=True) > 0)


def dense_rewards(rewards_b, loss_mask_bt, token_rewards_bt=None):
    """Per-token rewards: the sequence reward on the last completion token plus any dense part."""
    r_bt = _last_token_onehot(loss_mask_bt) * rewards_b.astype(jnp.float32)[:, None]
    if token_rewards_bt is not None:
        r_bt = r_bt + token_rewards_bt
    return r_bt * loss_mask_bt


def _masked_mean_var(x_bt, m_bt):
    """Mean and unbiased variance of x over the tokens where m > 0 (other values are ignored)."""
    valid = m_bt > 0
    x_bt = jnp.where(valid, x_bt.astype(jnp.float32), 0.0)
    n = jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)
    mean = jnp.sum(x_bt) / n
    var = jnp.sum(jnp.where(valid, jnp.square(x_bt - mean), 0.0)) / jnp.maximum(n - 1, 1.0)
    return mean, var


def whiten_advantages(adv_bt, mask_bt, shift_mean: bool = True, eps: float = 1e-8):
    """Whitening over the batch's valid tokens, zero off the mask:

        A'_t = (A_t - mean A) / sqrt(var A + eps),   plus mean A again when shift_mean is False,

    with the mean and the unbiased variance taken over every token where mask > 0. This is verl's
    `masked_whiten` (eps inside the square root, as there), the advantage normalisation of OpenAI
    baselines' PPO, and of *Secrets of RLHF in Large Language Models Part I: PPO* (Zheng et al.,
    2023). Apply it to GAE advantages after the returns are formed, so the returns stay raw.
    """
    m = mask_bt.astype(jnp.float32)
    mean, var = _masked_mean_var(adv_bt, m)
    out = (adv_bt.astype(jnp.float32) - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return jnp.where(m > 0, out, 0.0)


def scale_negative_advantages(adv_bt, scale: float):
    """Asymmetric credit: ``A'_t = A_t`` where ``A_t > 0``, ``scale * A_t`` elsewhere.

    With a binary reward and ReMax's greedy baseline, every negative advantage belongs to a prompt
    the greedy answer already solves (a wrong sample, -1): its gradient sharpens the policy around
    answers it already gives greedily, and the entropy collapses before the rarer positive samples
    of unsolved prompts move their greedy answers (measured in docs/mixtures.md).
    Scaling the negative side follows the positive/negative decomposition of *The Surprising
    Effectiveness of Negative Reinforcement in LLM Reasoning* (Zhu et al., 2025), which weights
    the two sides separately (their W-REINFORCE down-weights the positive side for pass@k; held-out
    accuracy here is greedy, pass@1, so it is the negative side that is scaled). ``scale = 1`` is the
    symmetric objective; ``scale = 0`` trains on positive samples only (rejection-sampling SFT with
    weights).
    """
    return jnp.where(adv_bt < 0, scale * adv_bt, adv_bt)


@ADVANTAGES.register("reinforce_pp", params=("gamma", "eps"))
def reinforce_pp(rewards_b, group_ids_b, loss_mask_bt, *, token_rewards_bt=None, gamma=1.0,
                 eps=1e-6, **_):
    """REINFORCE++ (Hu, 2025): discounted return-to-go of dense rewards (the sequence reward at the
    last token, -beta * KL_t folded in per token), G_t = r_t + gamma * G_{t+1} over the row's
    masked steps, then normalised over all valid tokens of the batch:

        A_t = (G_t - mean G) / (std G + eps),   std unbiased.

    Like verl's compute_reinforce_plus_plus_outcome_advantage, which whitens with eps inside the
    square root, (G - mean) / sqrt(var + 1e-8); the two agree to about eps / std.
    """
    m = loss_mask_bt.astype(jnp.float32)
    g_bt = _reverse_discounted_sum(dense_rewards(rewards_b, m, token_rewards_bt), m, gamma)
    mean, var = _masked_mean_var(g_bt, m)
    return (g_bt - mean) / (jnp.sqrt(var) + eps) * m


@ADVANTAGES.register("reinforce_pp_baseline")
def reinforce_pp_baseline(rewards_b, group_ids_b, loss_mask_bt, *, token_rewards_bt=None, **_):
    """REINFORCE++-baseline (Hu, *REINFORCE++*, 2025): a group-mean baseline, then whitening over
    the batch's valid tokens (verl's compute_reinforce_plus_plus_baseline_outcome_advantage):

        A_i = r_i - mean_g r        on every valid token of row i,
        A_t <- whiten_advantages(A)  = (A_t - mean A) / sqrt(var A + 1e-8).

    r_i is the sequence reward plus the row sum of any dense `token_rewards_bt` (-beta * KL).
    Differs from verl on groups with one sample (verl's baseline is 0 there, so A_i = r_i) and on
    groups whose rewards are all equal: rljax gives both 0 before whitening, as its other group
    estimators do (one sample, or equal rewards, says nothing about which response was better).
    The shared `eps` is not used: the whitening keeps verl's 1e-8 inside the square root.
    """
    r_b = _seq_reward(rewards_b, token_rewards_bt, loss_mask_bt)
    _, _, mean_b, _, flat_b = _group_stats(r_b, group_ids_b)
    adv_b = jnp.where(flat_b, 0.0, r_b - mean_b)
    return whiten_advantages(_to_tokens(adv_b, loss_mask_bt), loss_mask_bt)


def gae_from_rewards(rewards_bt, values_bt, mask_bt, gamma: float = 1.0, lam: float = 1.0):
    """Generalised advantage estimation (Schulman et al., 2016) by reverse `lax.scan` over time.

    delta_t = r_t + gamma * V_{t'} - V_t and A_t = delta_t + gamma * lam * A_{t'}, where t' is the
    next masked step (V = 0 and A = 0 past the last). values_bt[:, t] is V(state before token t).
    With gamma = lam = 1, A_t = sum_{k>=t} r_k - V_t.
    """
    m_tb = mask_bt.T.astype(bool)
    r_tb, v_tb = rewards_bt.T.astype(jnp.float32), values_bt.T.astype(jnp.float32)

    def step(carry, xs):
        a_next, v_next = carry
        r, v, m = xs
        a = r + gamma * v_next - v + gamma * lam * a_next
        return (jnp.where(m, a, a_next), jnp.where(m, v, v_next)), jnp.where(m, a, 0.0)

    zeros = jnp.zeros(r_tb.shape[1], jnp.float32)
    _, adv_tb = jax.lax.scan(step, (zeros, zeros), (r_tb, v_tb, m_tb), reverse=True)
    return adv_tb.T


@ADVANTAGES.register("gae", needs=("values",), params=("gamma", "lam"))
def gae(rewards_b, group_ids_b, loss_mask_bt, *, values_bt=None, token_rewards_bt=None, gamma=1.0,
        lam=1.0, **_):
    """GAE(gamma, lambda) with a value model (PPO, Schulman et al. 2017; GAE 2016); the sequence
    reward arrives on the last completion token, plus any dense per-token reward."""
    if values_bt is None:
        raise ValueError("gae needs values_bt from a value model")
    m = loss_mask_bt.astype(jnp.float32)
    return gae_from_rewards(dense_rewards(rewards_b, m, token_rewards_bt), values_bt, m, gamma, lam)
