"""Checkpoints: save/restore training state with orbax, read params back, export to HF."""

from rljax.checkpoint.export import export_hf, export_peft, load_lora, load_params
from rljax.checkpoint.manager import Checkpointer, Restored
from rljax.checkpoint.run import RunStep, is_run_dir, open_run, tokenizer_spec
from rljax.checkpoint.tree_check import check_fits, check_model_config, leaf_specs

__all__ = ["Checkpointer", "Restored", "RunStep", "check_fits", "check_model_config", "export_hf", "export_peft",
           "is_run_dir", "leaf_specs", "load_lora", "load_params", "open_run", "tokenizer_spec"]
