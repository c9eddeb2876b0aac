"""Measured activation memory: the bytes a forward context holds for backward.

A context (what `Module.forward` returns beside its output) is a nest of
tuples, lists and dicts whose leaves are arrays or small Python values.
Several leaves are often views of one buffer (q, k and v are strided views
of one fused projection), so memory is counted by address, not by array:

    bytes(ctx) = | union over arrays a in ctx of [lo(a), hi(a)) |

where [lo, hi) is the byte span an array's elements occupy (its data
pointer plus the extent of its strides). Views of one buffer overlap and
count once; a slice of a larger buffer counts only the span it reaches.
NumPy and CuPy arrays both expose their pointer (`__array_interface__`,
`__cuda_array_interface__`). `dtlab.models.cost` predicts the same figure from the
configuration, and tests/models/test_cost.py checks that they agree.
"""

from __future__ import annotations


def _span(a) -> tuple[int, int]:
    """[lo, hi) byte addresses spanned by the elements of array `a`."""
    iface = getattr(a, "__array_interface__", None) or a.__cuda_array_interface__
    lo = hi = iface["data"][0]
    for n, stride in zip(a.shape, a.strides, strict=True):
        reach = (n - 1) * stride
        lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
    return lo, hi + a.itemsize


def _arrays(ctx):
    stack = [ctx]
    while stack:
        node = stack.pop()
        if isinstance(node, (tuple, list)):
            stack.extend(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif hasattr(node, "strides") and getattr(node, "size", 0) > 0:
            yield node


def context_bytes(ctx) -> int:
    """Bytes of memory held by the arrays reachable from `ctx`, overlaps counted once."""
    total, end = 0, None
    for lo, hi in sorted(_span(a) for a in _arrays(ctx)):
        if end is None or lo >= end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total
