"""A frozen weight with its LoRA adapter, as one pytree leaf group the model's forward understands.

`attach` (rljax.lora.adapters) puts a `LoraWeight` where a params tree has a plain weight; the
model calls it at its three weight uses (`rljax.models.layers`, `rljax.models.transformer`):

    project(x, w)         x W + s ((drop(x) A) B)            every attention / MLP projection
    embed_tokens(ids)     W[ids] + s (A[ids] B)              the input embedding
    output_embedding      W + s (A B)^T                      an untied LM head (merged: [V, D])

The adapter branch is never merged into W in the trained forward: the gradient reaches A and B
through two thin matmuls, and W, frozen, never gets a gradient or optimiser state. Plain arrays
take the model's unchanged path; the check is Python-side, at trace time.

Shapes, per layer (stacked weights carry a leading L on every field, so `lax.scan` over layers
slices them as it slices W): a projection contracting `in...` into `out...` has A [in..., r] and
B [r, out...]; the embedding [V, D] has A [V, r], B [r, D]; the head [V, D] (h @ W^T) has
A [D, r], B [r, V]. These are PEFT's `lora_A.weight` / `lora_B.weight` transposed
(`rljax.lora.peft_io`), so the math is PEFT's: `base(x) + lora_B(lora_A(dropout(x))) * scaling`.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from rljax.models.layers import project


@flax.struct.dataclass
class LoraWeight:
    """W with a LoRA adapter: W + scale * A B (`kind` says how A B lines up with W; module docstring).

    `dropout_key` (one key per layer for a stacked weight) turns on inverted dropout at rate
    `dropout` on the adapter branch's input; None (the sampler, reference and scoring passes)
    runs without it."""

    w: jax.Array
    lora_a: jax.Array
    lora_b: jax.Array
    dropout_key: jax.Array | None = None
    scale: float = flax.struct.field(pytree_node=False, default=1.0)
    dropout: float = flax.struct.field(pytree_node=False, default=0.0)
    kind: str = flax.struct.field(pytree_node=False, default="linear")

    def _dropped(self, x):
        if self.dropout_key is None or self.dropout == 0.0:
            return x
        keep = jax.random.bernoulli(self.dropout_key, 1.0 - self.dropout, x.shape)
        return jnp.where(keep, x / (1.0 - self.dropout), 0.0).astype(x.dtype)

    def project(self, x, contract: int, dtype):
        """x W + s (drop(x) A) B in f32, each matmul's operands in `dtype` (as `project`)."""
        y = project(x, self.w, contract, dtype)
        xa = project(self._dropped(x), self.lora_a, contract, dtype)  # [..., r]
        return y + self.scale * project(xa, self.lora_b, 1, dtype)

    def lookup(self, ids, dtype):
        """Rows `ids` of W + s A B, in f32: the base rows plus s A[ids] B (PEFT's Embedding has
        no dropout)."""
        rows = jnp.take(self.w, ids, axis=0).astype(jnp.float32)
        return rows + self.scale * project(jnp.take(self.lora_a, ids, axis=0), self.lora_b, 1, dtype)

    def delta(self):
        """s A B laid out as W, in f32 (for a stacked weight, every layer's)."""
        stacked = self.lora_a.ndim + self.lora_b.ndim - 2 == self.w.ndim + 1  # a leading L on all three
        lead = self.w.shape[:1] if stacked else ()
        r = self.lora_a.shape[-1]
        a = self.lora_a.astype(jnp.float32).reshape(*lead, -1, r)
        b = self.lora_b.astype(jnp.float32).reshape(*lead, r, -1)
        ab = jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
        if self.kind == "head":  # A B is [D, V]; the head is stored [V, D]
            ab = jnp.swapaxes(ab, -1, -2)
        return self.scale * ab.reshape(self.w.shape)

    def merged(self):
        """W + s A B in W's dtype: one plain weight with the same function (up to rounding)."""
        return (self.w.astype(jnp.float32) + self.delta()).astype(self.w.dtype)

    def output_matrix(self):
        """The [V, D] matrix logits are computed against: the merged head; for the input embedding
        of a tied model, the base embedding (the tied head is not adapted, as in PEFT)."""
        return self.w if self.kind == "embedding" else self.merged()
