"""Property-based fuzzing of the per-request parameters (engine and plugin share :func:`parse_spec`):
whatever a client sends, the outcome is a validated parameter set or a ``ValueError`` that names the
policy / field, never another exception, never a silent out-of-range value."""

import math

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from treespec_sglang.policies import parse_spec  # noqa: E402
from treespec_sglang.policies.params import MAX_BUDGET  # noqa: E402
from treespec_sglang.plugin.request import diagnose  # noqa: E402

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


@settings(max_examples=600, deadline=None)
@given(SPECS)
def test_parse_spec_validates_or_names_the_field(spec):
    try:
        p = parse_spec(spec)
    except ValueError as e:
        msg = str(e)
        assert msg and ("policy" in msg or any(f in msg for f in FIELDS)), msg
        return
    check_valid(p)


@settings(max_examples=300, deadline=None)
@given(st.one_of(VALUES, st.fixed_dictionaries({"treespec": SPECS})))
def test_plugin_custom_params_diagnosis_never_raises(custom_params):
    """What the SamplingParams hook runs on every request: a message or None, no exception."""
    msg = diagnose(custom_params)
    assert msg is None or msg.startswith("custom_params['treespec']: ")
