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

# `${oc.env:NAME` not escaped as `\${`; NAME ends at the default's comma or the brace.
_ENV_REFERENCE = re.compile(r"(?<!\\)\$\{\s*oc\.env\s*:\s*([^,}\s]+)")
# The service's credential-name rule (decisions §3), case-insensitive, anywhere in the name.
_CREDENTIAL_NAME = re.compile(
    r"api_?key|secret|passw(or)?d|credential|private_?key|access_?key|cookie|authorization"
    r"|(^|[_-])token$|^x-api-key$",
    re.IGNORECASE,
)


def is_credential_name(name: str) -> bool:
    """Whether the service treats ``name`` as credential-named (its values are redacted)."""
    return _CREDENTIAL_NAME.search(name) is not None


def _names(value: Any, found: set[str]) -> None:
    if isinstance(value, str):
        found.update(m.group(1) for m in _ENV_REFERENCE.finditer(value))
    elif isinstance(value, Mapping):
        for item in value.values():
            _names(item, found)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _names(item, found)


def referenced_environment(*trees: Any, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables ``${oc.env:...}`` references in ``trees`` name, with their values in
    ``environ`` (this process's environment by default); unset and credential-named ones are
    left out."""
    source = os.environ if environ is None else environ
    names: set[str] = set()
    for tree in trees:
        _names(tree, names)
    return {
        name: source[name]
        for name in sorted(names)
        if name in source and not is_credential_name(name)
    }
