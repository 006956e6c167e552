"""The global model a synchronisation mode's state holds."""

from __future__ import annotations

import jax

from commopt.transforms._sync._diloco import PeriodicState
from commopt.transforms._sync._easgd import EASGDState
from commopt.transforms._sync._local_sgd import HierarchicalLocalSGDState
from commopt.transforms._sync._stale import StaleState
from commopt.transforms._sync._streaming_diloco import StreamingDiLoCoState

def global_params(opt_state):
  """The global model a synchronisation mode holds in ``opt_state``.

  Between synchronisations the workers' parameters differ; the model to
  evaluate or ship is the mode's own: the anchor of :func:`diloco`,
  :func:`local_sgd` and :func:`streaming_diloco` (the all-worker anchor of a
  hierarchical ``local_sgd``), the centre of :func:`easgd`, the server's
  parameters of :func:`stale`. ``opt_state`` may be the whole state of a
  chain (or of :func:`~commopt.data_parallel`) holding one of these.

  Raises:
    ValueError: when ``opt_state`` holds no synchronisation mode's state.

  Examples:
    >>> import jax.numpy as jnp, optax, commopt
    >>> tx = commopt.local_sgd(optax.sgd(0.1), axis_name="data", period=4)
    >>> state = tx.init({"w": jnp.ones(3)})
    >>> commopt.transforms.global_params(state)["w"].tolist()
    [1.0, 1.0, 1.0]
  """
  fields = {PeriodicState: lambda s: s.anchor, StreamingDiLoCoState: lambda s: s.anchor,
            EASGDState: lambda s: s.centre, StaleState: lambda s: s.params,
            HierarchicalLocalSGDState: lambda s: s.anchors[-1]}
  kinds = tuple(fields)
  for node in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kinds)):
    if isinstance(node, kinds):
      return fields[type(node)](node)
  raise ValueError("global_params: `opt_state` holds no synchronisation mode's state "
                   "(local_sgd, diloco, streaming_diloco, easgd or stale); with every-step "
                   "synchronisation the parameters themselves are the global model.")
