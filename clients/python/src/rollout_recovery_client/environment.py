"""The environment variables a configuration reads, sent with it by default.

The service resolves ``${oc.env:NAME}`` and ``${oc.env:NAME,default}`` itself, from the
``environment`` a collector sends (it never reads its own). A variable left out takes its
default, so a changed value would go unnoticed: a resume after ``NG_REVIEW_PROMPT`` changed
would be reused. :func:`referenced_environment` collects every variable the configuration
names, with its value in this process, as a Python collector resolving the same tree would
read it. Credential-named variables (``OPENAI_API_KEY``, ``HF_TOKEN``) are never sent: the
service redacts their references before resolving, so their values are never needed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["is_credential_name", "referenced_environment"]

# `${oc.env:NAME` (NAME maybe quoted); NAME ends at the default's comma or the brace. Whether
# it is escaped (`\${`) is decided by the backslashes before it (see `_live_names`).
_ENV_REFERENCE = re.compile(r"\$\{\s*oc\.env\s*:\s*(['\"]?)([^,}'\"\s]+)\1")
# The service's credential-name rule (decisions §3), case-insensitive, anywhere in the name.
_CREDENTIAL_NAME = re.compile(
    r"api_?key|secret|passw(or)?d|credential|private_?key|access_?key|cookie|authorization"
    r"|(^|[_-])token$|^x-api-key$",
    re.IGNORECASE,
)
# Text the service redacts before resolving (decisions §3), where a reference's value is never
# needed: `Bearer x` / `Basic x`, `NAME=value` with a credential-named NAME, a URL's password.
_REDACTED_TEXT = (
    re.compile(r"\b(?:Bearer|Basic)\s+\S+", re.IGNORECASE),
    re.compile(r"([A-Za-z0-9_.-]+)=\S*"),
    re.compile(r"://[^/@\s]*:[^@\s]*@"),
)


def is_credential_name(name: str) -> bool:
    """Whether the service treats ``name`` as credential-named (its values are redacted)."""
    return _CREDENTIAL_NAME.search(name) is not None


def _without_redacted_text(text: str) -> str:
    bearer, assignment, password = _REDACTED_TEXT
    text = bearer.sub("", text)
    text = assignment.sub(lambda m: "" if is_credential_name(m.group(1)) else m.group(0), text)
    return password.sub("://@", text)


def _live_names(text: str) -> set[str]:
    """Names of the references in ``text`` that OmegaConf resolves: one after an odd number of
    backslashes is escaped (``\\${`` is a backslash, then a live reference)."""
    names = set()
    for match in _ENV_REFERENCE.finditer(_without_redacted_text(text)):
        before = match.string[: match.start()]
        backslashes = len(before) - len(before.rstrip("\\"))
        if backslashes % 2 == 0:
            names.add(match.group(2))
    return names


def _names(value: Any, found: set[str]) -> None:
    """Every live reference's name in ``value``, except where the service redacts before it
    resolves: below a credential-named key or a ``secrets`` mapping, the ``value`` of a
    ``{name, value}`` entry whose name is credential-named, and redacted text."""
    if isinstance(value, str):
        found.update(_live_names(value))
    elif isinstance(value, Mapping):
        named = value.get("name")
        if isinstance(named, str) and "value" in value and is_credential_name(named):
            value = {k: v for k, v in value.items() if k != "value"}
        for key, item in value.items():
            if isinstance(key, str) and (is_credential_name(key) or key == "secrets"):
                continue
            _names(item, found)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _names(item, found)


def referenced_environment(*trees: Any, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables ``${oc.env:...}`` references in ``trees`` name, with their values in
    ``environ`` (this process's environment by default); unset and credential-named ones, and
    references the service redacts before resolving (below credential-named keys, in
    ``Bearer ...``, a URL's password), are left out."""
    source = os.environ if environ is None else environ
    names: set[str] = set()
    for tree in trees:
        _names(tree, names)
    return {
        name: source[name]
        for name in sorted(names)
        if name in source and not is_credential_name(name)
    }
