"""Compressors by name, for command lines, benchmarks and the shared test suite.

Each family module registers its factories beside them, in one line each
(:func:`register`), with the options :func:`make` uses by default and the
variants the shared suite runs besides.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional

from commopt._src import base

REGISTRY: dict[str, Callable[..., base.Compressor]] = {}
"""Every compressor factory, by name; each family module registers its own."""

DEFAULTS: dict[str, dict] = {}
"""The options :func:`make` uses when none are given."""

VARIANTS: dict[str, tuple[dict, ...]] = {}
"""Option sets besides the defaults that the shared suite also runs, by name."""

_EXCLUSIVE: dict[str, set] = {}


def register(name: str, factory: Callable[..., base.Compressor],
             defaults: Optional[dict] = None, *, exclusive: tuple[str, ...] = (),
             variants: tuple[dict, ...] = (), replace: bool = False) -> None:
  """Adds a compressor factory to :data:`REGISTRY` under ``name``.

  Registered compressors are built by :func:`make`, take part in the demo's
  ``--compressors`` and in :mod:`commopt.testing.checks` suites that run over
  the registry.

  Args:
    name: the registry key.
    factory: a function returning a :class:`~commopt.Compressor`.
    defaults: the options :func:`make` uses when none are given (default none).
    exclusive: options that exclude one another (``("ratio", "k")``): giving
      one to :func:`make` drops the others' defaults.
    variants: option sets besides the defaults (each completed by the
      defaults, as :func:`make` does) that the shared suite also runs.
    replace: allow replacing an existing entry (else a taken name is refused).

  Examples:
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
  accepted = set(inspect.signature(factory).parameters)
  for what, names in (("defaults", set(defaults)), ("exclusive", set(exclusive)),
                      *(("variants", set(v)) for v in variants)):
    unknown = sorted(names - accepted)
    if unknown:
      raise ValueError(f"register: `{what}` names options {unknown} that {name!r}'s factory "
                       "does not take.")
  REGISTRY[name] = factory
  DEFAULTS[name] = defaults
  VARIANTS[name] = tuple(dict(v) for v in variants)
  if exclusive:
    _EXCLUSIVE[name] = set(exclusive)


def unregister(name: str) -> None:
  """Removes ``name`` from :data:`REGISTRY` (see :func:`register`)."""
  _check_name(name)
  del REGISTRY[name]
  DEFAULTS.pop(name, None)
  VARIANTS.pop(name, None)
  _EXCLUSIVE.pop(name, None)


def options(name: str) -> tuple[str, ...]:
  """The options the factory of compressor ``name`` takes.

  Examples:
    >>> import commopt
    >>> commopt.compressors.options("power_sgd")[:4]
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

  Examples:
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
