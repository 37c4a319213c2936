"""Docstrings: every example in the package runs and shows what it says (doctest); papers, not trackers."""

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


def test_code_cites_papers_not_tracker_numbers():
    """A reader of the code has no tracker: no 'issue 13' in the package or the benches."""
    import pathlib
    import re

    root = pathlib.Path(treespec_sglang.__file__).parent
    files = list(root.rglob("*.py")) + list((root.parent / "bench").glob("*.py"))
    hits = [f"{f.name}:{i + 1}" for f in files for i, line in enumerate(f.read_text().splitlines())
            if re.search(r"\bissue\s*#?\d+", line, re.IGNORECASE)]
    assert not hits, hits
