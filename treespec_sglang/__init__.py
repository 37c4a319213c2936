"""treespec-sglang: per-request draft-tree policies and lossless tree verification for SGLang.

Subpackages follow the dependency direction ``tree`` <- ``policies``/``verify``/``attention``
<- ``engine``/``training`` <- ``plugin``/``cli``. Only ``plugin`` imports sglang.
"""

__version__ = "0.2.0"


def configure(policy=None, config=None):
    """Server-wide default tree policy for ``sgl.Engine`` (call before creating the engine).

    ``treespec_sglang.configure("talon", {"budget": 60, "mu": 0.03})``; ``configure(None)`` clears.
    Stored in environment variables that SGLang's spawned ranks inherit.
    """
    from .plugin.config import configure as _configure

    return _configure(policy, config)
