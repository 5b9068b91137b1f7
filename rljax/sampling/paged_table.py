"""The paged KV layout's page table (`rljax.sampling.paged`): who holds which page, and the free
stack pages are popped from and pushed back to (fixed-size scatters, so they run inside the
decode loop). Reference counts share a prompt's full pages among its running samples."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class PageTable:
    """Who holds which page (small; the page contents live in `PagedState.kv`)."""

    table_sk: jax.Array  # [S, max pages per row] physical page of each logical page
    shared_s: jax.Array  # leading logical pages shared with the row's prompt group (full prompt pages)
    held_s: jax.Array  # logical pages the slot holds (shared + its own)
    prompt_s: jax.Array  # the slot's prompt (G when idle)
    prompt_len_s: jax.Array  # its real prompt length
    order_s: jax.Array  # admission number of the slot's row (preemption takes the largest)
    group_pages_gk: jax.Array  # [G, prompt pages] shared full prompt pages of each prompt
    refs_g: jax.Array  # running rows of each prompt
    stack_p: jax.Array  # free pages in stack_p[:free]
    free: jax.Array
    admitted: jax.Array  # admissions so far (re-admissions included)
    peak: jax.Array  # the most pages in use at once
    preemptions: jax.Array


def push_pages(pt: PageTable, page_x, keep_x) -> PageTable:
    """Returns the pages `page_x` where `keep_x` to the free stack."""
    page_x, keep_x = page_x.reshape(-1), keep_x.reshape(-1)
    at = jnp.where(keep_x, pt.free + jnp.cumsum(keep_x, dtype=jnp.int32) - 1, pt.stack_p.shape[0])
    return pt.replace(stack_p=pt.stack_p.at[at].set(page_x, mode="drop"),
                      free=pt.free + jnp.sum(keep_x, dtype=jnp.int32))


def pop_pages(pt: PageTable, want_xk) -> tuple[jax.Array, PageTable]:
    """Pops one page for every True of `want_xk`, in row-major order (the caller checked there
    are enough); entries that want none get an arbitrary page."""
    rank = jnp.cumsum(want_xk.reshape(-1), dtype=jnp.int32).reshape(want_xk.shape) - 1
    page_xk = pt.stack_p[jnp.clip(pt.free - 1 - rank, 0, pt.stack_p.shape[0] - 1)]
    free = pt.free - jnp.sum(want_xk, dtype=jnp.int32)
    return page_xk, pt.replace(free=free, peak=jnp.maximum(pt.peak, pt.stack_p.shape[0] - free))


def release_pages(pt: PageTable, out_s, shared_pages_g) -> PageTable:
    """Slots `out_s` give back their own pages, and their prompt's shared pages when they were its
    last running rows (`shared_pages_g`: full pages of each prompt)."""
    groups, k_prompt = pt.group_pages_gk.shape
    k = jnp.arange(pt.table_sk.shape[1])
    own_sk = out_s[:, None] & (k >= pt.shared_s[:, None]) & (k < pt.held_s[:, None])
    pt = push_pages(pt, pt.table_sk, own_sk)
    refs = pt.refs_g.at[jnp.where(out_s, pt.prompt_s, groups)].add(-1, mode="drop")
    gone_g = (pt.refs_g > 0) & (refs == 0)
    pt = push_pages(pt, pt.group_pages_gk, gone_g[:, None] & (jnp.arange(k_prompt) < shared_pages_g[:, None]))
    zero = lambda x: jnp.where(out_s, 0, x)
    return pt.replace(refs_g=refs, shared_s=zero(pt.shared_s), held_s=zero(pt.held_s),
                      prompt_s=jnp.where(out_s, groups, pt.prompt_s))
