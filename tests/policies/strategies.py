"""Hypothesis strategies for what a client may send as a policy spec, and the in-range check of a parse."""

import math

from hypothesis import strategies as st

from treespec_sglang.policies.params import MAX_BUDGET

FIELDS = ["budget", "topk", "mu", "depth", "batch", "th", "max_depth", "beta", "length", "classifier", "extra"]
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 2000), st.floats(allow_nan=True, allow_infinity=True),
                   st.text(max_size=8), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3),
                                                                                               st.integers(), max_size=2))
SPECS = st.one_of(
    st.fixed_dictionaries({"policy": st.sampled_from(["eagle2", "talon", "salf", "c2t", "chain"])},
                          optional={f: VALUES for f in FIELDS}),
    st.fixed_dictionaries({"policy": VALUES}, optional={f: VALUES for f in FIELDS[:3]}),
    st.dictionaries(st.text(max_size=6), VALUES, max_size=4),
    VALUES,
)


def check_valid(p) -> None:
    """A parse that succeeded holds only in-range values."""
    for name in ("budget", "topk", "depth", "batch", "max_depth", "length"):
        v = getattr(p, name, None)
        if v is not None:
            assert isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_BUDGET, (name, v)
    for name in ("mu", "th", "beta"):
        v = getattr(p, name, None)
        if v is not None:
            assert math.isfinite(v) and 0.0 <= v <= 1.0, (name, v)
