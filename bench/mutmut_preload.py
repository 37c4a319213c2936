"""A pytest plugin (``-p bench.mutmut_preload``) that :mod:`bench.mutation_score` passes to mutmut for the groups whose
tests use SGLang: it imports every module the plugin hooks once, in mutmut's fork server (its ``collect`` warm-up),
so each mutant's forked run finds them imported instead of importing SGLang again (about 9 s a mutant on 2 cores;
the ``loaded`` fixture's ``load_plugins`` then only wraps the targets). Without SGLang it does nothing."""

import importlib
import importlib.util


def preload() -> list:
    """Import each hook target's module (the longest importable prefix of its dotted name); returns their names."""
    if importlib.util.find_spec("sglang") is None:
        return []
    from treespec_sglang.plugin.hooks import HOOKS

    done = []
    for target in HOOKS:
        parts = target.split(".")
        for k in range(len(parts) - 1, 0, -1):  # the module holds at least the final name
            try:
                importlib.import_module(".".join(parts[:k]))
            except ImportError:
                continue
            done.append(".".join(parts[:k]))
            break
    return done


preload()
