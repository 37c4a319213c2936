"""Server-wide treespec defaults: flags, environment variables and ``configure()`` (no sglang import).

``--treespec-policy talon --treespec-config '{"budget": 60, "mu": 0.03}'`` on
``python -m sglang.launch_server`` (added by the plugin's ServerArgs hooks) and
``treespec_sglang.configure("talon", {"budget": 60})`` before ``sgl.Engine(...)`` both end up in
the environment variables below, which SGLang's spawned scheduler processes (every TP rank)
inherit. With neither set, the plugin changes nothing.

``--treespec-token-cap B`` (``configure(..., token_cap=B)``, ``TREESPEC_TOKEN_CAP``) turns on the batch's
token cap: the treespec requests of a round verify ``B`` tokens each *on average* (roots included), spent
where the draft's path probabilities are highest across them
(:func:`~treespec_sglang.plugin.pool.share_token_cap`). A request opts out with
``{"token_cap": false}`` in its ``custom_params["treespec"]``: its own policy tree is kept whole.

``--treespec-classifier NAME=PATH`` (repeatable; ``configure(..., classifiers={NAME: PATH})``,
``TREESPEC_CLASSIFIERS``) registers C2T classifiers that requests pick by name
(:mod:`~treespec_sglang.plugin.classifiers`); a request never names a file.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from ..policies import parse_spec
from ..policies.params import shown
from .classifiers import ENV_CLASSIFIERS, load_registry, parse_classifier_flags, resolve_request_classifier
from .settings import derived, env, frozen

__all__ = ["ENV_POLICY", "ENV_CONFIG", "ENV_TOKEN_CAP", "ENV_POLICY_MODULES", "ServerDefaults",
           "configure", "server_defaults", "draft_algorithm_mismatch", "import_policy_modules", "env_switch",
           "load_config", "parse_token_cap"]

ENV_POLICY = "TREESPEC_POLICY"
ENV_CONFIG = "TREESPEC_CONFIG"
ENV_TOKEN_CAP = "TREESPEC_TOKEN_CAP"
ENV_POLICY_MODULES = "TREESPEC_POLICY_MODULES"  # the operator's own policy modules, imported in every process
MAX_TOKEN_CAP = 1024
_SWITCH = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def env_switch(name: str, default: Union[bool, str] = False, extra: Sequence[str] = ()) -> Union[bool, str]:
    """An operator's on/off ``TREESPEC_*`` variable (read through :mod:`.settings`, so another name raises
    KeyError), the one parser of them all: unset or blank -> ``default``;
    1 / true / yes / on -> True; 0 / false / no / off -> False (any case, spaces ignored); a word of ``extra``
    (e.g. ``auto``) -> that word.

    Raises
    ------
    ValueError
        Any other value, naming the variable and the allowed values (never read as a default).

    Examples
    --------
    >>> os.environ["TREESPEC_EXAMPLE"] = " Off "
    >>> env_switch("TREESPEC_EXAMPLE", True)
    False
    >>> del os.environ["TREESPEC_EXAMPLE"]
    """
    raw = env(name)
    v = raw.strip().lower()
    if not v:
        return default
    if v in extra:
        return v
    if v not in _SWITCH:
        allowed = " / ".join(["1", "0", "true", "false", "on", "off", "yes", "no", *extra])
        raise ValueError(f"{name} must be one of {allowed}, got {raw!r}")
    return _SWITCH[v]


@dataclass(frozen=True)
class ServerDefaults:
    """The policy applied to requests that carry no ``custom_params["treespec"]``."""

    policy: Optional[str] = None
    config: dict = field(default_factory=dict)
    token_cap: Optional[int] = None  # mean verified tokens per sharing request per round (None: off)

    def __post_init__(self):
        b = self.token_cap
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= MAX_TOKEN_CAP):
            raise ValueError(f"--treespec-token-cap must be an integer in [1, {MAX_TOKEN_CAP}] (verified tokens "
                             f"per request per round, on average over the batch), got {b!r}")
        if not isinstance(self.config, dict):
            raise ValueError(f"--treespec-config must be a JSON object of the policy's parameters, got "
                             f"{type(self.config).__name__}")
        if "policy" in self.config:  # one source for the policy's name: it would silently lose to the other
            raise ValueError(f"--treespec-config must not name the policy (--treespec-policy does), got "
                             f"'policy': {shown(self.config['policy'])}")
        if self.policy is None:
            if self.config:
                raise ValueError("--treespec-config needs --treespec-policy")
            return
        parse_spec(resolve_request_classifier(self.spec))  # raises ValueError naming the field and its range

    @property
    def active(self) -> bool:
        return self.policy is not None

    @property
    def spec(self) -> Optional[dict]:
        return None if self.policy is None else {**self.config, "policy": self.policy}


def configure(policy: Optional[str] = None, config: Optional[dict] = None,
              token_cap: Optional[int] = None, classifiers: Optional[dict] = None) -> ServerDefaults:
    """Set (or with ``policy=None`` clear) the server-wide default; call before ``sgl.Engine``.
    ``token_cap``: the batch's token cap, in mean verified tokens per request (None: off).
    ``classifiers``: ``{name: path}`` of C2T classifiers requests may pick by name (``default``, the
    shipped one, is always there; files are checked and loaded here); ``{}`` clears them, None keeps them.

    Examples
    --------
    >>> configure("salf", {"budget": 60, "th": 0.6}).spec["policy"]
    'salf'
    >>> configure(None).active
    False

    Raises
    ------
    RuntimeError
        In a process that already serves (its settings are frozen, :mod:`.settings`): it would change nothing.
    """
    if frozen():
        raise RuntimeError("treespec.configure: this process already serves with the settings it started with "
                           "(frozen when its draft worker started); call configure before starting the server")
    if classifiers is not None:  # None leaves the registry as it is (e.g. TREESPEC_CLASSIFIERS set by hand)
        files = parse_classifier_flags(f"{k}={v}" for k, v in dict(classifiers).items())
        load_registry(json.dumps(files))  # every file loads (hash logged) before it is exported; a bad one fails here
        if files:
            os.environ[ENV_CLASSIFIERS] = json.dumps(files)
        else:
            os.environ.pop(ENV_CLASSIFIERS, None)
    config = {} if config is None else dict(config) if isinstance(config, dict) else config  # a non-dict: refused
    d = ServerDefaults(policy, config, token_cap)
    if d.policy is None:
        os.environ.pop(ENV_POLICY, None)
        os.environ.pop(ENV_CONFIG, None)
    else:
        os.environ[ENV_POLICY] = d.policy
        os.environ[ENV_CONFIG] = json.dumps(d.config)
    if d.token_cap is None:
        os.environ.pop(ENV_TOKEN_CAP, None)
    else:
        os.environ[ENV_TOKEN_CAP] = str(d.token_cap)
    return d


@derived
def server_defaults() -> ServerDefaults:
    """Read the defaults from the environment (validated; errors name the variable).

    Called on every draft step (once the server serves, :func:`.settings.derived`: parsed once per snapshot);
    each distinct (policy, config) pair is parsed and validated once."""
    return _parse_defaults(env(ENV_POLICY) or None, env(ENV_CONFIG) or "{}", env(ENV_TOKEN_CAP) or None)


def load_config(raw: str, source: str):
    """A config's JSON text (``--treespec-config`` or ``TREESPEC_CONFIG``, named by ``source`` in the error)
    decoded; whether it is an object is checked by its caller."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source} must be a JSON object: {e}") from None


def parse_token_cap(raw: Optional[str]) -> Optional[int]:
    """``TREESPEC_TOKEN_CAP``'s text as an int (None: unset); its range is checked by :class:`ServerDefaults`."""
    try:
        return None if raw is None else int(raw)
    except ValueError:
        raise ValueError(f"{ENV_TOKEN_CAP} must be an integer in [1, {MAX_TOKEN_CAP}], got {raw!r}") from None


@functools.lru_cache(maxsize=8)
def _parse_defaults(policy: Optional[str], raw: str, cap: Optional[str] = None) -> ServerDefaults:
    config, token_cap = load_config(raw, ENV_CONFIG), parse_token_cap(cap)
    try:
        if not isinstance(config, dict):
            raise ValueError(f"must be a JSON object of the policy's parameters, got {raw!r}")
        return ServerDefaults(policy, config, token_cap)
    except ValueError as e:
        raise ValueError(f"{ENV_POLICY}/{ENV_CONFIG}/{ENV_TOKEN_CAP}: {e}") from None


def import_policy_modules() -> list:
    """Import the modules named in ``TREESPEC_POLICY_MODULES`` (comma-separated; the operator's environment,
    never a request), so the policies they register (``@register_policy``) exist in this process: SGLang runs
    the plugin's ``register`` in every process it starts. Returns the names imported.

    Raises
    ------
    ImportError
        Naming the variable and the module that failed, at start instead of at the first request.
    """
    import importlib

    names = [n.strip() for n in os.environ.get(ENV_POLICY_MODULES, "").split(",") if n.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ImportError(f"{ENV_POLICY_MODULES}: cannot import {name!r}: {e}") from e
    return names


def draft_algorithm_mismatch(draft_class: str, eagle3: bool) -> Optional[str]:
    """Why a draft model cannot serve under this ``--speculative-algorithm``, or None.

    An EAGLE-3 head (``...Eagle3`` class) served as ``EAGLE`` starts and runs, but SGLang then feeds it the
    target's last hidden state instead of the three captured layers and replaces its LM head by the
    target's: it accepts nothing (accept length 1.0) with no error. The reverse fails at the first draft
    with a shape error. Example: ``draft_algorithm_mismatch("LlamaForCausalLMEagle3", False)`` -> a message.
    """
    is_eagle3_head = draft_class.endswith("Eagle3")
    if is_eagle3_head and not eagle3:
        return (f"the draft model is {draft_class} (an EAGLE-3 head) but --speculative-algorithm is EAGLE: SGLang "
                f"would feed it the target's last hidden state instead of its three captured layers and accept "
                f"no draft token; serve it with --speculative-algorithm EAGLE3")
    if eagle3 and not is_eagle3_head and draft_class.endswith("Eagle"):
        return (f"the draft model is {draft_class} (an EAGLE head) but --speculative-algorithm is EAGLE3: its fc "
                f"reads the target's last hidden state, not three captured layers; serve it with "
                f"--speculative-algorithm EAGLE")
    return None
