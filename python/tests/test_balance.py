"""odc.balance from Python: the plans' invariants, the cost model, every bad input named."""

import pathlib
import re

import numpy as np
import pytest

import odc

LENGTHS = [40_000, 9_000, 12_000, 30_000, 5_000, 22_000, 700, 64_000]
DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "python.md"


def covered(plan, lengths):
    """Tokens of each sample the plan holds: whole samples, plus split samples' pieces."""
    got = [0] * len(lengths)
    for mb in plan.micro_batches:
        if mb.piece is None:
            for s in mb.samples:
                got[s] += lengths[s]
        else:
            got[mb.piece.sample] += sum(end - start for start, end in mb.piece.chunks)
    return got


@pytest.mark.parametrize("dispatch", ["static", "dynamic", "equal"])
def test_every_sample_is_planned_once_within_the_budget(dispatch):
    plan = odc.balance(LENGTHS, ranks=3, token_budget=65_536, dispatch=dispatch)
    assert covered(plan, LENGTHS) == LENGTHS
    assert all(mb.tokens <= 65_536 for mb in plan.micro_batches)
    listed = sorted(i for rank in plan.ranks for i in rank)
    assert listed == list(range(len(plan.micro_batches)))
    per_rank = plan.samples()
    assert len(per_rank) == 3
    assert sorted(s for rank in per_rank for mb in rank for s in mb) == list(range(len(LENGTHS)))
    assert len(plan.rank_costs()) == 3


def test_equal_dispatch_gives_every_rank_the_same_count_and_static_balances_better():
    lengths = [30_000] + [1_000] * 30
    equal = odc.balance(lengths, ranks=4, token_budget=32_000, dispatch="equal")
    counts = {len(rank) for rank in equal.ranks}
    assert len(counts) == 1
    static = odc.balance(lengths, ranks=4, token_budget=32_000)
    assert max(static.rank_costs()) <= max(equal.rank_costs()) + 1e-12


def test_a_long_sample_is_split_over_a_gang_and_its_pieces_cover_it():
    lengths = [64_000] + [2_000] * 7
    whole = odc.balance(lengths, ranks=4, token_budget=65_536)
    plan = odc.balance(lengths, ranks=4, token_budget=65_536, split=True)
    assert covered(plan, lengths) == lengths
    pieces = plan.pieces
    assert len(pieces) >= 2 and {p.sample for p in pieces} == {0}
    assert [p.member for p in pieces] == list(range(len(pieces)))
    assert all(p.ranks == pieces[0].ranks for p in pieces)
    assert max(plan.rank_costs()) < max(whole.rank_costs())
    assert "1 samples split" in repr(plan)
    # A floor above the sample: nothing split.
    kept = odc.balance(lengths, ranks=4, token_budget=65_536, split=True, min_split_tokens=100_000)
    assert kept.pieces == []


def test_numpy_arrays_and_tuples_are_lengths_too():
    from_list = odc.balance(LENGTHS, 2, 65_536).samples()
    assert odc.balance(np.array(LENGTHS, dtype=np.int64), 2, 65_536).samples() == from_list
    assert odc.balance(np.array(LENGTHS, dtype=np.uint32), 2, 65_536).samples() == from_list
    assert odc.balance(tuple(LENGTHS), 2, 65_536).samples() == from_list


def test_a_cost_model_fitted_to_a_measured_table_recovers_it():
    truth = odc.CostModel(a=4.0, b=9.0)
    lengths = [1_000, 4_000, 16_000, 32_000, 64_000]
    fitted = odc.CostModel.fit(lengths, [truth.cost(n) for n in lengths])
    assert fitted.a == pytest.approx(4.0) and fitted.b == pytest.approx(9.0)
    assert "CostModel(a=" in repr(fitted)
    assert odc.CostModel.linear().cost(64_000) == pytest.approx(
        2 * odc.CostModel.linear().cost(32_000)
    )
    plan = odc.balance(LENGTHS, 2, 65_536, cost=fitted)
    assert covered(plan, LENGTHS) == LENGTHS


@pytest.mark.parametrize(
    ("call", "error", "says"),
    [
        (
            lambda: odc.balance(LENGTHS, 2, 65_536, dispatch="lb-mini"),
            odc.InvalidArgument,
            "lb-mini",
        ),
        (lambda: odc.balance([1, -2], 2, 100), odc.InvalidArgument, "length 1 is -2"),
        (lambda: odc.balance([1, 2.5], 2, 100), odc.InvalidArgument, "length 1 is 2.5"),
        (lambda: odc.balance(np.ones((2, 2), dtype=int), 2, 100), odc.InvalidArgument, "(2, 2)"),
        (lambda: odc.balance(LENGTHS, -1, 100), odc.InvalidArgument, "ranks"),
        (
            lambda: odc.balance(LENGTHS, 2, 65_536, split=True, dispatch="equal"),
            odc.InvalidArgument,
            "equal",
        ),
        (lambda: odc.balance([], 2, 100), odc.BalanceError, "no samples"),
        (lambda: odc.balance(LENGTHS, 0, 65_536), odc.BalanceError, "trainer"),
        (lambda: odc.balance([100_000], 2, 65_536), odc.BalanceError, "100000"),
        (lambda: odc.CostModel(a=-1.0, b=1.0), odc.BalanceError, "-1"),
        (
            lambda: odc.CostModel.fit([1_000, 1_000], [1.0, 1.0]),
            odc.InvalidArgument,
            "two different",
        ),
    ],
)
def test_every_bad_input_is_a_named_exception(call, error, says):
    with pytest.raises(error) as caught:
        call()
    assert says in str(caught.value)
    assert isinstance(caught.value, odc.Error)


def test_a_bad_argument_is_also_a_value_error():
    with pytest.raises(ValueError):
        odc.balance(LENGTHS, 2, 65_536, dispatch="lb-mini")


def test_the_data_loader_example_in_the_docs_runs():
    """The ten lines docs/python.md shows, run as they are written."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)
    loader = next(b for b in blocks if "odc.balance" in b)
    assert len(loader.strip().splitlines()) <= 12
    scope = {}
    exec(compile(loader, str(DOCS), "exec"), scope)
    batches = scope["my_micro_batches"]
    assert sorted(s for mb in batches for s in mb) == sorted(
        s for mb in scope["plan"].samples()[scope["rank"]] for s in mb
    )
