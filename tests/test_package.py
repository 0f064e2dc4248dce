"""The package surface: version, build profile, the exception tree."""

import pytest

import tandem
from tandem import _core


def test_version_and_build_profile_are_exported():
    assert tandem.__version__ == _core.__version__
    assert tandem.__version__.count(".") == 2
    assert tandem.build_profile in {"release", "debug"}


@pytest.mark.parametrize(
    ("name", "parent"),
    [
        ("ConfigError", "TandemError"),
        ("ProtocolError", "TandemError"),
        ("AuthenticationError", "ProtocolError"),
        ("ChannelClosed", "TandemError"),
        ("InputStarved", "TandemError"),
        ("DeterminismError", "TandemError"),
        ("ServiceUnavailable", "TandemError"),
        ("TaskFailed", "TandemError"),
    ],
)
def test_exception_tree(name, parent):
    cls = getattr(tandem, name)
    assert issubclass(cls, getattr(tandem, parent))
    assert issubclass(cls, tandem.TandemError)
    assert issubclass(tandem.TandemError, Exception)
    assert cls is getattr(tandem.exceptions, name)
