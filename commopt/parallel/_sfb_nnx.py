"""An nnx dense layer whose kernel gradient can travel as sufficient factors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from commopt.transforms._sfb import sfb_dense


class SFBKernel(nnx.Param):
  """The kernel of an :class:`SFBLinear`: a parameter :func:`sfb_mask` marks."""


class SFBLinear(nnx.Module):
  """``nnx.Linear`` through :func:`~commopt.transforms.sfb_dense`.

  Its kernel's gradient is the pair of sufficient factors (the layer's input
  and output gradient) wherever ``rows·(in + out) < in·out`` for the rows of
  the batch it is called on, and the usual ``xᵀ dy`` elsewhere;
  :func:`~commopt.transforms.sfb_mean` sends the factors and rebuilds the
  exact mean gradient. Call it once per step (the factors of two calls
  would add up in one buffer).

  Args:
    in_features: ``n``.
    out_features: ``m``.
    use_bias: add a bias (sent as usual: it is small).
    rngs: the nnx RNG streams (``params`` initialises the kernel).
    kernel_init: the kernel's initializer (default: nnx.Linear's).
    bias_init: the bias's initializer (default: zeros).
    param_dtype: the parameters' dtype.

  Examples:
    >>> import jax.numpy as jnp, commopt
    >>> from flax import nnx
    >>> layer = commopt.parallel.SFBLinear(8, 4, rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((2, 8))).shape
    (2, 4)
    >>> _, params = nnx.split(layer, nnx.Param)
    >>> mask = commopt.parallel.sfb_mask(params)
    >>> mask["kernel"].get_value(), mask["bias"].get_value()
    (True, False)

  References:
    Zhang et al., Poseidon: An Efficient Communication Architecture for
    Distributed Deep Learning on GPU Clusters, USENIX ATC 2017.
  """

  def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
               rngs: nnx.Rngs, kernel_init=nnx.initializers.lecun_normal(),
               bias_init=nnx.initializers.zeros_init(), param_dtype=jnp.float32):
    # The keys are drawn as nnx.Linear draws them, so both start from the same weights.
    self.kernel = SFBKernel(kernel_init(rngs.params(), (in_features, out_features), param_dtype))
    self.bias = (nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype)) if use_bias
                 else nnx.data(None))

  def __call__(self, x):
    y = sfb_dense(x, self.kernel[...])
    return y + self.bias[...] if self.bias is not None else y


def sfb_mask(state):
  """``state`` with each leaf replaced by True for :class:`SFBLinear` kernels, else False.

  ``state`` is an ``nnx.State`` of parameters (``nnx.state(model, nnx.Param)``,
  what :func:`commopt.nnx_data_parallel` splits off, or the gradients of
  either); the mask keeps its structure, as
  :func:`~commopt.transforms.sfb_mean` takes it. Pass the function itself as
  ``sfb_mean``'s ``mask`` and it is applied to the gradients it receives.
  """
  is_var = lambda v: isinstance(v, nnx.Variable)
  return jax.tree.map(lambda v: v.replace(isinstance(v, SFBKernel)) if is_var(v) else False,
                      state, is_leaf=is_var)
