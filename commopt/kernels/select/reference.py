"""The pure-jnp reference of magnitude top-k, and the sort key the kernel shares.

Ordering rule (both implementations): coordinates are ranked by the key
``bits(float32(x)) & 0x7FFFFFFF``, the bit pattern of ``|x|``, which orders
every finite magnitude and ``inf`` as the floats do, ranks every NaN above
``inf`` (NaNs among themselves by payload), and makes ``-0.0`` tie with
``0.0``. Ties are broken by index: the lower index wins. The ``k`` selected
coordinates are returned in ascending index order, the one order every
implementation produces (and the one a payload carries).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_U32 = jnp.uint32
_I32 = jnp.int32


def magnitude_key(x: jax.Array) -> jax.Array:
  """The uint32 sort key of ``|x|``: its float32 bit pattern with the sign bit cleared.

  Args:
    x: a floating-point array.

  Returns:
    A uint32 array of the same shape; larger key means larger magnitude,
    NaN above ``inf``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from commopt.kernels import magnitude_key
    >>> [hex(v) for v in magnitude_key(jnp.array([-1.0, jnp.inf, jnp.nan])).tolist()]
    ['0x3f800000', '0x7f800000', '0x7fc00000']
  """
  bits = lax.bitcast_convert_type(x.astype(jnp.float32), _U32)
  return bits & np.uint32(0x7FFFFFFF)


def select_top_k(flat: jax.Array, k: int, approx: bool, recall_target: float):
  """``(values, indices)`` of the ``k`` largest keys, indices ascending (arguments checked).

  ``lax.top_k`` on the key (viewed as float32; lower index first among
  ties), or with
  ``approx`` on a TPU ``lax.approx_max_k``; then the ``k`` indices sorted.
  """
  key = magnitude_key(flat)
  if approx and jax.default_backend() == "tpu":
    chosen = lax.approx_max_k(lax.bitcast_convert_type(key, jnp.float32), k,
                              recall_target=float(recall_target))[1]
  else:
    # The key viewed as float32: sign-cleared bit patterns order as their
    # integers do (NaN payloads above inf), and XLA:CPU runs a float32 top_k
    # through its own top-k routine, far faster than the sort an int32 one
    # becomes.
    chosen = lax.top_k(lax.bitcast_convert_type(key, jnp.float32), k)[1]
  indices = jnp.sort(chosen.astype(_I32))
  return flat[indices], indices
