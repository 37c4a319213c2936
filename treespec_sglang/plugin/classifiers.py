"""The server's C2T classifier registry: classifiers named by the operator, never by a client (no sglang import).

A server never opens a file path a request names. The operator registers classifiers by name at start
(``--treespec-classifier NAME=PATH``, repeatable, or ``configure(..., classifiers={NAME: PATH})``); both
end up in ``TREESPEC_CLASSIFIERS`` (a JSON object), which every spawned process inherits. ``default``
is always registered: the package's shipped classifier unless the operator maps ``default`` to a file.
Each process loads every registered file once, on first use (the plugin's ``register()`` does it at
start), and logs its content hash, so an operator can check that every rank loaded the same bytes.

A request picks one with ``{"policy": "c2t", "classifier": "NAME"}`` (``chain`` with ``beta`` too). Any
other value, a path included, is refused with the list of registered names: the same message whether
or not such a file exists, so a client cannot probe the server's file system.

``SpecEngine`` (a trusted Python caller) keeps taking a path or a module: this module is the plugin's.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
from typing import Dict, Mapping, Optional, Tuple

from .settings import env

__all__ = ["ENV_CLASSIFIERS", "DEFAULT_NAME", "parse_classifier_flags", "registered", "resolve_request_classifier",
           "classifier_digests", "load_registry"]

ENV_CLASSIFIERS = "TREESPEC_CLASSIFIERS"
DEFAULT_NAME = "default"
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")
logger = logging.getLogger("treespec_sglang.plugin")


def _check_name(name: str) -> None:
    if not name or len(name) > 64 or not set(name) <= _NAME_CHARS:
        raise ValueError(f"--treespec-classifier: a name is 1-64 characters of letters, digits, '_', '-', '.', "
                         f"got {name!r}")


def parse_classifier_flags(flags) -> Dict[str, str]:
    """``["fast=/srv/c2t.pt", ...]`` (``--treespec-classifier``, repeatable) -> ``{"fast": "/srv/c2t.pt"}``.

    Paths are made absolute and must be files (checked at start, with a message naming the flag).

    Examples
    --------
    >>> parse_classifier_flags([])
    {}
    """
    out: Dict[str, str] = {}
    for flag in flags or []:
        name, sep, path = str(flag).partition("=")
        if not sep or not path or not name:
            raise ValueError(f"--treespec-classifier must be NAME=PATH, got {flag!r}")
        _check_name(name)
        if name in out:
            raise ValueError(f"--treespec-classifier: {name!r} is given twice")
        path = os.path.abspath(os.path.expanduser(path))
        if not os.path.isfile(path):
            raise ValueError(f"--treespec-classifier {name}: {path} is not a file")
        out[name] = path
    return out


def _env_files() -> str:
    return env(ENV_CLASSIFIERS) or "{}"


@functools.lru_cache(maxsize=4)
def load_registry(raw: str) -> Tuple[Dict[str, object], Dict[str, str]]:
    """``TREESPEC_CLASSIFIERS`` -> ({name: C2TClassifier}, {name: sha256 of the file or 'builtin'})."""
    from ..policies.classifier import DEFAULT_FILE, C2TClassifier, load_classifier

    try:
        files = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{ENV_CLASSIFIERS} must be a JSON object of name -> path: {e}") from None
    if not isinstance(files, dict):
        raise ValueError(f"{ENV_CLASSIFIERS} must be a JSON object of name -> path, got {type(files).__name__}")
    modules, digests = {}, {}
    if DEFAULT_NAME not in files:
        modules[DEFAULT_NAME] = load_classifier(None)
        digests[DEFAULT_NAME] = _sha256(DEFAULT_FILE) if os.path.isfile(DEFAULT_FILE) else "builtin"
    for name, path in files.items():
        _check_name(str(name))
        try:
            modules[name] = C2TClassifier.load(path)
        except ValueError as e:
            raise ValueError(f"--treespec-classifier {name}: {e}") from None
        digests[name] = _sha256(path)
    for name in sorted(modules):
        logger.info("treespec: classifier %r sha256 %s (pid %d)", name, digests[name], os.getpid())
    return modules, digests


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def registered() -> Dict[str, object]:
    """``{name: C2TClassifier}`` of this server (``default`` always included); loaded once per process."""
    return load_registry(_env_files())[0]


def classifier_digests() -> Dict[str, str]:
    """``{name: sha256}`` of the registered classifier files (``builtin`` for the hand-set default)."""
    return dict(load_registry(_env_files())[1])


def resolve_request_classifier(spec, modules: Optional[Mapping[str, object]] = None):
    """A request's policy dict with ``classifier`` (a registered name) replaced by the loaded module.

    ``spec`` is returned as given when it is not a dict or names no classifier; anything but a registered
    name raises ``ValueError`` listing the names (the message does not depend on the file system).

    Examples
    --------
    >>> resolve_request_classifier({"policy": "talon"})
    {'policy': 'talon'}
    """
    from ..policies.registry import REGISTRY

    if not isinstance(spec, dict) or spec.get("classifier") is None:
        return spec
    policy = spec.get("policy")
    if not (isinstance(policy, str) and policy in REGISTRY):
        return spec  # an unknown policy: parse_spec refuses it by that name (a client's string never names a field)
    if "classifier" not in {f.name for f in dataclasses.fields(REGISTRY[policy].Params)}:
        return spec  # a policy without the field: parse_spec refuses it as an unknown parameter, listing the allowed
    modules = registered() if modules is None else modules
    name = spec["classifier"]
    if not isinstance(name, str) or name not in modules:
        # a name-like value is echoed (a typo is then obvious); anything else, a path included, is not:
        # the answer never depends on the server's files, nor repeats a path back
        plausible = isinstance(name, str) and 0 < len(name) <= 64 and set(name) <= _NAME_CHARS
        shown = repr(name) if plausible else "a value that is not a classifier name (paths are never opened)"
        raise ValueError(f"{policy}.classifier must be one of the server's registered classifiers "
                         f"{sorted(modules)}, got {shown}")
    return {**spec, "classifier": modules[name]}
