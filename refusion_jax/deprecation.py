"""Old public names kept working for a while: one warning, one way to forward them.

Public names are a promise. When one is renamed, the old spelling keeps
working until `REMOVED_IN`, and every use of it raises a `DeprecationWarning`
that names the replacement; CHANGELOG.md lists it under the release that
removes it. Two shapes cover every case:

    # a module attribute that was renamed or moved
    __getattr__ = moved_names(__name__, {"old_name": ("refusion_jax.module.new_name", lambda: new_name)})

    # a function whose call changed: the old body translates the call to the new one
    @deprecated(old="refusion_jax.old_call", new="refusion_jax.new_call(model, ids, refusion_jax.ReFusion(...))")
    def old_call(model, prompt_ids, **fields): ...

Nothing is deprecated in 0.3 (it removed what 0.2 deprecated); the next rename goes through here.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

# The release that removes every name deprecated through this module (the README says so).
REMOVED_IN = "0.4"

F = TypeVar("F", bound=Callable[..., Any])


def warn_deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
  """Warn that `old` is deprecated in favour of `new` (both as the user would spell them)."""
  warnings.warn(
    f"{old} is deprecated and will be removed in {REMOVED_IN}: use {new}.", DeprecationWarning, stacklevel=stacklevel
  )


def moved_names(module: str, moved: Mapping[str, tuple[str, Callable[[], Any]]]) -> Callable[[str], Any]:
  """A module-level `__getattr__` for renamed attributes.

  Args:
    module: the module's `__name__`.
    moved: old name -> (the replacement as the user should spell it, a thunk returning the object).
  """

  def __getattr__(name: str) -> Any:
    if name in moved:
      new, value = moved[name]
      warn_deprecated(f"{module}.{name}", new)
      return value()
    raise AttributeError(f"module {module!r} has no attribute {name!r}")

  return __getattr__


def deprecated(*, old: str, new: str) -> Callable[[F], F]:
  """Decorate an old function (whose body translates the old call) to warn, on every call, that `old` is `new` now."""

  def decorate(function: F) -> F:
    @functools.wraps(function)
    def forward(*args: Any, **kwargs: Any) -> Any:
      warn_deprecated(old, new)
      return function(*args, **kwargs)

    return forward  # type: ignore[return-value]

  return decorate
