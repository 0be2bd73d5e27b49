"""A griffe extension for the API reference: fpipe's docstrings cite code the Sphinx way
(:func:`bind_grads`, ``x``, ``text::`` before a literal block); the site renders Markdown, so
a role becomes inline code linked to the object's entry, and ``::`` a colon before the
indented block.

A role's target is resolved as Sphinx would: a full name (``fpipe.optim.bind_grads``), else a
name in the scope of the object, its class or its module; a re-export (``fpipe.Pipeline``)
is followed to where the object is defined, which is where the reference documents it; a
function a module of its name shadows (``:func:`fpipe.pipeline```) is that module's. The
link is an *optional* cross-reference (mkdocs-autorefs): a target the reference has no entry
for (a private helper, torch's own) stays inline code, never a broken link or a warning."""

from __future__ import annotations

import html
import re

import griffe

ROLE = re.compile(r":(?:py:)?(func|class|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def resolve(obj: griffe.Object, name: str, role: str = "obj") -> str:
    """The path where ``name``, cited in ``obj``'s docstring, is defined (else ``name``)."""
    scopes = [""] if name.startswith("fpipe") else [
        f"{scope.path}." for scope in (obj, obj.parent, obj.module) if scope is not None]
    for scope in scopes:
        try:
            found = obj.modules_collection[f"{scope}{name}"]
        except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            continue
        while isinstance(found, griffe.Alias):
            try:
                found = found.target
            except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                return found.target_path
        last = name.rsplit(".", 1)[-1]
        if role != "mod" and isinstance(found, griffe.Module) and last in found.members:
            return resolve(found, last, role)
        return found.path
    return name


def link(obj: griffe.Object, match: re.Match) -> str:
    role, short, name = match.groups()
    shown = name.rsplit(".", 1)[-1] if short else name
    target = html.escape(resolve(obj, name, role), quote=True)
    return f'<autoref identifier="{target}" optional><code>{html.escape(shown)}</code></autoref>'


def rewrite(obj: griffe.Object) -> None:
    if obj.docstring is not None:
        text = ROLE.sub(lambda m: link(obj, m), obj.docstring.value)
        obj.docstring.value = re.sub(r"(\S)::\n", r"\1:\n", text)
    for member in obj.members.values():
        if not isinstance(member, griffe.Alias):
            rewrite(member)


class SphinxRoles(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        """Once the whole package is loaded, so that every target can be found."""
        rewrite(pkg)
