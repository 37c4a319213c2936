"""The SGLang plugin: per-request treespec tree policies inside SGLang 0.5.23's EAGLE worker.

Installed with ``pip install treespec-sglang[sglang]``; SGLang discovers :func:`register` through
the ``sglang.srt.plugins`` entry point in every process (launcher, tokenizer manager, each TP
rank's scheduler) and applies the hooks of :mod:`treespec_sglang.plugin.hooks`. This package is
the only place that imports sglang, and only inside :func:`register`.
"""

from .config import ENV_CONFIG, ENV_POLICY, ServerDefaults, configure, server_defaults
from .request import CUSTOM_KEY, request_params, validate_custom_params

__all__ = ["register", "StartError", "configure", "server_defaults", "ServerDefaults", "validate_custom_params",
           "request_params", "CUSTOM_KEY", "ENV_POLICY", "ENV_CONFIG", "SGLANG_VERSION"]

SGLANG_VERSION = "0.5.23"


class StartError(SystemExit):
    """A setting the plugin cannot start with (a ``TREESPEC_*`` variable, a classifier file, a policy module).

    SGLang's plugin loader logs and swallows any ``Exception`` a plugin raises, and the server then starts without
    the plugin (its default policy ignored, every request SGLang's own) or with it half set up (failing its first
    round, with every request in flight). This stops the process instead (a ``SystemExit``: the launcher ends with
    the message; a scheduler process ends and SGLang's start fails naming it)."""


def register() -> None:
    """Entry point (group ``sglang.srt.plugins``): CPU stand-ins where needed, the operator's settings checked,
    then the hooks. A bad setting raises :class:`StartError`: the process stops, and no hook is registered."""
    from .classifiers import registered
    from .config import import_policy_modules
    from .cpu import install
    from .cpu.overlap import install_overlap
    from .hooks import register_hooks
    from .profile import profile_from_env
    from .stats import max_rounds

    try:
        if install():  # only with SGLANG_USE_CPU_ENGINE and no real sgl_kernel (see plugin.cpu)
            install_overlap()  # what SGLang's overlap scheduler calls, if the test bed lets it run on the CPU
        import_policy_modules()  # TREESPEC_POLICY_MODULES: the operator's own registered policies, in this process too
        registered()  # the operator's classifiers, loaded once per process (hashes logged); a bad file fails here
        max_rounds()  # TREESPEC_STATS_MAX_ROUNDS
        profile_from_env()  # TREESPEC_PROFILE and its _OPS / _SYNC
    except (ValueError, ImportError, OSError) as e:
        raise StartError(f"treespec-sglang cannot start: {e}") from e
    register_hooks()
