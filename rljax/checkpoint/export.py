"""From an rljax checkpoint directory to (ModelConfig, params), and on to HF safetensors or, for a
LoRA run, a PEFT adapter directory.

Either end may be an object-store URI: a run trained on a pod to `gs://bucket/run` exports from
there, and an export to a URI is written to a local scratch directory first and then uploaded
file by file (the safetensors writer needs a local file).
"""

from __future__ import annotations

import os
import tempfile

import jax

from rljax.checkpoint.manager import Checkpointer, lora_config_from_dict
from rljax.checkpoint.tree_check import model_config_from_dict
from rljax.errors import CheckpointError
from rljax.lora import LoraConfig, init_adapters, merged_model, save_peft
from rljax.models import ModelConfig, init_params, save_hf
from rljax.models.vl_io import save_vl
from rljax.storage import as_path, is_remote, upload_tree
from rljax.tokenizers import Tokenizer


def load_lora(directory: str | os.PathLike, step: int | str | None = None, *, params_template=None
              ) -> tuple[ModelConfig, dict, LoraConfig | None, dict | None]:
    """(model config, params, LoRA config, adapters) of checkpoint `step` ("latest", "best" or a
    number); the last two are None for a run without LoRA, whose params are then the policy.

    The templates come from the saved configs (``jax.eval_shape(init_params, ...)`` and
    ``init_adapters``), so no model code needs to be told the architecture; `params_template`
    replaces the params' (a vision-language policy's params add its tower, `visual`).
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
        template = (jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))) if params_template is None
                    else params_template)
        lora = lora_config_from_dict(meta.get("lora")) if "adapters" in meta["items"] else None
        adapters = None if lora is None else jax.eval_shape(lambda: init_adapters(cfg, lora, jax.random.key(0)))
        restored = ckpt.restore(meta["step"], params=template, model_config=cfg, adapters=adapters)
    finally:
        ckpt.close()
    return cfg, restored.params, lora, restored.adapters


def load_params(directory: str | os.PathLike, step: int | str | None = None, *,
                params_template=None) -> tuple[ModelConfig, dict]:
    """The model config and policy params of checkpoint `step` ("latest", "best" or a number).

    A LoRA run's policy is its base with the adapters merged (`rljax.lora.merged_model`: a tied
    model with an adapted embedding comes back untied), so evaluation and export need no LoRA code.
    `params_template`: as `load_lora`'s.
    """
    cfg, params, lora, adapters = load_lora(directory, step, params_template=params_template)
    if lora is None:
        return cfg, params
    return merged_model(cfg, params, adapters, lora)


def _write(out_dir: str | os.PathLike, save, tokenizer: Tokenizer | None) -> None:
    """`save(local_dir)` and the tokenizer's files beside it, then an upload when `out_dir` is a
    URI (the writers need local files)."""
    def write(path):
        save(path)
        if tokenizer is not None:
            tokenizer.save(path)

    if not is_remote(out_dir):
        write(os.fspath(out_dir))
        return
    with tempfile.TemporaryDirectory(prefix="rljax-export-") as scratch:
        write(os.path.join(scratch, "model"))
        upload_tree(os.path.join(scratch, "model"), out_dir)


def export_hf(directory: str | os.PathLike, out_dir: str | os.PathLike, step: int | str | None = None, *,
              tokenizer: Tokenizer | None = None) -> ModelConfig:
    """Write checkpoint `step` as a Hugging Face model (config.json + safetensors) into `out_dir`;
    a LoRA run's adapters are merged into it.

    A checkpoint holds no tokenizer: pass the run's `tokenizer` and its files (`Tokenizer.save`)
    are written beside the weights, so the directory loads on its own.
    """
    cfg, params = load_params(directory, step)
    _write(out_dir, lambda path: save_hf(cfg, params, path), tokenizer)
    return cfg


def export_vl(directory: str | os.PathLike, out_dir: str | os.PathLike, step: int | str | None, vl_cfg, *,
              params_template, tokenizer: Tokenizer | None = None):
    """Write a vision-language run's checkpoint `step` as a Qwen2.5-VL HF directory
    (`Qwen2_5_VLForConditionalGeneration`: decoder, vision tower, merger and the M-RoPE sections
    in config.json; `rljax.models.vl_io.save_vl`) in `out_dir`; a LoRA run's decoder adapters are
    merged first. `vl_cfg` is the run's `VLConfig` and `params_template` its params' shapes
    (decoder plus `visual`; `rljax.train.vision_setup.build_vision` gives both). The decoder's
    config comes from the checkpoint, after the merge (an adapted tied embedding comes back
    untied), so the export computes what the trained policy does. Returns the written config."""
    text_cfg, params = load_params(directory, step, params_template=params_template)
    if "visual" not in params:
        raise CheckpointError(f"checkpoint {directory} holds no vision tower (params['visual']); it is a text "
                              "run's: export it as one")
    vl_cfg = vl_cfg.replace(text=text_cfg)
    _write(out_dir, lambda path: save_vl(vl_cfg, params, path), tokenizer)
    return vl_cfg


BASE_SUBDIR = "base"


def export_peft(directory: str | os.PathLike, out_dir: str | os.PathLike, step: int | str | None = None, *,
                tokenizer: Tokenizer | None = None) -> LoraConfig:
    """Write a LoRA run's checkpoint `step` as a PEFT adapter directory (`adapter_config.json` +
    `adapter_model.safetensors`) in `out_dir`, and the base model it adapts as a HF directory in
    `out_dir/base` (after a warm start the base is no published checkpoint), with the run's
    `tokenizer` in both when given:

        base = AutoModelForCausalLM.from_pretrained("out_dir/base")
        model = PeftModel.from_pretrained(base, "out_dir")
    """
    cfg, params, lora, adapters = load_lora(directory, step)
    if lora is None:
        raise CheckpointError(f"{directory} holds no LoRA adapters (the run trained every weight); "
                              "export it without --adapter")

    def save(path):
        save_peft(cfg, adapters, lora, path, base_model=BASE_SUBDIR)
        save_hf(cfg, params, os.path.join(path, BASE_SUBDIR))
        if tokenizer is not None:
            tokenizer.save(os.path.join(path, BASE_SUBDIR))

    _write(out_dir, save, tokenizer)
    return lora
