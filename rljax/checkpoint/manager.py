"""Training checkpoints on orbax: params, optimiser state, step, RNG key, data state, config.

One checkpoint is one step directory with these orbax items:

    params     StandardSave   the policy parameters (what `load_params` reads)
    opt_state  StandardSave   optimiser state (optional)
    extra      StandardSave   any other pytree: critic, reference policy... (optional)
    adapters   StandardSave   LoRA adapters trained on the frozen `params` (optional; `rljax.lora`)
    meta       JsonSave       {"format", "step", "rng": {"impl", "data"}, "model": ModelConfig fields,
                              "lora": LoraConfig fields (with adapters), "items"}
    data       JsonSave       the data iterator's `get_state()`
    config     JsonSave       the run's config as a JSON dict

Saving is asynchronous (arrays are copied to host before `save` returns, so the caller may
donate them right after). Orbax writes into ``<step>.orbax-checkpoint-tmp`` and renames on
commit, so a save killed midway is never taken as the latest; leftover tmp dirs are removed
when a `Checkpointer` opens the directory. The last `keep_last` checkpoints are kept, plus the
best one by `best_metric` when given. The metric and its mode are written into each step's
`meta`, so a reader opened without them (`rljax eval`, `rljax export`) still takes "best" to
mean the run's own best, not the latest. Typed PRNG keys are stored as `jax.random.key_data` plus
the implementation name and rebuilt with `jax.random.wrap_key_data`, bit for bit.

`directory` may be an object-store URI (``gs://bucket/run/checkpoints``): it reaches orbax as
given, so every process of a multi-host run writes its shards to the same place and any of them
can resume. A local directory is made absolute (orbax requires it).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers

from rljax.checkpoint.tree_check import check_fits, check_model_config, model_config_from_dict
from rljax.errors import CheckpointError
from rljax.lora import LoraConfig
from rljax.models import ModelConfig
from rljax.storage import absolute

FORMAT = 1
_TREES = ("params", "opt_state", "extra", "adapters")
_JSONS = ("data", "config")


@dataclasses.dataclass(frozen=True)
class Restored:
    """What one checkpoint holds; items that were not saved (or not asked for) are None."""

    step: int
    params: Any
    opt_state: Any = None
    extra: Any = None
    rng: jax.Array | None = None
    data_state: dict | None = None
    config: dict | None = None
    model_config: ModelConfig | None = None
    metrics: dict | None = None
    adapters: Any = None
    lora: LoraConfig | None = None


def _key_to_json(key: jax.Array | None) -> dict | None:
    if key is None:
        return None
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return {"impl": str(jax.random.key_impl(key)), "data": np.asarray(jax.random.key_data(key)).tolist()}
    return {"impl": None, "data": np.asarray(key).tolist(), "dtype": str(np.asarray(key).dtype)}


def _key_from_json(blob: dict | None) -> jax.Array | None:
    if blob is None:
        return None
    if blob["impl"] is None:  # a raw uint32 key saved as it was
        return jax.numpy.asarray(np.asarray(blob["data"], dtype=blob["dtype"]))
    return jax.random.wrap_key_data(np.asarray(blob["data"], np.uint32), impl=blob["impl"])


def lora_config_from_dict(fields: dict | None) -> LoraConfig | None:
    """A saved `LoraConfig` (JSON turned its tuple of targets into a list); None when not saved."""
    if fields is None:
        return None
    return LoraConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def _abstract(tree: Any) -> Any:
    """ShapeDtypeStructs with a sharding for every leaf, so restored arrays land where asked."""
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def one(x):
        sharding = getattr(x, "sharding", None) or default
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype,
                                    sharding=sharding)

    return jax.tree.map(one, tree)


class Checkpointer:
    """Save and restore rljax training checkpoints in `directory` (a thin layer over orbax).

        with Checkpointer(run_dir / "checkpoints", keep_last=3, best_metric="eval/accuracy") as ckpt:
            ckpt.save(step, params=params, opt_state=opt_state, rng=key, data_state=it.get_state(),
                      config=cfg_dict, model_config=model_cfg, metrics={"eval/accuracy": acc})
            r = ckpt.restore(params=params, opt_state=opt_state, model_config=model_cfg)
    """

    def __init__(self, directory: str | os.PathLike, *, keep_last: int = 3, best_metric: str | None = None,
                 best_mode: str = "max", async_save: bool = True, read_only: bool = False,
                 processes: set[int] | None = None):
        if keep_last < 1:
            raise CheckpointError(f"keep_last={keep_last} must be >= 1")
        if best_mode not in ("max", "min"):
            raise CheckpointError(f"best_mode={best_mode!r}; choose 'max' or 'min'")
        self.directory = absolute(directory)  # a URI stays whole: os.path would make it a local path
        self.best_metric, self.best_mode = best_metric, best_mode
        self.processes = processes  # the subset that saves (None: every process)
        policies = [checkpoint_managers.LatestN(n=keep_last)]
        best_fn = None
        if best_metric is not None:
            def best_fn(metrics):
                return float(metrics[best_metric])

            policies.append(checkpoint_managers.BestN(get_metric_fn=best_fn, reverse=best_mode == "min", n=1,
                                                      keep_checkpoints_without_metrics=False))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=checkpoint_managers.AnyPreservationPolicy(policies),
            best_fn=best_fn, best_mode=best_mode, enable_async_checkpointing=async_save,
            cleanup_tmp_directories=not read_only, create=not read_only and not processes, read_only=read_only,
            # `processes`: the subset that saves (a multi-process async run's trainer hosts); None: all
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                primary_host=min(processes) if processes else 0, active_processes=processes))
        handlers = {name: ocp.StandardCheckpointHandler() for name in _TREES}
        handlers.update({name: ocp.JsonCheckpointHandler() for name in (*_JSONS, "meta")})
        if processes and not read_only:  # orbax creates the root only when every process takes part
            epath.Path(self.directory).mkdir(parents=True, exist_ok=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    # -- saving ---------------------------------------------------------------------------
    def save(self, step: int, *, params: Any, opt_state: Any = None, extra: Any = None,
             rng: jax.Array | None = None, data_state: Mapping | None = None, config: Mapping | None = None,
             model_config: ModelConfig | None = None, metrics: Mapping[str, float] | None = None,
             adapters: Any = None, lora: LoraConfig | None = None) -> None:
        """Start saving checkpoint `step`; returns once arrays are on the host (write continues).
        `adapters` (LoRA, on the frozen `params`) need their `lora` config."""
        if (adapters is None) != (lora is None):
            raise ValueError("save LoRA adapters together with their lora config")
        if self.best_metric is not None and metrics is not None and self.best_metric not in metrics:
            raise CheckpointError(f"metrics {sorted(metrics)} lack the best-checkpoint metric {self.best_metric!r}")
        trees = {"params": params, "opt_state": opt_state, "extra": extra, "adapters": adapters}
        items = {k: ocp.args.StandardSave(v) for k, v in trees.items() if v is not None}
        jsons = {"data": data_state, "config": config}
        items.update({k: ocp.args.JsonSave(dict(v)) for k, v in jsons.items() if v is not None})
        meta = {"format": FORMAT, "step": int(step), "rng": _key_to_json(rng), "items": sorted(items),
                "model": None if model_config is None else dataclasses.asdict(model_config),
                "lora": None if lora is None else dataclasses.asdict(lora),
                "best": None if self.best_metric is None else {"metric": self.best_metric, "mode": self.best_mode}}
        items["meta"] = ocp.args.JsonSave(meta)
        try:
            self._manager.save(int(step), args=ocp.args.Composite(**items), force=True,
                               metrics=None if metrics is None else {k: float(v) for k, v in metrics.items()})
        except ocp.checkpoint_manager.StepAlreadyExistsError:
            raise CheckpointError(f"checkpoint step {step} already exists in {self.directory}; "
                                  "resume from it or use a new run directory") from None

    def wait(self) -> None:
        """Block until every pending asynchronous save is committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reading --------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def tracked_metric(self) -> tuple[str, str] | None:
        """(metric, "max" | "min") that ranks the checkpoints: the `best_metric` given here, else the
        one the run saved in its latest step's meta, else (for runs saved before meta carried it)
        the one metric every ranked step was saved with; None when the run tracked none."""
        if self.best_metric is not None:
            return self.best_metric, self.best_mode
        if not self.all_steps():
            return None
        declared = self.read_meta("latest").get("best")
        if declared:
            return declared["metric"], declared["mode"]
        keys = {tuple(sorted(m)) for m in map(self._manager.metrics, self.all_steps()) if m}
        return (keys.pop()[0], "max") if len(keys) == 1 and len(next(iter(keys))) == 1 else None

    def metric(self, step: int) -> float | None:
        """The tracked metric's value saved with checkpoint `step` (None: not tracked or not saved)."""
        tracked = self.tracked_metric()
        value = (self._manager.metrics(step) or {}).get(tracked[0]) if tracked else None
        return None if value is None else float(value)

    def best_step(self) -> int | None:
        """The step with the best tracked metric (`tracked_metric`); the latest step when the run
        tracked none. Ties go to the later step."""
        tracked = self.tracked_metric()
        if tracked is None:
            return self.latest_step()
        ranked = [(v, s) for s in self.all_steps() if (v := self.metric(s)) is not None]
        if not ranked:
            return self.latest_step()
        sign = 1 if tracked[1] == "max" else -1
        return max(ranked, key=lambda vs: (sign * vs[0], vs[1]))[1]

    def _step(self, step: int | str | None) -> int:
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory}; train first or check the path")
        if step is None or step == "latest":
            return steps[-1]
        if step == "best":
            return self.best_step()
        if int(step) not in steps:
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; available: {steps}")
        return int(step)

    def read_meta(self, step: int | str | None = None) -> dict:
        """The JSON `meta` item (step, rng, model config fields, saved items) of a checkpoint."""
        step = self._step(step)
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {self.directory}/{step} has format {meta.get('format')}, "
                                  f"this rljax reads format {FORMAT}")
        return meta

    def restore(self, step: int | str | None = None, *, params: Any, opt_state: Any = None, extra: Any = None,
                model_config: ModelConfig | None = None, adapters: Any = None) -> Restored:
        """Restore checkpoint `step` ("latest" by default, or "best", or a number).

        `params`, `opt_state`, `extra`, `adapters` are templates (arrays or ShapeDtypeStructs) giving the
        structure, shapes, dtypes and shardings to restore into; trees left None are skipped.
        Raises `CheckpointError` naming the first mismatch if the checkpoint does not fit the
        templates or was saved with a different `model_config`.
        """
        step = self._step(step)
        meta = self.read_meta(step)
        where = f"checkpoint {self.directory}/{step}"
        saved_model = model_config_from_dict(meta["model"], where) if meta["model"] is not None else None
        if model_config is not None and saved_model is not None:
            check_model_config(saved_model, model_config, where)
        wanted = {"params": params, "opt_state": opt_state, "extra": extra, "adapters": adapters}
        item_meta = self._manager.item_metadata(step)
        args = {}
        for name, template in wanted.items():
            if template is None:
                continue
            if name not in meta["items"]:
                raise CheckpointError(f"{where} has no {name}; restore without it or pick another checkpoint")
            check_fits(item_meta[name].tree, template, name, where)
            args[name] = ocp.args.StandardRestore(_abstract(template))
        args.update({k: ocp.args.JsonRestore() for k in _JSONS if k in meta["items"]})
        out = self._manager.restore(step, args=ocp.args.Composite(**args))
        return Restored(step=int(meta["step"]), params=out["params"] if params is not None else None,
                        opt_state=out["opt_state"] if opt_state is not None else None,
                        extra=out["extra"] if extra is not None else None, rng=_key_from_json(meta["rng"]),
                        data_state=out["data"] if "data" in args else None,
                        config=out["config"] if "config" in args else None, model_config=saved_model,
                        metrics=self._manager.metrics(step), adapters=out["adapters"] if adapters is not None else None,
                        lora=lora_config_from_dict(meta.get("lora")))
