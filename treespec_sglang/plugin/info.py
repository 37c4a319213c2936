"""The ``treespec`` section of SGLang's ``/server_info`` (no sglang import).

What an operator needs to check a running server: the plugin and SGLang versions, the server default
policy, the batch's token cap, the registered classifiers with their content hashes, the ragged-verify
setting, the selection (``TREESPEC_SELECT``), whether the draft graph records the chain stop's steps, the
per-round stats cap and the policies a request may pick.
"""

from __future__ import annotations

__all__ = ["server_info"]


def server_info() -> dict:
    """JSON-ready facts of this process's plugin configuration (read from the environment it inherited).

    Examples
    --------
    >>> sorted(server_info())[:3]
    ['chain_stop_graph', 'classifiers', 'default_policy']
    """
    from .. import __version__
    from ..policies import POLICIES
    from . import SGLANG_VERSION
    from .chain_stop import chain_graph_enabled
    from .classifiers import classifier_digests
    from .config import server_defaults
    from .draft_select import selection_mode
    from .ragged_support import ragged_setting
    from .stats import max_rounds

    d = server_defaults()
    return {
        "chain_stop_graph": chain_graph_enabled(),
        "classifiers": classifier_digests(),
        "default_policy": d.spec,
        "policies": sorted(POLICIES),
        "ragged_verify": {True: "on", False: "off"}.get(ragged_setting(), ragged_setting()),
        "selection": selection_mode(),
        "sglang": SGLANG_VERSION,
        "stats_max_rounds": max_rounds(),
        "token_cap": d.token_cap,
        "version": __version__,
    }
