"""From an rljax checkpoint directory to (ModelConfig, params), and on to HF safetensors.

Either end may be an object-store URI: a run trained on a pod to `gs://bucket/run` exports from
there, and an export to a URI is written to a local scratch directory first and then uploaded
file by file (the safetensors writer needs a local file).
"""

from __future__ import annotations

import os
import tempfile

import jax

from rljax.checkpoint.manager import Checkpointer
from rljax.checkpoint.tree_check import model_config_from_dict
from rljax.errors import CheckpointError
from rljax.models import ModelConfig, init_params, save_hf
from rljax.storage import as_path, is_remote, upload_tree


def load_params(directory: str | os.PathLike, step: int | str | None = None) -> tuple[ModelConfig, dict]:
    """The model config and policy params of checkpoint `step` ("latest", "best" or a number).

    The params template comes from the saved `ModelConfig` (``jax.eval_shape(init_params, ...)``),
    so no model code needs to be told the architecture.
    """
    directory = os.fspath(directory)
    if not as_path(directory).is_dir():
        raise CheckpointError(f"checkpoint directory {directory!r} does not exist; check the path")
    ckpt = Checkpointer(directory, read_only=True)
    try:
        meta = ckpt.read_meta(step)
        if meta["model"] is None:
            raise CheckpointError(f"checkpoint in {directory} was saved without a model config; "
                                  "save with model_config= to load it by directory")
        cfg = model_config_from_dict(meta["model"], f"checkpoint {directory}/{meta['step']}")
        template = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
        restored = ckpt.restore(meta["step"], params=template, model_config=cfg)
    finally:
        ckpt.close()
    return cfg, restored.params


def export_hf(directory: str | os.PathLike, out_dir: str | os.PathLike, step: int | str | None = None) -> ModelConfig:
    """Write checkpoint `step` as a Hugging Face model (config.json + safetensors) into `out_dir`.

    Tokenizer files are not part of an rljax checkpoint; copy them next to the weights.
    """
    cfg, params = load_params(directory, step)
    if not is_remote(out_dir):
        save_hf(cfg, params, os.fspath(out_dir))
        return cfg
    with tempfile.TemporaryDirectory(prefix="rljax-export-") as scratch:
        save_hf(cfg, params, os.path.join(scratch, "model"))
        upload_tree(os.path.join(scratch, "model"), out_dir)
    return cfg
