"""The weights channel's plan, buckets and input checks (``agang._weights``), in process."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from agang._weights import checks
from agang._weights.buckets import GRAIN, Buckets, copy_bytes, copy_views
from agang._weights.plan import FIRST_BUCKET_BYTES, HEADER_BYTES, Plan


def tensors(**shapes: tuple[int, ...]) -> dict[str, torch.Tensor]:
    return {name: torch.randn(*shape) for name, shape in shapes.items()}


def test_the_fingerprint_covers_names_order_shapes_and_dtypes_only() -> None:
    base = Plan.of({"a": torch.zeros(2, 3), "b": torch.zeros(4)})
    same = Plan.of({"a": torch.ones(2, 3), "b": torch.ones(4)}, bucket_bytes=4096)
    assert base.fingerprint == same.fingerprint  # values and bucket size do not count
    others = [
        {"a": torch.zeros(3, 2), "b": torch.zeros(4)},  # shape
        {"a": torch.zeros(2, 3, dtype=torch.float64), "b": torch.zeros(4)},  # dtype
        {"b": torch.zeros(4), "a": torch.zeros(2, 3)},  # order
        {"a": torch.zeros(2, 3), "c": torch.zeros(4)},  # name
        {"a": torch.zeros(2, 3)},  # count
    ]
    assert len({base.fingerprint, *(Plan.of(t).fingerprint for t in others)}) == 6


def test_a_difference_names_the_first_differing_tensor_on_both_sides() -> None:
    mine = Plan.of({"a": torch.zeros(2), "b": torch.zeros(5, 3), "c": torch.zeros(1)})
    theirs = Plan.of({"a": torch.zeros(2), "b": torch.zeros(4, 3), "c": torch.zeros(2)})
    assert mine.difference(mine) is None
    assert mine.difference(theirs) == (
        "tensor #1 is 'b' float32[5, 3] here, and 'b' float32[4, 3] in the publisher's plan"
    )
    fewer = Plan.of({"a": torch.zeros(2)})
    message = mine.difference(fewer)
    assert message is not None
    assert "tensor #1, 'b' float32[5, 3] here" in message, message


def test_the_plan_survives_the_store_and_refuses_a_forged_fingerprint() -> None:
    plan = Plan.of(tensors(a=(3,), b=(2, 2)), bucket_bytes=2048)
    assert Plan.from_text(plan.to_text()) == plan
    forged = plan.to_text().replace(plan.fingerprint, "0" * 32)
    with pytest.raises(ValueError, match="fingerprint"):
        Plan.from_text(forged)


def test_small_tensors_are_packed_behind_the_header_and_large_ones_move_directly() -> None:
    model = {
        "w1": torch.zeros(100),  # 400 bytes
        "big": torch.zeros(2048),  # 8 KiB: a direct bucket
        "w2": torch.zeros(400),  # 1600 bytes: does not fit after w1 in 2 KiB
        "empty": torch.zeros(0),
        "w3": torch.zeros(10, dtype=torch.int8),
    }
    layout = Plan.of(model, bucket_bytes=2048).buckets()
    assert [direct for direct, _, _ in layout] == [False, False, True]
    (_, size0, parts0), (_, size1, parts1), *direct = layout
    assert parts0 == [(0, HEADER_BYTES, 400, 0)]
    assert size0 == HEADER_BYTES + 400
    assert parts1 == [(2, 0, 1600, 0), (4, 1600, 10, 0)]  # offsets aligned to 64 bytes
    assert size1 == 1610
    assert [(size, parts) for _, size, parts in direct] == [(8192, [(1, 0, 8192, 0)])]
    # Split (a sharded trainer's plan), "big" moves in buckets of 2 KiB.
    split = Plan.of(model, bucket_bytes=2048, split=True).buckets()
    assert [(size, parts) for direct, size, parts in split if direct] == [
        (2048, [(1, 0, 2048, start)]) for start in range(0, 8192, 2048)
    ]
    assert [b for b in split if not b[0]] == layout[:2]


def test_a_large_tensor_is_cut_between_rows_and_no_bucket_is_over_bucket_bytes() -> None:
    """Rule 3: a split plan's direct buckets hold whole rows of dimension 0, at most
    ``bucket_bytes`` (a sharded side moves its share of one as one view); a row larger
    than a bucket is a bucket of its own. Split is stored, and not fingerprinted."""
    model = {"rows": torch.zeros(10, 3), "wide": torch.zeros(3, 400), "scalar": torch.zeros(())}
    plan = Plan.of(model, bucket_bytes=1024, split=True)
    assert Plan.from_text(plan.to_text()) == plan
    assert plan.fingerprint == Plan.of(model, bucket_bytes=1024).fingerprint
    direct = [parts[0] for is_direct, _, parts in plan.buckets() if is_direct]
    assert [(i, n, start) for i, _, n, start in direct] == [
        (1, 1600, 0),
        (1, 1600, 1600),
        (1, 1600, 3200),
    ]  # "wide": a row of 1600 bytes, over the bucket, alone in each
    smaller = Plan.of({"m": torch.zeros(100, 7)}, bucket_bytes=1024, split=True).buckets()
    cuts = [(n, start) for is_direct, _, parts in smaller if is_direct for _, _, n, start in parts]
    assert all(n <= 1024 and n % 28 == 0 and start % 28 == 0 for n, start in cuts), cuts
    assert sum(n for n, _ in cuts) == 2800
    assert plan.row_bytes(2) == 4
    assert plan.row_bytes(1) == 1600


def test_a_model_of_one_large_tensor_has_a_header_only_bucket_0() -> None:
    layout = Plan.of({"x": torch.zeros(4096)}, bucket_bytes=1024).buckets()
    assert layout == [(False, HEADER_BYTES, []), (True, 16384, [(0, 0, 16384, 0)])]


def test_a_model_that_fits_one_bucket_moves_whole_in_bucket_0() -> None:
    # 16 tensors of 64 KiB: past bucket 0's usual bound, within one bucket.
    model = {f"w{i}": torch.zeros(16384) for i in range(16)}
    whole = Plan.of(model, bucket_bytes=4 * FIRST_BUCKET_BYTES).buckets()
    assert len(whole) == 1
    assert whole[0][1] == HEADER_BYTES + 16 * 65536
    # Exactly a bucket's bytes: one bucket, its header aside (one round trip, not two).
    exact = Plan.of(model, bucket_bytes=16 * 65536).buckets()
    assert [(direct, nbytes) for direct, nbytes, _ in exact] == [(False, HEADER_BYTES + 16 * 65536)]
    # One byte more than a bucket holds: bucket 0 keeps its usual bound.
    split = Plan.of(model, bucket_bytes=16 * 65536 - 1).buckets()
    assert len(split) == 2
    assert split[0][1] <= FIRST_BUCKET_BYTES
    assert sum(len(parts) for _, _, parts in split) == 16


@pytest.fixture(params=[1, 2], ids=["one-thread", "two-threads"])
def intra_op_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch's intra-op threads: one copies whole, more in ``GRAIN``'s pieces
    (``agang._weights.buckets`` rule 4)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.usefixtures("intra_op_threads")
def test_buckets_move_every_byte_of_every_dtype(in_place: bool) -> None:
    source = {
        "f": torch.randn(33),
        "d": torch.randn(4, 5, dtype=torch.float64),
        "i": torch.randint(-9, 9, (7,), dtype=torch.int64),
        "b": torch.rand(9) > 0.5,
        "h": torch.randn(3, dtype=torch.bfloat16),
        "big": torch.randn(1000),
        "scalar": torch.tensor(2.5),
    }
    plan = Plan.of(source, bucket_bytes=1024)
    sender = Buckets(plan, source, publisher=True, in_place=True)
    target = {k: torch.zeros_like(v) for k, v in source.items()}
    receiver = Buckets(plan, target, publisher=False, in_place=in_place)
    for index, wire in enumerate(sender.wire):
        sender.fill(index)
        receiver.wire[index].copy_(wire)  # what a broadcast does
    receiver.unpack()
    for name in source:
        assert torch.equal(target[name], source[name]), name
    big_bytes = 4000
    assert receiver.staging_bytes == (0 if in_place else big_bytes) + sum(
        size for direct, size, _ in plan.buckets() if not direct
    )


@pytest.mark.parametrize(
    ("nbytes", "source_at", "target_at"),
    [(8 * GRAIN * 3 + 8, 0, 64), (4 * GRAIN + 4, 4, 12), (2 * GRAIN + 2, 2, 6), (GRAIN + 1, 3, 0)],
)
@pytest.mark.usefixtures("intra_op_threads")
def test_copy_bytes_moves_every_byte_at_any_alignment_in_pieces(
    nbytes: int, source_at: int, target_at: int
) -> None:
    """Each width (8, 4, 2, 1 bytes), several pieces of ``GRAIN`` words (rule 4)."""
    source = torch.randint(0, 256, (source_at + nbytes,), dtype=torch.uint8)[source_at:]
    target = torch.zeros(target_at + nbytes + 5, dtype=torch.uint8)
    copy_bytes(target[target_at : target_at + nbytes], source)
    assert torch.equal(target[target_at : target_at + nbytes], source)
    assert not target[:target_at].any()
    assert not target[target_at + nbytes :].any()


@pytest.mark.parametrize("strided", [False, True], ids=["rows", "columns"])
@pytest.mark.usefixtures("intra_op_threads")
def test_copy_views_moves_a_share_contiguous_or_strided(strided: bool) -> None:
    """A sharded side's share (``copy_views``): rows of a bucket, or a ``Shard(1)``
    block of columns, over more than ``GRAIN`` elements (rule 4)."""
    came = torch.randn(3 * GRAIN // 16 + 1, 16)
    bucket = torch.zeros(came.shape[0], 40)
    into = bucket[:, 8:24] if strided else bucket[:, :16].contiguous()
    copy_views(into, came)
    assert torch.equal(into, came)
    if strided:
        assert not bucket[:, :8].any()
        assert not bucket[:, 24:].any()


@pytest.mark.parametrize(
    ("tensors", "error", "words"),
    [
        ([torch.zeros(1)], TypeError, "`tensors` must be a mapping"),
        ({}, ValueError, "`tensors` must hold at least one tensor"),
        ({"a": 1}, TypeError, "`tensors['a']` must be a tensor"),
        ({3: torch.zeros(1)}, TypeError, "non-empty str names"),
        ({"a": torch.zeros(4, 4).t()}, ValueError, "`tensors['a']` must be contiguous"),
        ({"a": torch.zeros(2, dtype=torch.complex64).conj()}, ValueError, "lazy"),
        ({"a": torch.zeros(1), "b": torch.zeros(1, device="meta")}, ValueError, "one device"),
        ({"a": torch.zeros(1, device="meta")}, ValueError, "on the CPU"),
    ],
)
def test_tensors_are_checked_naming_the_parameter(
    tensors: object, error: type[Exception], words: str
) -> None:
    with pytest.raises(error) as raised:
        checks.check_tensors(tensors)
    assert words in str(raised.value)


def test_the_other_inputs_are_checked_naming_the_parameter() -> None:
    with pytest.raises(ValueError, match="`channel` must be a non-empty str"):
        checks.check_channel("")
    with pytest.raises(TypeError, match="`channel` must be a str"):
        checks.check_channel(3)
    # agang's one rule for a timeout (elastic gangs' too): None is the default,
    # math.inf none, a number seconds.
    with pytest.raises(ValueError, match="`timeout` must be a non-negative number"):
        checks.check_deadline(-1)
    with pytest.raises(TypeError, match="`timeout` must be a number of seconds or None"):
        checks.check_deadline("5")
    assert checks.check_deadline(None) is None
    assert checks.check_deadline(None, default=60.0) == 60.0
    assert checks.check_deadline(math.inf, default=60.0) is None
    assert checks.check_deadline(0.5) == 0.5
    with pytest.raises(ValueError, match="`store` must be 'HOST:PORT'"):
        checks.check_store("localhost")
    assert checks.check_store("[::1]:29500") == ("::1", 29500)
    with pytest.raises(TypeError, match="`version` must be an int"):
        checks.check_version(1.0, None)
    with pytest.raises(TypeError, match="`version` must be an int"):
        checks.check_version(True, None)
    with pytest.raises(ValueError, match="`version` must increase: 3 is not above the last"):
        checks.check_version(3, 3)
    assert checks.check_version(4, 3) == 4
    with pytest.raises(ValueError, match="`name` must be a non-empty str"):
        checks.check_name("a b")
    with pytest.raises(ValueError, match="`bucket_bytes` must be at least 1024"):
        Plan.of({"a": torch.zeros(1)}, bucket_bytes=10)
