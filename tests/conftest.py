import random

import pytest
import torch


@pytest.fixture
def rng():
    return random.Random(1234)


@pytest.fixture(autouse=True)
def _live_settings():
    """A test that starts a draft worker in-process freezes the plugin's settings (``plugin.settings``): thawed
    after it, so the next test reads the environment it sets. ``configure`` exports ``TREESPEC_*`` variables
    itself: the environment's ``TREESPEC_*`` are put back as they were, so no test serves the next one a default."""
    import os

    before = {k: v for k, v in os.environ.items() if k.startswith("TREESPEC_")}
    yield
    from treespec_sglang.plugin import settings

    settings.thaw()
    for k in [k for k in os.environ if k.startswith("TREESPEC_") and k not in before]:
        del os.environ[k]
    os.environ.update(before)


@pytest.fixture(autouse=True)
def fresh_tuner():
    """The process's ragged verify tuner (``plugin.ragged_tuner``; under ``auto`` on the CPU every verify asks it)
    dropped before and after each test: the next verify makes a new one, so no test inherits another's samples and
    decisions. The module is not imported for a test that never imported it."""
    import sys

    def drop():
        mod = sys.modules.get("treespec_sglang.plugin.ragged_tuner")
        if mod is not None:
            mod._TUNER[0] = None
    drop()
    yield
    drop()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def aligned_engine(tmp_path_factory):
    """A tiny target whose draft is the target itself one layer down: accepts often (``tests.engines``)."""
    pytest.importorskip("transformers")
    from tests.engines import make_aligned_engine

    return make_aligned_engine(tmp_path_factory.mktemp("tiny2"))


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory):
    """A float32 ``SpecEngine`` on a tiny random Llama (vocab 96) with a seeded random draft head."""
    pytest.importorskip("transformers")
    from tests.models.tiny import make_tiny_llama
    from treespec_sglang.engine import SpecEngine

    path = tmp_path_factory.mktemp("tiny-engine")
    make_tiny_llama(path)
    return SpecEngine.from_pretrained(str(path), draft=None, dtype="float32")
