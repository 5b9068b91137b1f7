"""The sampling controls: one frozen, validated dataclass that every sampler entry point takes.

`generate`, `stream`, the traceable `sample`, the evaluator and `TrainConfig.sampling` all take a
`SampleControls`. It splits in two for compilation:

    static()   -> StaticControls: which filters are on, top_k, EOS ids, stop sequences, pad id
                  (a jit static argument: changing it compiles a new variant)
    scalars()  -> (temperature, top_p, min_p) float32 values, traced (changing them never recompiles)

`max_new_tokens` is traced too; only its bucket (`bucket_length`) and `num_samples` shape the
compiled program.

`decode_phases` is how many cache widths the static loop decodes with (`rljax.sampling.decode`):
0 picks it by backend, `DECODE_PHASES_CPU` on the CPU, where decode attention reads every slot of
the cache, and 1 (one loop over the full width) elsewhere, where fewer loops compile faster (and
a decode kernel that stops at each row's length reads no empty slot). It changes the compiled
program, not the tokens.

`scheduler` picks the decode loop: "static" decodes the whole batch until its last row ends (as
transformers' `generate` does); "continuous" decodes a fixed number of slots and gives a slot whose
row has ended to the next pending row (`rljax.sampling.continuous`). Both give the same tokens for
the same key: every row draws from its own key, fold_in(key, row), at each token index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from rljax.config_io import bounded
from rljax.errors import ConfigError
from rljax.sampling.filters import Filters, make_filters


SCHEDULERS = ("static", "continuous")
KV_LAYOUTS = ("slots", "paged")
DRAWS = ("auto", "reference", "one_pass")
WEIGHT_DTYPES = ("model", "fp8", "fp8_w8a8")
KV_DTYPES = ("model", "fp8")
DECODE_PHASES_CPU = 3  # widths N/4, N/2, N: within 3% of doubling from 16's attention read (BENCHMARKS.md)


def default_decode_phases(backend: str | None = None) -> int:
    """`decode_phases` when it is 0: `DECODE_PHASES_CPU` on the CPU, 1 on accelerators."""
    return DECODE_PHASES_CPU if (backend or jax.default_backend()) == "cpu" else 1


def default_draw(backend: str | None = None) -> str:
    """`draw` when it is "auto": "one_pass" on accelerators, where the vocabulary-wide passes are
    a tenth of a decode step; "reference" on the CPU, so CPU runs keep their exact tokens."""
    return "reference" if (backend or jax.default_backend()) == "cpu" else "one_pass"


@dataclasses.dataclass(frozen=True)
class StaticControls:
    """The compile-time half of `SampleControls` (hashable; a jit static argument)."""

    filters: Filters
    eos_ids: tuple[int, ...]
    stop_sequences: tuple[tuple[int, ...], ...]
    pad_id: int
    logits_processor: Callable | None = None
    batch_invariant: bool = False
    decode_phases: int = 1
    draw: str = "reference"
    decode_chunk: int = 0
    record_routes: bool = False
    kv_dtype: str = "model"
    prefill_chunk: int = 0


@dataclasses.dataclass(frozen=True)
class SampleControls:
    """How completions are drawn: length, group size, the sampling distribution and stops.

    max_new_tokens: completion budget per row (>= 1).
    num_samples: completions per prompt (>= 1); rows are prompt-major.
    temperature: >= 0; 0 means greedy.
    top_k: keep the k most likely tokens (0: off). top_p: nucleus mass in (0, 1] (1: off).
    min_p: keep tokens with p >= min_p * max p, in [0, 1) (0: off). See `rljax.sampling.filters`.
    greedy: arg-max decoding whatever the filters say.
    eos_ids: ids that end a row (the EOS token is part of the completion). None means "the
      tokenizer's": `with_tokenizer` fills it in; a sampler given None stops on no id.
    stop_sequences: non-empty token-id sequences that end a row when completed.
    pad_id: the id after a row ends. None means "the tokenizer's" (`with_tokenizer`); a sampler
      given None pads with 0.
    scheduler: "static" or "continuous" (see the module docstring).
    slots: continuous only: rows decoded at once. 0 means as many as `max_total_tokens` allows,
      else min(rows, 64).
    max_total_tokens: continuous only: the KV cache budget in tokens; each slot holds
      bucket(prompt) + bucket(max_new_tokens) tokens, so it caps the slots (0: no cap).
    kv_cache_bytes: continuous only: the KV cache budget in bytes instead of tokens (0: unset; not
      with max_total_tokens). It becomes max_total_tokens = kv_cache_bytes // the bytes one token
      takes over all layers as `kv_dtype` stores it (`rljax.sampling.slots.kv_bytes_per_token`),
      so an FP8 cache holds about twice the tokens, slots or pages of a bf16 one in the same
      bytes, as vLLM sizes its block pool from memory. Position bookkeeping is not counted.
    prefill_batch: continuous only: prompts prefilled together inside the decode loop as slots
      need them (a ring of 2 x prefill_batch prompts); 0 prefills every prompt once, up front.
    refill_batch: continuous only: the most slots refilled in one decode step (0: slots / 4).
    prefill_chunk: prompt slots per chunk of a chunked prefill (`rljax.sampling.chunked_prefill`):
      a prompt bucket longer than this runs its forward this many slots at a time, writing the KV
      cache chunk by chunk, so no [P, P] scores or full-length activations exist at once (0: off,
      one pass). Either scheduler.
    kv_layout: continuous only: "slots" (each slot a contiguous bucket(prompt) + bucket(new)
      cache) or "paged" (`rljax.sampling.paged`: a pool of `max_total_tokens // page_size` pages
      taken as rows grow, full prompt pages shared by a prompt's samples; needs
      max_total_tokens or kv_cache_bytes, prefills every prompt up front).
    page_size: tokens per page of the paged layout (>= 1).
    batch_invariant: compute every row alone (prefill and decode), and decode the static loop at
      full cache width, so a row's tokens and log-probs are bitwise the same whatever batch, slot
      count or scheduler computes it. Slower (the weights are read once per row); for checks
      and reproducibility. Without it, schedulers agree on the tokens and on the log-probs to
      the last bits of f32 (XLA:CPU picks matmul kernels by row count).
    decode_phases: static scheduler only: decode loops over growing cache widths, new_bucket /
      2^(k-1) ... new_bucket (see the module docstring); 0 picks by backend, 1 is one loop over
      the full width. Same tokens for any value; log-probs agree to f32 rounding.
    logits_processor: optional fn(logits_bv, row_b, step_b) -> logits_bv applied to the sampling
      distribution only (the policy log-probs stay unprocessed): row_b is the row's index in
      input order, step_b the index of the token being drawn. Traced inside the decode loop; a
      new function compiles a new variant. Python API only (not a config key).
    draw: how a token and its log-probs come out of a step's logits: "reference" (the filters'
      sampler and the trainer's log-prob function, six passes over the vocabulary) or "one_pass"
      (`rljax.sampling.one_pass`: the same law and log-probs in two passes); "auto" is one_pass on
      accelerators and reference on the CPU (`default_draw`). The random stream may differ.
    decode_chunk: static loop only: decode in chunks of this many steps, testing "every row done"
      once per chunk (0 or 1: every step). Same tokens; on a GPU it saves the per-step read of the
      loop's predicate by the host. Off by default until a GPU measurement says where it pays.
    weight_dtype: "model" (the trainer's weights as they are) or "fp8": the sampler multiplies by
      the float8_e4m3fn round trip of each dense layer weight, per-output-channel scales, taken at
      each call, i.e. each weight sync (`rljax.sampling.fp8`; embedding and LM head unchanged).
      The trainer is unchanged: correct the mismatch with token-level TIS (docs/api/sampling.md).
      "fp8_w8a8": the real FP8 matmul: the sampler holds the layer weights as float8_e4m3fn with
      per-output-channel scales (half the bytes) and multiplies them with per-row FP8 activations
      (`rljax.models.fp8.Fp8Weight`), an FP8 GEMM on Hopper. "fp8" stays the emulated weight-only form.
    kv_dtype: "model" (the KV cache in the compute dtype) or "fp8": keys and values stored as
      float8_e4m3fn with one f32 scale per (row, kv head, slot), quantised where written and
      dequantised where attention reads them (`rljax.models.fp8`): about half the cache bytes.
      Every scheduler and KV layout (static, continuous slots, paged), multi-turn episodes and
      interruptible sampling (a weight swap rebuilds the cache as FP8).

    record_routes: an MoE model's top-k expert ids of every prompt and completion token, per layer,
      come back in `SampleResult.prompt_routes` / `routes` (routing replay, docs/moe.md; every
      scheduler and KV layout). The RL rollout sets it when `algorithm.routing_replay = "rollout"`.

    Lists are stored as tuples, so the controls stay hashable. A bad value is a `ConfigError`.
    """

    max_new_tokens: int = bounded(ge=1)
    num_samples: int = bounded(1, ge=1)
    temperature: float = bounded(1.0, ge=0)
    top_k: int = bounded(0, ge=0)
    top_p: float = bounded(1.0, gt=0, le=1)
    min_p: float = bounded(0.0, ge=0, lt=1)
    greedy: bool = False
    eos_ids: tuple[int, ...] | None = bounded(None, ge=0)
    stop_sequences: tuple[tuple[int, ...], ...] = bounded((), ge=0)
    pad_id: int | None = bounded(None, ge=0)
    scheduler: str = "static"
    slots: int = bounded(0, ge=0)
    max_total_tokens: int = bounded(0, ge=0)
    prefill_batch: int = bounded(0, ge=0)
    refill_batch: int = bounded(0, ge=0)
    kv_layout: str = "slots"
    page_size: int = bounded(16, ge=1)
    batch_invariant: bool = False
    decode_phases: int = bounded(0, ge=0)
    logits_processor: Callable | None = None
    draw: str = "auto"
    weight_dtype: str = "model"
    decode_chunk: int = bounded(0, ge=0)
    record_routes: bool = False
    kv_dtype: str = "model"
    kv_cache_bytes: int = bounded(0, ge=0)
    prefill_chunk: int = bounded(0, ge=0)

    def __post_init__(self):
        try:
            fields = dict(max_new_tokens=int(self.max_new_tokens), num_samples=int(self.num_samples),
                          temperature=float(self.temperature), top_k=int(self.top_k), top_p=float(self.top_p),
                          min_p=float(self.min_p), greedy=bool(self.greedy),
                          eos_ids=None if self.eos_ids is None else tuple(int(e) for e in self.eos_ids),
                          stop_sequences=tuple(tuple(int(t) for t in s) for s in self.stop_sequences),
                          pad_id=None if self.pad_id is None else int(self.pad_id),
                          slots=int(self.slots), max_total_tokens=int(self.max_total_tokens),
                          prefill_batch=int(self.prefill_batch), refill_batch=int(self.refill_batch),
                          page_size=int(self.page_size), batch_invariant=bool(self.batch_invariant),
                          decode_phases=int(self.decode_phases),
                          decode_chunk=int(self.decode_chunk), record_routes=bool(self.record_routes),
                          kv_cache_bytes=int(self.kv_cache_bytes), prefill_chunk=int(self.prefill_chunk))
        except (TypeError, ValueError) as err:
            raise ConfigError(f"sampling: every control must be a number (eos_ids, stop_sequences: token ids): "
                              f"{err}") from None
        for name, value in fields.items():
            object.__setattr__(self, name, value)
        if self.max_new_tokens < 1:
            raise ConfigError(f"sampling: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_samples < 1:
            raise ConfigError(f"sampling: num_samples must be >= 1, got {self.num_samples}")
        if self.scheduler not in SCHEDULERS:
            raise ConfigError(f"sampling: scheduler must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}")
        for name in ("slots", "max_total_tokens", "prefill_batch", "refill_batch", "decode_phases",
                     "decode_chunk", "kv_cache_bytes", "prefill_chunk"):
            if getattr(self, name) < 0:
                raise ConfigError(f"sampling: {name} must be >= 0 (0 picks it for you), got {getattr(self, name)}")
        self._check_kv_layout()
        if self.draw not in DRAWS:
            raise ConfigError(f"sampling: draw must be one of {', '.join(DRAWS)}, got {self.draw!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ConfigError(f"sampling: weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, "
                              f"got {self.weight_dtype!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"sampling: kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.logits_processor is not None and not callable(self.logits_processor):
            raise ConfigError("sampling: logits_processor must be a function fn(logits_bv, row_b, step_b) -> logits_bv")
        if any(not s for s in self.stop_sequences):
            raise ConfigError(f"sampling: stop_sequences must be non-empty token-id sequences, got "
                              f"{self.stop_sequences}")
        self.filters()  # checks temperature, top_k, top_p and min_p

    def _check_kv_layout(self):
        if self.kv_layout not in KV_LAYOUTS:
            raise ConfigError(f"sampling: kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")
        if self.kv_cache_bytes and self.max_total_tokens:
            raise ConfigError(f"sampling: max_total_tokens={self.max_total_tokens} and kv_cache_bytes="
                              f"{self.kv_cache_bytes} both set the KV budget; set one of them (the other 0)")
        if self.kv_cache_bytes and self.scheduler != "continuous":
            raise ConfigError("sampling: kv_cache_bytes sizes the continuous scheduler's KV cache; set scheduler = "
                              "\"continuous\" or kv_cache_bytes = 0 (the static cache holds every row)")
        if self.page_size < 1:
            raise ConfigError(f"sampling: page_size must be >= 1 tokens, got {self.page_size}")
        if self.kv_layout != "paged":
            return
        if self.scheduler != "continuous":
            raise ConfigError("sampling: kv_layout='paged' needs scheduler='continuous'; set scheduler = \"continuous\" "
                              "or kv_layout = \"slots\"")
        if not (self.max_total_tokens or self.kv_cache_bytes):
            raise ConfigError("sampling: kv_layout='paged' sizes its page pool from max_total_tokens; set "
                              "max_total_tokens (the KV budget in tokens) or kv_cache_bytes (in bytes)")
        if self.prefill_batch:
            raise ConfigError(f"sampling: kv_layout='paged' prefills every prompt up front; set prefill_batch = 0 "
                              f"(got {self.prefill_batch})")

    def filters(self) -> Filters:
        """Which filters are on (temperature 0 or `greedy` turns them all off)."""
        try:
            return make_filters(self.temperature, self.top_k, self.top_p, self.min_p, self.greedy)
        except ConfigError as err:
            raise ConfigError(f"sampling: {err}") from None

    def static(self) -> StaticControls:
        return StaticControls(filters=self.filters(), eos_ids=self.eos_ids or (),
                              stop_sequences=self.stop_sequences, pad_id=self.pad_id or 0,
                              logits_processor=self.logits_processor, batch_invariant=self.batch_invariant,
                              decode_phases=self.decode_phases or default_decode_phases(),
                              draw=default_draw() if self.draw == "auto" else self.draw,
                              record_routes=self.record_routes, decode_chunk=self.decode_chunk, kv_dtype=self.kv_dtype,
                              prefill_chunk=self.prefill_chunk)

    def scalars(self) -> tuple[np.float32, np.float32, np.float32]:
        """(temperature, top_p, min_p) as traced values; greedy ignores them."""
        return np.float32(self.temperature or 1.0), np.float32(self.top_p), np.float32(self.min_p)

    def replace(self, **changes) -> SampleControls:
        """A copy with `changes` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def greedy_version(self, num_samples: int = 1) -> SampleControls:
        """The same limits and stops with greedy decoding (evaluation, ReMax's baseline rollout)."""
        return self.replace(greedy=True, num_samples=num_samples)

    def with_tokenizer(self, tokenizer, extra_eos_ids: Sequence[int] = ()) -> SampleControls:
        """Fills the unset `eos_ids` (the tokenizer's, then `extra_eos_ids`) and `pad_id`."""
        eos = self.eos_ids
        if eos is None:
            eos = tuple(dict.fromkeys([*tokenizer.eos_ids, *extra_eos_ids]))
        return self.replace(eos_ids=eos, pad_id=tokenizer.pad_id if self.pad_id is None else self.pad_id)
