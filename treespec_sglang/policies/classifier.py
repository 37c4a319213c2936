"""The C2T confidence classifier (C2T §4.1): a 2-layer FFN on (joint prob, entropy, depth).

Features of a candidate node i (C2T Eq. 6-8):

* ``P_i`` joint probability: product of draft probabilities on the root->i path (not log);
* ``H_i`` entropy of the distribution i was drawn from, over its top-1000 probabilities
  (``-sum p log p`` of the unrenormalised top-M probabilities, Eq. 7);
* ``d_i`` the node's tree depth (root 0, its children 1).

With ``hidden=48`` the network has 3*48 + 48 + 48 + 1 = 241 parameters, as in the paper.
Training (C2T App. C) is :mod:`treespec_sglang.training.c2t`; the package default is the shipped
trained classifier (``assets/c2t-classifier.pt``) when present, else :meth:`C2TClassifier.default`,
a hand-set stand-in.
"""

from __future__ import annotations

import functools
import os
from typing import Union

import torch
from torch import nn

__all__ = ["C2TClassifier", "c2t_features", "entropy_topm", "load_classifier", "ENTROPY_TOP_M"]

ENTROPY_TOP_M = 1000


class C2TClassifier(nn.Module):
    """``[..., 3]`` features (joint prob, entropy, depth) -> ``[...]`` confidence in (0, 1).

    Examples
    --------
    >>> clf = C2TClassifier.default()
    >>> clf(torch.tensor([[0.9, 1.0, 1.0], [0.001, 1.0, 5.0]])).gt(0.5).tolist()
    [True, False]
    """

    def __init__(self, hidden: int = 48):
        super().__init__()
        if not isinstance(hidden, int) or not 1 <= hidden <= 4096:
            raise ValueError(f"C2TClassifier.hidden must be an integer in [1, 4096], got {hidden!r}")
        self.hidden = hidden
        self.fc1 = nn.Linear(3, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc2(torch.relu(self.fc1(features.float()))))[..., 0]

    @classmethod
    def default(cls) -> "C2TClassifier":
        """Hand-set weights: score >= 0.5 iff ``12 P - 0.15 d + 0.1 H >= 1``.

        A joint-probability gate (about P >= 0.08 at depth 1) with a mild depth penalty and an
        entropy bonus, the directions C2T §4.1 / Fig. 2 reports for trained classifiers.
        """
        m = cls(hidden=48)
        with torch.no_grad():
            m.fc1.weight.zero_()
            m.fc1.bias.zero_()
            m.fc1.weight[0, 0] = 1.0  # h0 = relu(P)
            m.fc1.weight[1, 2] = 1.0  # h1 = relu(d)
            m.fc1.weight[2, 1] = 1.0  # h2 = relu(H)
            m.fc2.weight.zero_()
            m.fc2.weight[0, 0] = 12.0
            m.fc2.weight[0, 1] = -0.15
            m.fc2.weight[0, 2] = 0.1
            m.fc2.bias.fill_(-1.0)
        return m.eval()

    def save(self, path: Union[str, os.PathLike]) -> None:
        torch.save({"format": "treespec-c2t-v1", "hidden": self.hidden, "state_dict": self.state_dict()}, path)

    @classmethod
    def load(cls, path: Union[str, os.PathLike], map_location="cpu") -> "C2TClassifier":
        if not os.path.isfile(path):
            raise ValueError(f"classifier: file {str(path)!r} does not exist (save one with C2TClassifier.save)")
        not_ours = f"classifier: {str(path)!r} is not a treespec C2T classifier file (write one with C2TClassifier.save)"
        try:
            blob = torch.load(path, map_location=map_location, weights_only=True)
        except Exception as e:  # not a torch file, or one holding arbitrary objects
            raise ValueError(f"{not_ours}: {type(e).__name__}") from None
        if not isinstance(blob, dict) or blob.get("format") != "treespec-c2t-v1":
            raise ValueError(not_ours)
        try:
            m = cls(hidden=int(blob["hidden"]))
            m.load_state_dict(blob["state_dict"])
        except Exception as e:  # a damaged file: wrong shapes / keys
            raise ValueError(f"{not_ours}: {type(e).__name__}: {e}") from None
        # a NaN or infinite weight scores NaN, which torch's ReLU keeps and the fused kernel's max drops: the
        # two selection paths would disagree on every request it scores
        bad = [name for name, t in m.state_dict().items() if not bool(torch.isfinite(t).all())]
        if bad:
            raise ValueError(f"classifier: {str(path)!r} has non-finite weights in {', '.join(bad)}")
        return m.eval()


_DEFAULT = None
# the classifier trained by `treespec train c2t` and shipped with the package, if present
DEFAULT_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "c2t-classifier.pt")


def load_classifier(spec) -> C2TClassifier:
    """``None`` -> package default (the shipped trained classifier, else the hand-set one),
    a path -> loaded, a module -> itself."""
    global _DEFAULT
    if spec is None:
        if _DEFAULT is None:
            _DEFAULT = C2TClassifier.load(DEFAULT_FILE) if os.path.isfile(DEFAULT_FILE) else C2TClassifier.default()
        return _DEFAULT
    if isinstance(spec, nn.Module):
        return spec
    path = os.path.abspath(os.fspath(spec))
    try:
        st = os.stat(path)
    except OSError:
        return C2TClassifier.load(path)  # raises the clear "does not exist"
    return _load_cached(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=16)
def _load_cached(path: str, mtime_ns: int, size: int) -> C2TClassifier:
    """One load per file version: requests naming the same file share it (validation included)."""
    return C2TClassifier.load(path)


def entropy_topm(logprobs: torch.Tensor, m: int = ENTROPY_TOP_M) -> torch.Tensor:
    """Entropy over the top-m probabilities (C2T Eq. 7): ``[..., vocab]`` log-probs -> ``[...]``."""
    lp = logprobs.topk(min(m, logprobs.shape[-1]), dim=-1).values
    p = lp.exp()
    return -(torch.where(p > 0, p * lp, 0.0)).sum(-1)


def c2t_features(path_logprob: torch.Tensor, entropy: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Stack ``[...]`` path log-prob, parent entropy and depth into ``[..., 3]`` float32 features."""
    return torch.stack([path_logprob.exp(), entropy.float(), depth.float()], dim=-1)
