"""``utils.bounded.Bounded``: the memo tables' one rule (at most ``cap`` entries; a new key in a full table
starts it again), checked against a plain model of that rule, and the plugin's tables built on it."""

import random

import pytest

from treespec_sglang.utils.bounded import Bounded


@pytest.mark.parametrize("cap", [1, 2, 5])
def test_put_follows_the_rule_against_a_plain_model(cap):
    """Random puts and overwrites: the table equals a dict that is emptied before a new key when it is full, and
    never holds more than ``cap``; ``put`` returns the value it stored."""
    rng = random.Random(cap)
    table, model = Bounded(cap), {}
    for step in range(300):
        key, value = rng.randrange(2 * cap + 1), step
        if key not in model and len(model) == cap:
            model = {}
        model[key] = value
        assert table.put(key, value) == value
        assert dict(table) == model and len(table) <= cap


def test_an_overwrite_in_a_full_table_keeps_the_rest():
    table = Bounded(2)
    table.put("a", 1), table.put("b", 2), table.put("a", 3)
    assert dict(table) == {"a": 3, "b": 2}
    assert table.get("b") == 2 and "a" in table  # lookups are the dict's own


@pytest.mark.parametrize("cap", [0, -1, 2.0, None])
def test_cap_is_checked(cap):
    with pytest.raises(ValueError, match="cap must be an int >= 1"):
        Bounded(cap)


def test_the_plugin_tables_are_bounded():
    """Every per-process memo table keyed by what a server meets without end is a Bounded one."""
    from treespec_sglang.plugin import pool, pool_kernels, request, rows

    tables = [pool._NATIVE_TREES, pool_kernels._CLF_TABLES, request._INTERNED, rows._ROWS, rows._RULE_ROWS,
              rows._BATCHES]
    assert all(type(t) is Bounded for t in tables)
    assert [t.cap for t in tables] == [4096, 256, 4096, 4096, 4096, 256]
