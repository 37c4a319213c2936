"""Cell rows from request records (the definitions in :mod:`treespec_sglang.serverbench.report`), the
same-output column, the table and the plots."""

import numpy as np
import pytest

from treespec_sglang.serverbench.client import RequestRecord
from treespec_sglang.serverbench.matrix import Cell, ServerSetting
from treespec_sglang.serverbench.report import format_table, mark_same_output, percentiles, plot, summarize

EAGLE = ServerSetting("EAGLE", 4, 3, 8)
PLAIN = ServerSetting("none")


def rec(i, tokens, rounds=0, correct=0, accepts=None, verify=None, times=(0.1, 0.3, 0.6), ok=True, ids=None):
    r = RequestRecord(i, ok=ok, error=None if ok else "HTTP 400: bad")
    if ok:
        r.chunk_times, r.ttft, r.latency = list(times), times[0], times[-1]
        r.output_ids = ids if ids is not None else list(range(tokens))
        r.meta = {"completion_tokens": tokens, "spec_verify_ct": rounds, "spec_num_correct_drafts": correct}
        if accepts is not None:
            r.meta.update(treespec_accept_lengths=accepts, treespec_verify_tokens=verify,
                          treespec_tree_sizes=verify)
    return r


def test_policy_cell_uses_the_treespec_lists():
    cell = Cell(EAGLE, "c2t", 8, 2, 0.0, '{"policy": "c2t", "budget": 8}')
    records = [rec(0, 7, rounds=3, correct=4, accepts=[2, 0, 2], verify=[5, 8, 3]),
               rec(1, 5, rounds=2, correct=2, accepts=[1, 1], verify=[6, 6], times=(0.2, 0.5)),
               rec(2, 0, ok=False)]
    row = summarize(cell, records, wall=2.0)
    assert (row["requests"], row["ok"], row["errors"]) == (3, 2, 1)
    assert row["error_examples"] == ["HTTP 400: bad"]
    assert row["output_tokens"] == 12 and row["output_tok_s"] == 6.0 and row["req_s"] == 1.0
    assert row["rounds"] == 5 and row["accept_length"] == pytest.approx(12 / 5)
    assert row["tau"] == pytest.approx(1 + 6 / 5)
    assert row["verified_per_round"] == pytest.approx(28 / 5) and row["mean_tree_size"] == pytest.approx(28 / 5)
    assert row["accept_hist_values"] == [0, 1, 2] and row["accept_hist"] == [1, 2, 2]
    assert row["ttft_ms_p50"] == pytest.approx(150.0)
    gaps = [0.2, 0.3, 0.3]
    assert row["itl_ms_p90"] == pytest.approx(np.percentile(gaps, 90) * 1000)
    assert row["tpot_ms"] == pytest.approx(np.mean([0.5 / 6, 0.3 / 4]) * 1000)
    assert row["policy"] == "c2t(b8)" and row["spec"] == {"policy": "c2t", "budget": 8}


def test_native_and_plain_cells_use_sglang_counters():
    native = summarize(Cell(EAGLE, None, None, 1, 0.0), [rec(0, 9, rounds=4, correct=5)], wall=1.0)
    assert native["policy"] == "native" and native["tau"] == pytest.approx(1 + 5 / 4)
    assert native["verified_per_round"] == 8.0 and native["accept_length"] == pytest.approx(9 / 4)
    assert native["accept_hist"] == []
    plain = summarize(Cell(PLAIN, None, None, 1, 0.0), [rec(0, 9)], wall=1.0)
    assert plain["policy"] == "plain" and plain["tau"] == 1.0 and plain["accept_length"] == 1.0
    assert plain["verified_per_round"] == 1.0 and plain["rounds"] == 9


def test_a_cell_with_no_successful_request_still_makes_a_row():
    row = summarize(Cell(EAGLE, None, None, 4, 0.0), [rec(i, 0, ok=False) for i in range(3)], wall=0.0)
    assert row["ok"] == 0 and row["errors"] == 3 and row["output_tok_s"] == 0.0
    assert row["ttft_ms_p50"] is None and row["tpot_ms"] is None


def test_percentiles_match_numpy_and_handle_empty():
    xs = [0.3, 0.1, 0.2, 0.9]
    got = percentiles(xs, "x")
    assert got == {f"x_p{q}": pytest.approx(np.percentile(xs, q) * 1000) for q in (50, 90, 99)}
    assert percentiles([], "x") == {"x_p50": None, "x_p90": None, "x_p99": None}


def _rows(with_plain=True):
    cells = ([Cell(PLAIN, None, None, 1, 0.0)] if with_plain else []) + [
        Cell(EAGLE, None, None, 1, 0.0), Cell(EAGLE, "talon", 8, 1, 0.0, '{"policy": "talon"}'),
        Cell(EAGLE, "talon", 8, 1, 1.0, '{"policy": "talon"}')]
    rows = [summarize(c, [rec(0, 3, rounds=1, correct=1, accepts=[1], verify=[8]), rec(1, 3)], 1.0) for c in cells]
    return cells, rows


@pytest.mark.parametrize("with_plain", [True, False])
def test_same_output_against_plain_else_native(with_plain):
    cells, rows = _rows(with_plain)
    outputs = {c.label: [[1, 2, 3], [4, 5]] for c in cells}
    outputs[cells[-2].label] = [[1, 2, 3], [4, 6]]  # talon T0 differs on prompt 1
    outputs[cells[-1].label] = [[9], [9]]  # T > 0: not compared
    mark_same_output(rows, outputs)
    assert [r["same_output"] for r in rows] == ([1.0] if with_plain else []) + [1.0, 0.5, None]
    assert rows[1 if with_plain else 0]["same_output_reference"] == cells[0].label


def test_table_rows_are_the_cells_values_in_their_columns():
    """Each table row, cell by cell, from the records: a talon cell (2 of 3 requests ok, 12 tokens over 5
    rounds, 5 of the rounds' accepted drafts, ITL gaps .1 .4 .3 s) and a native cell at T = 1."""
    talon = summarize(Cell(EAGLE, "talon", 8, 4, 0.0, '{"policy": "talon"}'),
                      [rec(0, 7, rounds=3, correct=4, accepts=[2, 0, 1], verify=[5, 8, 3], times=(0.1, 0.2, 0.6)),
                       rec(1, 5, rounds=2, correct=2, accepts=[1, 1], verify=[6, 6], times=(0.2, 0.5)),
                       rec(2, 0, ok=False)], wall=2.0)
    talon["same_output"] = 0.5
    native = summarize(Cell(EAGLE, None, None, 2, 1.0), [rec(0, 9, rounds=4, correct=3, times=(0.2, 0.5))], wall=3.0)
    table = format_table([talon, native]).splitlines()
    assert table[0] == ("| server | policy | conc | T | tok/s | req/s | accept len | tau | verified/round | TTFT p50 ms | "
                        "ITL p50 ms | ITL p99 ms | same output | errors |")
    assert table[1] == "|" + "---|" * 14
    # tok/s 12 / 2 s, req/s 2 ok / 2 s, accept len 12 / 5, tau 1 + 5 / 5, verified 28 / 5, TTFT median of .1 .2,
    # ITL median and p99 (linear) of .1 .3 .4 s
    assert table[2] == ("| eagle(k4,s3,N8) | talon(b8) | 4 | 0 | 6.0 | 1.00 | 2.40 | 2.00 | 5.6 | 150 | 300 | 398 | "
                        "50% | 1 |")
    # tok/s 9 / 3 s, req/s 1 / 3 s, accept len 9 / 4, tau 1 + 3 / 4, verified N = 8, one gap of .3 s
    assert table[3] == ("| eagle(k4,s3,N8) | native | 2 | 1 | 3.0 | 0.33 | 2.25 | 1.75 | 8.0 | 200 | 300 | 300 | "
                        "- | 0 |")
    assert len(table) == 4


def test_table_and_plots(tmp_path):
    _, rows = _rows()
    table = format_table(rows).splitlines()
    # every cell: 6 tokens in 1 s from 2 requests, 1 round with 1 accepted draft verifying 8, TTFT .1 .1 s,
    # ITL gaps .2 .3 .2 .3 s; plain rows: accept length 1 and 1 verified token per round
    body = "| 6.0 | 2.00 | {} | 2.00 | {} | 100 | 250 | 300 | - | 0 |"
    assert table[2:] == ["| plain | plain | 1 | 0 " + body.format("1.00", "1.0"),
                         "| eagle(k4,s3,N8) | native | 1 | 0 " + body.format("6.00", "8.0"),
                         "| eagle(k4,s3,N8) | talon(b8) | 1 | 0 " + body.format("6.00", "8.0"),
                         "| eagle(k4,s3,N8) | talon(b8) | 1 | 1 " + body.format("6.00", "8.0")]
    paths = plot(rows, str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["policies_vs_concurrency.png", "accept_hist.png"]
    assert all((tmp_path / p.rsplit("/", 1)[1]).stat().st_size > 5000 for p in paths)
