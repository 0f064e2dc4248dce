"""A griffe extension for the docs site (mkdocs.yml): the docstrings' Sphinx roles
(:class:`Result`, :meth:`start`, :mod:`tandem.latency`, …) rendered as code, as their
double-backquoted names already are."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|meth|func|mod|data|attr|exc|obj):`~?([^`]+)`")


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(r"`\1`", obj.docstring.value)
