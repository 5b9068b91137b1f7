"""A one-line progress bar for the RL loop: reward, held-out accuracy and tokens/s, and in the
overlapped modes the sampler's and trainer's busy fractions (how much they overlap); and a count
of the programs JAX compiles per step (`time/compiles`)."""

from __future__ import annotations

import jax

# One event per program JAX lowers (a persistent-cache hit is still one): the count of programs.
LOWERING_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"


class CompileCounter:
    """Counts the programs JAX compiles in this process, through `jax.monitoring`. A sampler
    configuration compiles a stated number of programs once (`rljax.sampling.sampler`), so a
    step that compiles after the first shows a batch or length leaving its bucket."""

    def __init__(self):
        self._count = self._taken = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event, *_args, **_kw):
        if event == LOWERING_EVENT:
            self._count += 1

    def take(self) -> int:
        """Programs compiled since the last `take` (or since the counter started)."""
        new, self._taken = self._count - self._taken, self._count
        return new

    def close(self) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)


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
        if "update/pad_fraction" in metrics:  # packed updates: padding share of the rows, then of the buffers
            post["pad"] = f"{metrics['update/pad_fraction_padded']:.2f}->{metrics['update/pad_fraction']:.2f}"
        if "time/sampler_busy_frac" in metrics:  # overlapped modes: how busy each side was (overlap)
            post["busy s/t"] = f"{metrics['time/sampler_busy_frac']:.2f}/{metrics['time/trainer_busy_frac']:.2f}"
        self._bar.set_postfix(post, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
