"""The C2T classifier module: its size bounds, the hand-set default against its stated formula, the file
format's refusals (each a full message naming the file), the package default's source, one load per file
version, and the top-m entropy against a plain loop."""

import fractions
import math
import os
import re

import pytest
import torch

from tests.helpers import plain_confidence, plain_entropy
from treespec_sglang.policies import classifier as clf_mod
from treespec_sglang.policies.classifier import C2TClassifier, entropy_topm, load_classifier

NOT_OURS = "classifier: {!r} is not a treespec C2T classifier file (write one with C2TClassifier.save)"


def full(message):
    """A ``match`` pattern for exactly ``message``."""
    return f"^{re.escape(message)}$"


def test_the_default_size_is_the_papers_241_parameters():
    for m in (C2TClassifier(), C2TClassifier.default()):
        assert m.hidden == 48 and sum(p.numel() for p in m.parameters()) == 3 * 48 + 48 + 48 + 1 == 241


@pytest.mark.parametrize("hidden", [1, 4096])
def test_hidden_bounds_are_inclusive(hidden):
    assert C2TClassifier(hidden=hidden).fc1.out_features == hidden


@pytest.mark.parametrize("hidden", [0, 4097, -3, "8", 4.0])
def test_a_bad_hidden_size_is_refused_with_the_range(hidden):
    with pytest.raises(ValueError, match=full(f"C2TClassifier.hidden must be an integer in [1, 4096], got {hidden!r}")):
        C2TClassifier(hidden=hidden)


@pytest.mark.parametrize("P, H, d", [(0.9, 1.0, 1.0), (0.001, 1.0, 5.0), (0.08, 0.0, 1.0), (0.3, 2.5, 0.0),
                                     (0.05, 4.0, 3.0), (0.0, 0.0, 0.0), (1.0, 7.0, 9.0), (0.2, 0.5, 12.0)])
def test_the_hand_set_default_is_its_formula(P, H, d):
    """score = sigmoid(12 P - 0.15 d + 0.1 H - 1) on non-negative features (the ReLUs pass them through)."""
    want = 1.0 / (1.0 + math.exp(-(12 * P - 0.15 * d + 0.1 * H - 1.0)))
    with torch.no_grad():
        got = float(C2TClassifier.default()(torch.tensor([[P, H, d]])))
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_forward_and_the_oracles_restatement_agree(seed):
    """The oracles score nodes with :func:`tests.helpers.plain_confidence` (C2T Eq. 6-8 in Python floats); the
    module's forward, random weights and features (the shipped classifier among them), agrees with it."""
    g = torch.Generator().manual_seed(seed)
    clf = C2TClassifier(hidden=5 + seed)
    with torch.no_grad():
        for t in clf.parameters():
            t.copy_(torch.randn(t.shape, generator=g))
    feats = torch.rand(16, 3, generator=g) * torch.tensor([1.0, 6.0, 10.0])
    for m in (clf, load_classifier(None)):
        with torch.no_grad():
            got = m(feats).tolist()
        want = [plain_confidence(m, *row) for row in feats.tolist()]
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_a_missing_file_is_named():
    path = "/nonexistent/dir/clf.pt"
    with pytest.raises(ValueError, match=full(f"classifier: file {path!r} does not exist (save one with "
                                              "C2TClassifier.save)")):
        C2TClassifier.load(path)


def test_a_file_that_is_not_a_torch_file_is_named(tmp_path):
    path = tmp_path / "junk.pt"
    path.write_bytes(b"not a torch file at all")
    with pytest.raises(ValueError, match=full(NOT_OURS.format(str(path)) + ": UnpicklingError")):
        C2TClassifier.load(path)


@pytest.mark.parametrize("blob", [{"hidden": 4}, {"format": "treespec-c2t-v0", "hidden": 4}, torch.zeros(3), [1, 2]])
def test_a_torch_file_of_another_kind_is_named(tmp_path, blob):
    path = tmp_path / "other.pt"
    torch.save(blob, path)
    with pytest.raises(ValueError, match=full(NOT_OURS.format(str(path)))):
        C2TClassifier.load(path)


def test_a_damaged_classifier_file_names_the_error(tmp_path):
    path = tmp_path / "damaged.pt"
    torch.save({"format": "treespec-c2t-v1", "hidden": 4, "state_dict": {"fc1.weight": torch.zeros(2, 3)}}, path)
    with pytest.raises(ValueError, match="^" + re.escape(NOT_OURS.format(str(path)) + ": RuntimeError: Error(s) in "
                                                         "loading state_dict for C2TClassifier")):
        C2TClassifier.load(path)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_classifier_with_non_finite_weights_is_refused_naming_them(tmp_path, bad):
    m = C2TClassifier(hidden=4)
    with torch.no_grad():
        m.fc2.bias[0] = bad
    path = tmp_path / "bad.pt"
    m.save(path)
    with pytest.raises(ValueError, match=full(f"classifier: {str(path)!r} has non-finite weights in fc2.bias")):
        C2TClassifier.load(path)


def test_a_file_holding_arbitrary_objects_is_refused_even_when_torch_allows_them(tmp_path, monkeypatch):
    """Loading stays weights-only even where the process opts out of torch's weights-only default."""
    path = tmp_path / "pickled.pt"
    m = C2TClassifier(hidden=4)
    torch.save({"format": "treespec-c2t-v1", "hidden": 4, "state_dict": m.state_dict(),
                "note": fractions.Fraction(1, 3)}, path)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(ValueError, match=full(NOT_OURS.format(str(path)) + ": UnpicklingError")):
        C2TClassifier.load(path)


def test_load_honours_map_location(tmp_path):
    path = tmp_path / "c.pt"
    C2TClassifier(hidden=4).save(path)
    seen = []
    C2TClassifier.load(path, map_location=lambda storage, loc: seen.append(loc) or storage)
    assert seen and set(seen) == {"cpu"}


def test_the_package_default_is_the_shipped_file_when_present(monkeypatch):
    monkeypatch.setattr(clf_mod, "_DEFAULT", None)
    assert os.path.isfile(clf_mod.DEFAULT_FILE)
    raw = torch.load(clf_mod.DEFAULT_FILE, weights_only=True)["state_dict"]  # the file itself, read directly
    got = load_classifier(None).state_dict()
    assert set(got) == set(raw) and all(torch.equal(got[k], raw[k]) for k in raw)


def test_the_package_default_is_the_hand_set_one_without_the_file(monkeypatch, tmp_path):
    monkeypatch.setattr(clf_mod, "_DEFAULT", None)
    monkeypatch.setattr(clf_mod, "DEFAULT_FILE", str(tmp_path / "absent.pt"))
    got = load_classifier(None)
    assert got.fc2.weight[0, 0].item() == 12.0 and got.fc2.bias[0].item() == -1.0
    with torch.no_grad():
        score = float(got(torch.tensor([0.9, 1.0, 1.0])))
    assert score == pytest.approx(1 / (1 + math.exp(-(10.8 - 0.15 + 0.1 - 1))))


def _saved(path, fill, hidden=4):
    m = C2TClassifier(hidden=hidden)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(fill)
    m.save(path)


@pytest.mark.parametrize("change", ["mtime", "size"])
def test_a_rewritten_file_is_loaded_again(tmp_path, change):
    """The cache key is the file's version: a rewrite that changes only its mtime (same size), or only its
    size (mtime set back), still loads the new weights."""
    path = tmp_path / "c.pt"
    _saved(path, 0.5)
    st = os.stat(path)
    assert load_classifier(str(path)).fc2.bias[0].item() == 0.5
    _saved(path, -0.25, hidden=4 if change == "mtime" else 6)
    if change == "mtime":
        assert os.stat(path).st_size == st.st_size
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))
    else:
        assert os.stat(path).st_size != st.st_size
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert load_classifier(str(path)).fc2.bias[0].item() == -0.25


@pytest.mark.parametrize("m", [1, 3, 1000])
@pytest.mark.parametrize("masked", [0, 2])
def test_entropy_topm_is_the_top_m_entropy(m, masked):
    """Rows of 6 log-probs, ``masked`` of them -inf (a vocabulary mask): no NaN, the masked ones add 0."""
    g = torch.Generator().manual_seed(7 + m + masked)
    lp = torch.log_softmax(torch.randn(3, 6, generator=g) * 2, -1)
    lp[:, :masked] = float("-inf")
    got = entropy_topm(lp, m).tolist()
    for row, e in zip(lp.tolist(), got):
        assert e == pytest.approx(plain_entropy(row, m), rel=1e-5, abs=1e-7)
