"""rljax: a JAX-native RL stack that trains language models to reason."""

__version__ = "0.1.0"
