"""Compressors by name, for command lines, benchmarks and the shared test suite."""

from __future__ import annotations

import inspect
from typing import Callable, Optional

from commopt._src import base
from commopt.compressors._basic import cast, identity
from commopt.compressors._lowrank import power_sgd
from commopt.compressors._quantize import (
    adaptive_levels,
    int_quant,
    natural,
    onebit,
    qsgd,
    scaled_sign,
    sign,
    terngrad,
)
from commopt.compressors._sparsify import (
    adacomp,
    gradient_dropping,
    random_k,
    threshold,
    top_k,
    variance_balanced,
)

REGISTRY: dict[str, Callable[..., base.Compressor]] = {
    "identity": identity,
    "cast": cast,
    "scaled_sign": scaled_sign,
    "sign": sign,
    "onebit": onebit,
    "terngrad": terngrad,
    "qsgd": qsgd,
    "natural": natural,
    "int_quant": int_quant,
    "adaptive_levels": adaptive_levels,
    "top_k": top_k,
    "random_k": random_k,
    "threshold": threshold,
    "gradient_dropping": gradient_dropping,
    "adacomp": adacomp,
    "variance_balanced": variance_balanced,
    "power_sgd": power_sgd,
}
"""Every compressor factory, by name."""

DEFAULTS: dict[str, dict] = {
    "identity": {},
    "cast": {"dtype": "bfloat16"},
    "scaled_sign": {},
    "sign": {},
    "onebit": {},
    "terngrad": {"clip": 2.5},
    "qsgd": {"levels": 7, "bucket_size": 512},
    "natural": {},
    "int_quant": {"bits": 8, "block_size": 256, "rounding": "stochastic"},
    "adaptive_levels": {"levels": 16},
    "top_k": {"ratio": 0.01},
    "random_k": {"ratio": 0.01},
    "threshold": {"tau": 1e-3, "capacity": 0.01},
    "gradient_dropping": {"drop_ratio": 0.99},
    "adacomp": {"bin_size": 50},
    "variance_balanced": {"ratio": 0.01},
    "power_sgd": {"rank": 2},
}
"""The options :func:`make` uses when none are given."""


_EXCLUSIVE = {"top_k": {"ratio", "k"}, "random_k": {"ratio", "k"},
              "variance_balanced": {"ratio", "k"}}


def register(name: str, factory: Callable[..., base.Compressor],
             defaults: Optional[dict] = None, *, replace: bool = False) -> None:
  """Adds a compressor factory to :data:`REGISTRY` under ``name``.

  Registered compressors are built by :func:`make`, take part in the demo's
  ``--compressors`` and in :mod:`commopt.testing.checks` suites that run over
  the registry.

  Args:
    name: the registry key.
    factory: a function returning a :class:`~commopt.Compressor`.
    defaults: the options :func:`make` uses when none are given (default none).
    replace: allow replacing an existing entry (else a taken name is refused).

  Example:
    >>> import commopt
    >>> commopt.compressors.register("half", lambda: commopt.compressors.cast("bfloat16"))
    >>> commopt.compressors.make("half")
    Compressor(cast(bfloat16))
    >>> commopt.compressors.unregister("half")
  """
  if not isinstance(name, str) or not name:
    raise TypeError(f"register: `name` must be a non-empty str, got {name!r}.")
  if not callable(factory):
    raise TypeError(f"register: `factory` must be callable, got {factory!r}.")
  if name in REGISTRY and not replace:
    raise ValueError(
        f"register: a compressor named {name!r} is already registered; pass replace=True "
        "to replace it.")
  defaults = dict(defaults or {})
  unknown = sorted(set(defaults) - set(inspect.signature(factory).parameters))
  if unknown:
    raise ValueError(f"register: `defaults` names options {unknown} that {name!r}'s factory "
                     "does not take.")
  REGISTRY[name] = factory
  DEFAULTS[name] = defaults


def unregister(name: str) -> None:
  """Removes ``name`` from :data:`REGISTRY` (see :func:`register`)."""
  _check_name(name)
  del REGISTRY[name]
  DEFAULTS.pop(name, None)


def options(name: str) -> tuple[str, ...]:
  """The options the factory of compressor ``name`` takes.

  Example:
    >>> import commopt
    >>> commopt.compressors.options("power_sgd")
    ('rank', 'view', 'min_compression_rate', 'seed')
  """
  _check_name(name)
  return tuple(inspect.signature(REGISTRY[name]).parameters)


def _check_name(name: str) -> None:
  if name not in REGISTRY:
    raise ValueError(f"make: unknown compressor {name!r}; valid names are {sorted(REGISTRY)}.")


def make(name: str, **options_) -> base.Compressor:
  """Builds a registered compressor from :data:`DEFAULTS` and the options given.

  Args:
    name: a key of :data:`REGISTRY`.
    **options_: factory options (e.g. ``ratio=0.01``, ``rank=4``); ``None``
      values fall back to :data:`DEFAULTS`. An option the factory does not
      take is refused (see :func:`options`), so a misspelt option cannot
      silently fall back to its default.

  Example:
    >>> import commopt
    >>> commopt.compressors.make("top_k", ratio=0.05)
    Compressor(top_k(ratio=0.05))
  """
  _check_name(name)
  factory = REGISTRY[name]
  accepted = options(name)
  unknown = sorted(set(options_) - set(accepted))
  if unknown:
    raise ValueError(
        f"make: compressor {name!r} takes no option {', '.join(map(repr, unknown))}; "
        f"its options are {list(accepted)}.")
  given = {k for k, v in options_.items() if v is not None}
  # Defaults that exclude a given option (top_k's ratio against k) are dropped.
  kwargs = {k: v for k, v in DEFAULTS[name].items()
            if not (given & _EXCLUSIVE.get(name, set()) - {k})}
  kwargs.update({k: v for k, v in options_.items() if v is not None})
  return factory(**kwargs)
