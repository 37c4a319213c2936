"""The SGLang plugin: per-request treespec tree policies inside SGLang 0.5.23's EAGLE worker.

Installed with ``pip install treespec-sglang[sglang]``; SGLang discovers :func:`register` through
the ``sglang.srt.plugins`` entry point in every process (launcher, tokenizer manager, each TP
rank's scheduler) and applies the hooks of :mod:`treespec_sglang.plugin.hooks`. This package is
the only place that imports sglang, and only inside :func:`register`.
"""

from .config import ENV_CONFIG, ENV_POLICY, ServerDefaults, configure, server_defaults
from .request import CUSTOM_KEY, request_params, validate_custom_params

__all__ = ["register", "configure", "server_defaults", "ServerDefaults", "validate_custom_params",
           "request_params", "CUSTOM_KEY", "ENV_POLICY", "ENV_CONFIG", "SGLANG_VERSION"]

SGLANG_VERSION = "0.5.23"


def register() -> None:
    """Entry point (group ``sglang.srt.plugins``): CPU stand-ins where needed, then the hooks."""
    from .classifiers import registered
    from .config import import_policy_modules
    from .cpu import install
    from .hooks import register_hooks
    from .stats import max_rounds

    install()  # only with SGLANG_USE_CPU_ENGINE and no real sgl_kernel (see plugin.cpu)
    import_policy_modules()  # TREESPEC_POLICY_MODULES: the operator's own registered policies, in this process too

    register_hooks()
    registered()  # the operator's classifiers, loaded once per process (hashes logged); a bad file fails here
    max_rounds()  # a bad TREESPEC_STATS_MAX_ROUNDS fails at start, not in a round
