"""Property-based fuzzing of the per-request parameters (engine and plugin share :func:`parse_spec`):
whatever a client sends, the outcome is a validated parameter set or a ``ValueError`` that names the
policy / field, never another exception, never a silent out-of-range value."""

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.policies.strategies import FIELDS, SPECS, VALUES, check_valid  # noqa: E402
from treespec_sglang.policies import parse_spec  # noqa: E402
from treespec_sglang.plugin.request import diagnose  # noqa: E402

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
