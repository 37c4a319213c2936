"""Every docstring example in the package runs and shows what it says (doctest)."""

import doctest
import importlib
import pkgutil

import pytest

import treespec_sglang

MODULES = sorted(m.name for m in pkgutil.walk_packages(treespec_sglang.__path__, "treespec_sglang.")
                 if not m.name.endswith("__main__"))  # running it would start the CLI
NEEDS_CUDA = {"treespec_sglang.attention.flashinfer_backend"}  # imports flashinfer, a CUDA-only package


@pytest.mark.parametrize("name", [m for m in MODULES if m not in NEEDS_CUDA])
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
