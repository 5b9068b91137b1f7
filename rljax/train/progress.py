"""A one-line progress bar for the RL loop: reward, held-out accuracy and tokens/s, and in the
overlapped modes the sampler's and trainer's busy fractions (how much they overlap)."""

from __future__ import annotations


class Progress:
    def __init__(self, total: int, start: int = 0, enabled: bool = True):
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, desc="rl", unit="it", dynamic_ncols=True)
        self._acc = None

    def update(self, metrics: dict) -> None:
        if self._bar is None:
            return
        if metrics.get("eval/accuracy") is not None:
            self._acc = metrics["eval/accuracy"]
        post = {"reward": f"{metrics['rollout/reward_mean']:.3f}", "tok/s": f"{metrics['time/generated_tokens_per_s']:.0f}"}
        if self._acc is not None:
            post["acc"] = f"{self._acc:.3f}"
        if "time/sampler_busy_frac" in metrics:  # overlapped modes: how busy each side was (overlap)
            post["busy s/t"] = f"{metrics['time/sampler_busy_frac']:.2f}/{metrics['time/trainer_busy_frac']:.2f}"
        self._bar.set_postfix(post, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
