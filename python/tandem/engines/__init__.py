"""Execution engines. ``get(name)`` returns the engine a ``Job.run(engine=name)`` uses.

* ``local`` (the default): one OS process per replica on this machine, TCP on 127.0.0.1.
"""

from __future__ import annotations

from typing import Any

from tandem.exceptions import ConfigError

ENGINES = ("local",)


def get(name: str) -> Any:
    """The engine called ``name``."""
    if name == "local":
        from tandem.engines.local import LocalEngine

        return LocalEngine()
    raise ConfigError(f"unknown engine {name!r}; available engines: {list(ENGINES)}")


__all__ = ["ENGINES", "get"]
