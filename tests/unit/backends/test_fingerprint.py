"""The split-size check's arithmetic (``agang._backends.fingerprint``): balances cancel exactly when
every pair of ranks agrees, and the report names each pair that does not."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agang._backends import fingerprint

OP = "all_to_all(split, float32[*, 4])"

# rows[i][j]: the rows rank i sends to rank j, as every rank agrees.
matrices = st.integers(1, 6).flatmap(
    lambda size: st.lists(
        st.lists(st.integers(0, 1000), min_size=size, max_size=size),
        min_size=size,
        max_size=size,
    )
)


def texts(sends: list[list[int]], receives: list[list[int]]) -> dict[int, str]:
    return {
        rank: fingerprint.with_flows(OP, sends[rank], receives[rank]) for rank in range(len(sends))
    }


def transposed(rows: list[list[int]]) -> list[list[int]]:
    return [list(column) for column in zip(*rows, strict=True)]


@given(matrices)
def test_sizes_that_agree_balance_to_zero(rows: list[list[int]]) -> None:
    fingerprints = texts(rows, transposed(rows))

    assert fingerprint.balanced(
        [fingerprint.balance(rank, text) for rank, text in fingerprints.items()]
    )
    assert fingerprint.disagreements(fingerprints) == []
    assert fingerprint.agree(fingerprints)


@given(matrices, st.data())
def test_any_one_disagreement_unbalances_and_is_named(
    rows: list[list[int]], data: st.DataObject
) -> None:
    size = len(rows)
    receives = transposed(rows)
    source = data.draw(st.integers(0, size - 1))
    destination = data.draw(st.integers(0, size - 1))
    expected = data.draw(st.integers(0, 1000).filter(lambda n: n != rows[source][destination]))
    receives[destination][source] = expected
    fingerprints = texts(rows, receives)

    balances = [fingerprint.balance(rank, text) for rank, text in fingerprints.items()]
    assert all(-(2**63) <= value < 2**63 for value in balances)  # what an int64 holds
    assert not fingerprint.balanced(balances)
    assert fingerprint.disagreements(fingerprints) == [
        f"rank {source} sends {rows[source][destination]} rows to rank {destination}, "
        f"which expects {expected}"
    ]
    assert not fingerprint.agree(fingerprints)


def test_a_fingerprint_without_sizes_balances_to_nothing_and_compares_whole() -> None:
    assert fingerprint.balance(3, "all_reduce(SUM, float32[4])") == 0
    assert fingerprint.split("all_reduce(SUM, float32[4])") == ("all_reduce(SUM, float32[4])", None)
    assert not fingerprint.agree({0: "all_reduce(SUM, float32[4])", 1: "barrier()"})


def test_the_call_site_goes_on_the_op_line_and_the_sizes_survive() -> None:
    text = fingerprint.at_call_site(fingerprint.with_flows(OP, [2, 0], [1, 3]), "train.py:12")

    assert fingerprint.split(text) == (f"{OP} at train.py:12", fingerprint.Flows((2, 0), (1, 3)))
    assert fingerprint.at_call_site("barrier()", "train.py:9") == "barrier() at train.py:9"


def test_ranks_of_different_ops_never_agree_even_with_sizes_that_do() -> None:
    fingerprints = {
        0: fingerprint.with_flows(OP, [1, 1], [1, 1]),
        1: fingerprint.with_flows("all_to_all(split, float32[*, 8])", [1, 1], [1, 1]),
    }

    assert fingerprint.disagreements(fingerprints) == []
    assert not fingerprint.agree(fingerprints)


def test_a_report_names_a_bounded_number_of_pairs_whatever_the_gangs_size() -> None:
    from agang._engine import reports
    from agang._errors import OpContext

    size = 40
    # Every rank expects one row more from each peer than the peer sends.
    fingerprints = {
        rank: fingerprint.with_flows(
            OP, [1] * size, [2 if peer != rank else 1 for peer in range(size)]
        )
        for rank in range(size)
    }

    kept = fingerprint.named(fingerprints)
    context = OpContext(gang="root", rank=0, size=size, op="all_to_all", seq=3, timeout=None)
    message = str(reports.mismatch(context, 3, kept))

    assert len(kept) <= 2 * fingerprint.MAX_NAMED
    assert all(kept[rank] == fingerprints[rank] for rank in kept)
    assert "rank 0 sends 1 rows to rank 1, which expects 2" in message
    assert message.count("rows to rank") == fingerprint.MAX_NAMED
    assert "; ..." in message
