"""Parameter trees: which leaves are placeholders, and which leaves are compressed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from commopt._src import base, vma

DEFAULT_MIN_SIZE = 1024
"""Leaves with fewer elements than this are sent dense by default."""


def is_node(x) -> bool:
  """A placeholder leaf: ``None`` (a frozen or absent parameter) or ``optax.MaskedNode``."""
  return x is None or isinstance(x, optax.MaskedNode)


def flatten(tree):
  """``tree_flatten_with_path`` that keeps placeholders (:func:`is_node`) as leaves."""
  return jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_node)


def compresses(compressor: base.Compressor, shape, dtype, min_size: int,
               size: int | None = None) -> bool:
  """Whether a leaf goes through ``compressor`` (else it is sent dense).

  The one rule for every reduction: at least ``max(min_size, 1)`` elements,
  and a shape and dtype the compressor accepts. ``size`` is the whole leaf's
  element count where ``shape`` is one device's shard of it (the leaf is
  judged whole, its shard by the compressor).
  """
  size = base.leaf_size(shape) if size is None else size
  return size >= max(min_size, 1) and bool(compressor.accepts(tuple(shape), dtype))


def concat_flat(parts: list) -> jax.Array:
  """``jnp.concatenate(parts, axis=-1)`` of ``parts`` of one dtype and equal leading
  dimensions, each written into its place in one buffer (``dynamic_update_slice``).
  XLA:CPU runs that as in-place copies, and a concatenation as one loop that picks an
  operand per element, so a large leaf costs a plain copy here instead of a per-element
  choice among the parts."""
  if len(parts) == 1:
    return parts[0]
  lead = parts[0].shape[:-1]
  axes = frozenset().union(*(vma.varying_axes(p) for p in parts))
  out = vma.vary(jnp.zeros(lead + (sum(p.shape[-1] for p in parts),), parts[0].dtype),
                 tuple(sorted(axes)))
  at = 0
  for p in parts:
    out = jax.lax.dynamic_update_slice(out, p, (0,) * len(lead) + (at,))
    at += p.shape[-1]
  return out
