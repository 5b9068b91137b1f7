"""Checkpoints: save/restore training state with orbax, read params back, export to HF."""

from rljax.checkpoint.export import export_hf, export_peft, load_lora, load_params
from rljax.checkpoint.manager import Checkpointer, Restored
from rljax.checkpoint.tree_check import check_fits, check_model_config, leaf_specs

__all__ = ["Checkpointer", "Restored", "check_fits", "check_model_config", "export_hf", "export_peft", "leaf_specs",
           "load_lora", "load_params"]
