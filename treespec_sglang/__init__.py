"""treespec-sglang: per-request draft-tree policies and lossless tree verification for SGLang.

Subpackages follow the dependency direction ``tree`` <- ``policies``/``verify``/``attention``
<- ``engine``/``training`` <- ``plugin``/``cli``. Only ``plugin`` imports sglang.
"""

__version__ = "0.1.0"
