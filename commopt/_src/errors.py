"""The exception types of commopt's argument checks (re-exported by ``base`` and ``commopt``)."""


class AxisNameError(NameError, ValueError):
  """A reduction asked for a mesh axis that is not bound where it runs.

  A ``NameError``, as JAX's own unbound-axis error is, and a ``ValueError``
  like every other bad argument of commopt. The message names the transform,
  the axis it asked for and the axes bound there.
  """


class OptionTypeError(TypeError, ValueError):
  """An option of the wrong type: a string or a bool where a number belongs, a
  float where an integer does, anything but ``True``/``False`` where a bool does.

  A ``TypeError``, and a ``ValueError`` like every other bad argument of
  commopt, so ``except ValueError`` around a factory catches both kinds.

  Examples:
    >>> import commopt
    >>> try:
    ...   commopt.int_quant(bits=8.0)
    ... except TypeError as e:
    ...   print(e)
    int_quant: `bits` must be 4 or 8, got 8.0 (float); pass 8 (an int).
  """


class WireSizeWarning(UserWarning):
  """A collective will cross the wire larger than its payload: e.g. XLA:CPU widening a
  16-bit all-reduce to float32 between processes. Filter it with
  ``warnings.filterwarnings("ignore", category=commopt.WireSizeWarning)``."""
