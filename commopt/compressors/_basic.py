"""Dense baselines: identity and low-precision casts."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from commopt._src import base
from commopt.compressors._registry import register

_CAST_DTYPES = ("bfloat16", "float16", "float32")


def identity() -> base.Compressor:
  """The dense baseline: the payload is the input itself.

  Returns:
    A linear :class:`~commopt.Compressor`; ``compressed_mean(identity(), axis_name=axis)``
    is a plain ``pmean``.

  Examples:
    >>> import jax.numpy as jnp, commopt
    >>> c = commopt.compressors.identity()
    >>> payload, _ = c.encode(jnp.ones(3), c.init(jnp.ones(3)), None)
    >>> c.decode(payload, None, jnp.ones(3)).tolist()
    [1.0, 1.0, 1.0]
  """
  return base.Compressor(
      name="identity",
      init=base.stateless_init,
      encode=lambda x, state, key: (x, state),
      decode=lambda payload, state, like: payload.astype(like.dtype),
      payload_bits=lambda shape, dtype: base.leaf_size(shape) * base.dtype_bits(dtype),
      linear=True,
      error_kind="lossless",
  )


def cast(dtype="bfloat16") -> base.Compressor:
  """Sends every coordinate in a lower-precision float format.

  Args:
    dtype: the wire format, one of ``bfloat16``, ``float16``, ``float32``.

  Returns:
    A linear :class:`~commopt.Compressor` whose payload is summed in ``dtype``
    by the all-reduce.

  Examples:
    >>> import jax.numpy as jnp, commopt
    >>> c = commopt.cast("bfloat16")
    >>> payload, _ = c.encode(jnp.ones(4), c.init(jnp.ones(4)), None)
    >>> str(payload.dtype)
    'bfloat16'

  References:
    Micikevicius et al., Mixed Precision Training, ICLR 2018.
  """
  try:
    wire = None if dtype is None else jnp.dtype(dtype)
  except TypeError:
    wire = None
  if wire is None:
    raise base.OptionTypeError(
        f"cast: `dtype` must be one of {_CAST_DTYPES} (a name or a dtype), got {dtype!r} "
        f"({type(dtype).__name__}); pass e.g. 'bfloat16'.")
  if wire.name not in _CAST_DTYPES:
    raise ValueError(
        f"cast: `dtype` must be one of {_CAST_DTYPES}, got {dtype!r}.")
  bits = int(np.dtype(wire).itemsize * 8)
  if wire == jnp.float16:
    # float16's range is narrower than float32's: values below 2^-24 become 0 and
    # values above 65504 infinite, so no relative bound holds (error feedback keeps
    # what underflows).
    error = dict(error_kind="biased")
  else:
    # bfloat16 keeps float32's range: rounding to nearest moves each value by at most
    # eps/2 of itself.
    error = dict(error_kind="rounding",
                 error_bound=lambda shape: 1.0 - (float(jnp.finfo(wire).eps) / 2) ** 2)
  return base.Compressor(
      name=f"cast({wire.name})",
      init=base.stateless_init,
      encode=lambda x, state, key: (x.astype(wire), state),
      decode=lambda payload, state, like: payload.astype(like.dtype),
      payload_bits=lambda shape, in_dtype: base.leaf_size(shape) * bits,
      linear=True,
      **error,
  )


register("identity", identity)
register("cast", cast, {"dtype": "bfloat16"}, variants=({"dtype": "float16"},))
