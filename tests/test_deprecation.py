"""refusion_jax/deprecation.py: a renamed public name keeps working until `REMOVED_IN`, warning with its
replacement, from the caller's line."""

import types

import pytest

from refusion_jax import deprecation, versions


def test_a_moved_name_warns_naming_its_replacement_and_gives_the_new_object():
  new = object()
  module = types.ModuleType("pkg.mod")
  module.__getattr__ = deprecation.moved_names("pkg.mod", {"old_name": ("pkg.mod.new_name", lambda: new)})
  message = (
    rf"^pkg\.mod\.old_name is deprecated and will be removed in {deprecation.REMOVED_IN}: use pkg\.mod\.new_name\.$"
  )
  with pytest.warns(DeprecationWarning, match=message) as caught:
    assert module.old_name is new
  assert caught[0].filename == __file__  # the warning points at the line that used the old name
  with pytest.raises(AttributeError, match="module 'pkg.mod' has no attribute 'other_name'"):
    module.other_name  # noqa: B018  (the attribute access is what is tested)


def test_a_deprecated_call_warns_on_every_call_and_runs_the_old_body():
  @deprecation.deprecated(old="pkg.old_call", new="pkg.new_call(x)")
  def old_call(x: int, *, scale: int = 2) -> int:
    """The old body, translating the old call."""
    return x * scale

  message = r"^pkg\.old_call is deprecated .*: use pkg\.new_call\(x\)\.$"
  for _ in range(2):
    with pytest.warns(DeprecationWarning, match=message) as caught:
      assert old_call(3, scale=5) == 15
    assert caught[0].filename == __file__
  assert (old_call.__name__, old_call.__doc__) == ("old_call", "The old body, translating the old call.")


def test_what_is_deprecated_now_goes_in_the_next_release():
  """A release bump makes whoever bumps it look at what the next one removes (CHANGELOG.md lists it)."""
  major, minor, _ = versions.__version__.split(".")
  assert deprecation.REMOVED_IN == f"{major}.{int(minor) + 1}"
