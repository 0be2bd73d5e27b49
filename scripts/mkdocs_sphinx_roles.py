"""A griffe extension for the API reference: fpipe's docstrings cite code the Sphinx way
(:func:`bind_grads`, ``x``, ``text::`` before a literal block); the site renders Markdown, so
roles become inline code and ``::`` a colon before the indented block."""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):`~?([^`]+)`")


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            text = ROLE.sub(r"`\1`", obj.docstring.value)
            obj.docstring.value = re.sub(r"(\S)::\n", r"\1:\n", text)
