"""Counting the operations of a lowered program (StableHLO text), calls expanded: how the tests
pin the kernel count of a decode step lowered for `cuda` on a host without a GPU (XLA's fusion
pass needs the GPU compiler, so the count is of lowered operations, each a kernel or a part of
one; a private function called from every layer counts once per call)."""

from __future__ import annotations

import collections
import re


def op_counts(text: str) -> collections.Counter:
    """{"stablehlo.<op>": count} over the module's `main`, every called function counted per call."""
    own, calls, cur = collections.defaultdict(collections.Counter), collections.defaultdict(list), None
    for line in text.splitlines():
        head = re.match(r"\s*func\.func (?:public |private )?@([\w$.-]+)", line)
        if head:
            cur = head.group(1)
            continue
        calls[cur].extend(re.findall(r"(?:func\.)?call @([\w$.-]+)", line))
        op = re.search(r"\b(stablehlo\.[a-z_]+)", line)
        if op and cur:
            own[cur][op.group(1)] += 1

    def total(fn):
        out = collections.Counter(own[fn])
        for callee in calls[fn]:
            out.update(total(callee))
        return out

    return total("main")


def per_layer(one_layer: collections.Counter, two_layers: collections.Counter) -> dict[str, int]:
    """What one more layer adds: {op without the dialect prefix: count} (zeros dropped)."""
    keys = set(one_layer) | set(two_layers)
    return {k.split(".", 1)[1]: two_layers[k] - one_layer[k] for k in sorted(keys) if two_layers[k] != one_layer[k]}
