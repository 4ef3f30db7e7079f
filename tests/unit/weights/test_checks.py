"""The weights channel's input checks (``agang._weights.checks``), in process: every
tensor the byte-level buckets cannot move is refused at ``open``, naming it and saying
what to do, and every other dtype moves byte for byte; a version is an int64; a channel's
and a subscriber's name are short and plain.

The tensors that crashed the process (a quantized tensor, a freed storage) are also run
through the buckets in a process of their own, so that a check that lets one through is
a failed test, not a crashed run.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from agang._weights import checks
from agang._weights.buckets import Buckets
from agang._weights.plan import Plan

# torch's warnings about the kinds tested here: quantized tensors are deprecated, the
# others experimental (refusing them, or moving them, is what is tested).
pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning"),
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning"),
    pytest.mark.filterwarnings("ignore:Sparse CSR tensor support:UserWarning"),
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning"),
]

BUCKET_BYTES = 1024
QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
# Every dtype torch has (``torch.bit`` and the other aliases once each).
DTYPES = sorted(
    {d for d in vars(torch).values() if isinstance(d, torch.dtype)},
    key=str,
)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


def random_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, its bytes random (NaNs, odd bools and all)."""
    view = as_bytes(tensor)
    view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8))
    return tensor


def move(published: dict[str, torch.Tensor], received: dict[str, torch.Tensor]) -> None:
    """One round, ``published`` to ``received``, as the channel moves it: the publisher's
    buckets filled, each wire buffer copied into the subscriber's, then unpacked. Both
    subscriber layouts (staged and in place); the bytes must come over exact."""
    plan = Plan.of(checks.check_tensors(published), BUCKET_BYTES)
    assert Plan.of(checks.check_tensors(received), BUCKET_BYTES).fingerprint == plan.fingerprint
    publisher = Buckets(plan, published, publisher=True, in_place=True)
    for index in range(len(publisher.wire)):
        publisher.fill(index)
    for in_place in (False, True):
        for tensor in received.values():
            as_bytes(tensor).fill_(0x5A)
        subscriber = Buckets(plan, received, publisher=False, in_place=in_place)
        for wire, sent in zip(subscriber.wire, publisher.wire, strict=True):
            wire.copy_(sent)
        subscriber.unpack()
        for name, tensor in published.items():
            assert torch.equal(as_bytes(received[name]), as_bytes(tensor)), (name, in_place)


def of_dtype(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors of ``dtype`` in every place a bucket puts one: packed at odd offsets (after
    a 3-float tensor), a 0-dim one, an empty one, and one big enough for a direct bucket."""
    size = torch.empty(0, dtype=dtype).element_size()
    shapes: dict[str, tuple[int, ...]] = {
        "x": (37,),
        "y": (2, 3, 5),
        "scalar": (),
        "empty": (0, 4),
        "big": (BUCKET_BYTES // size + 7,),
    }
    made = {"head": torch.randn(3)}
    made.update({name: torch.empty(shape, dtype=dtype) for name, shape in shapes.items()})
    return made


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_moves_byte_exact_or_is_refused(dtype: torch.dtype) -> None:
    try:
        published = of_dtype(dtype)
    except (RuntimeError, TypeError) as error:
        pytest.skip(f"torch makes no tensor of {dtype} here: {error}")
    if dtype in QUANTIZED:
        # Refused before any byte moves: moving them crashed the process.
        with pytest.raises(ValueError, match=r"`tensors\['x'\]` must not be quantized"):
            checks.check_tensors(published)
        return
    directs = [direct for direct, _, _ in Plan.of(published, BUCKET_BYTES).buckets()]
    assert not directs[0], directs  # bucket 0 packed (the header), ...
    assert directs.count(True) == 1, directs  # ... and "big" in a direct bucket
    for tensor in published.values():
        random_bytes(tensor)
    received = {name: torch.empty_like(tensor) for name, tensor in published.items()}
    move(published, received)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64])
def test_tensors_that_require_grad_move_byte_exact(dtype: torch.dtype) -> None:
    """The buckets read and write them through uint8 views, which autograd does not track
    (no ``no_grad`` needed): a subscriber's Parameters are written in place."""
    published = {
        "w": random_bytes(torch.empty(300, dtype=dtype)).requires_grad_(),
        "p": torch.nn.Parameter(random_bytes(torch.empty(5, 7, dtype=dtype))),
    }
    received = {
        "w": torch.zeros(300, dtype=dtype, requires_grad=True),
        "p": torch.nn.Parameter(torch.zeros(5, 7, dtype=dtype)),
    }
    move(published, received)
    assert all(t.requires_grad for t in received.values())


def test_other_tensors_that_hold_their_bytes_move_byte_exact() -> None:
    class Plain(torch.Tensor):  # a subclass without a __torch_dispatch__ of its own
        pass

    with torch.inference_mode():
        inference = torch.randn(6)
    published = {
        "view": torch.randn(40)[3:11],  # a storage offset
        "expanded": torch.randn(4)[None].expand(1, 4),  # contiguous: its size-1 dim
        "channels_last": torch.randn(1, 3, 1, 1).to(memory_format=torch.channels_last),
        "subclass": torch.randn(5).as_subclass(Plain),
        "inference": inference,
        "zero": torch.randn(0),
    }
    received = {name: torch.empty_like(tensor) for name, tensor in published.items()}
    move(published, received)


class Wrapper(torch.Tensor):
    """A wrapper subclass (as DTensor, FakeTensor): its values live in ``held``, not in
    its own storage, which holds no bytes."""

    held: torch.Tensor

    @staticmethod
    def __new__(cls, held: torch.Tensor) -> Wrapper:
        made = torch.Tensor._make_wrapper_subclass(
            cls, held.shape, dtype=held.dtype, device=held.device
        )
        made.held = held
        return made

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        def unwrap(value: Any) -> Any:
            return value.held if isinstance(value, Wrapper) else value

        return func(*map(unwrap, args), **{k: unwrap(v) for k, v in (kwargs or {}).items()})


def freed(numel: int) -> torch.Tensor:
    """A tensor whose storage was resized to 0 under it (as FSDP frees a parameter)."""
    tensor = torch.randn(numel)
    tensor.untyped_storage().resize_(0)
    return tensor


def quantized() -> torch.Tensor:
    return torch.quantize_per_tensor(torch.randn(8), 0.1, 0, torch.qint8)


def per_channel() -> torch.Tensor:
    scales, points = torch.ones(4), torch.zeros(4, dtype=torch.long)
    return torch.quantize_per_channel(torch.randn(4, 8), scales, points, 0, torch.qint8)


# Each kind a byte copy cannot move, and words its refusal must hold after its name.
REFUSED: dict[str, tuple[Any, str]] = {
    "quantized": (quantized, "must not be quantized, but is of dtype qint8 instead"),
    "quantized per channel": (per_channel, "must not be quantized"),
    "quantized 4-bit": (
        lambda: torch.quantize_per_tensor(torch.randn(8), 0.1, 0, torch.quint4x2),
        "must not be quantized, but is of dtype quint4x2",
    ),
    "a quantized dtype's view": (
        lambda: torch.zeros(8, dtype=torch.uint8).view(torch.qint8),
        "must not be quantized",
    ),
    "nested": (
        lambda: torch.nested.nested_tensor([torch.randn(3), torch.randn(5)]),
        "must be a dense (strided) tensor, but is a nested tensor instead",
    ),
    "nested, jagged": (
        lambda: torch.nested.nested_tensor([torch.randn(3), torch.randn(5)], layout=torch.jagged),
        "must be a dense (strided) tensor",
    ),
    "sparse": (lambda: torch.randn(8).to_sparse(), "has layout torch.sparse_coo instead"),
    "sparse CSR": (lambda: torch.randn(4, 4).to_sparse_csr(), "has layout torch.sparse_csr"),
    "a wrapper subclass": (
        lambda: Wrapper(torch.randn(8)),
        "must be a plain tensor, but is a `Wrapper`",
    ),
    "a freed storage": (lambda: freed(8), "its storage has 0 bytes where it needs 32"),
    "a freed storage, direct": (lambda: freed(100_000), "where it needs 400000"),
    "expanded": (lambda: torch.empty(1).expand(8), "must be contiguous"),
    "channels last": (
        lambda: torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last),
        "must be contiguous",
    ),
    "meta": (lambda: torch.empty(8, device="meta"), "must be on the CPU (Gloo) or a CUDA GPU"),
}
if torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
    REFUSED["mkldnn"] = (lambda: torch.randn(8).to_mkldnn(), "has layout torch._mkldnn")


@pytest.mark.parametrize("kind", REFUSED)
def test_a_tensor_the_buckets_cannot_move_is_refused_naming_it(kind: str) -> None:
    make, words = REFUSED[kind]
    # Beside a CPU tensor but one, which is refused as on another device than the first.
    tensors = {"x": make()} if kind == "meta" else {"head": torch.zeros(2), "x": make()}
    with pytest.raises(ValueError, match="must") as refused:
        checks.check_tensors(tensors)
    message = str(refused.value)
    assert words in message, message
    if kind != "meta":
        assert message.startswith("`tensors['x']` must"), message


# A publisher and a subscriber over the tensor that crashed the process, in a process of
# its own: "refused" where the check refuses it, "moved" where the buckets moved it.
_CRASHER = """
import sys, warnings
import torch
from agang._weights import checks
from agang._weights.buckets import Buckets
from agang._weights.plan import Plan

warnings.simplefilter("ignore")
kind = sys.argv[1]
if kind == "quantized":
    make = lambda: torch.quantize_per_tensor(torch.randn(8), 0.1, 0, torch.qint8)
else:
    def make():
        tensor = torch.randn(100_000)
        tensor.untyped_storage().resize_(0)
        return tensor
# The subscriber's tensor: of the same kind where it can be made so, or a plain one.
receiving = make if kind == "quantized" else lambda: torch.zeros(100_000)
sides = []
for publisher, tensors in ((True, {"w": make()}), (False, {"w": receiving()})):
    try:
        checks.check_tensors(tensors)
    except ValueError:
        print("refused", flush=True)
        sys.exit(0)
    sides.append(Buckets(Plan.of(tensors, 1024), tensors, publisher=publisher, in_place=False))
for index, wire in enumerate(sides[0].wire):
    sides[0].fill(index)
    sides[1].wire[index].copy_(wire)
sides[1].unpack()
print("moved", flush=True)
"""


@pytest.mark.slow  # a process of its own, for a crash
@pytest.mark.parametrize("kind", ["quantized", "freed"])
def test_a_tensor_that_crashed_the_process_is_refused_before_any_byte_moves(kind: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _CRASHER, kind],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stdout) == (0, "refused\n"), (
        f"exit status {result.returncode}, stdout {result.stdout!r}, stderr {result.stderr[-2000:]}"
    )


def test_the_refusals_say_what_to_do() -> None:
    with pytest.raises(ValueError, match=r"Send \.int_repr\(\) and the quantization's"):
        checks.check_tensors({"q": quantized()})
    with pytest.raises(ValueError, match=r"\.unbind\(\)"):
        checks.check_tensors({"n": torch.nested.nested_tensor([torch.randn(3), torch.randn(5)])})
    with pytest.raises(ValueError, match=r"\.to_dense\(\)"):
        checks.check_tensors({"s": torch.randn(8).to_sparse()})
    with pytest.raises(ValueError, match=r"DTensor's \.full_tensor\(\)"):
        checks.check_tensors({"d": Wrapper(torch.randn(8))})
    with pytest.raises(ValueError, match="its memory allocated"):
        checks.check_tensors({"f": freed(8)})


# Versions.


@pytest.mark.parametrize("version", [0, 1, 2**62, 2**63 - 1])
def test_a_version_in_int64_is_taken(version: int) -> None:
    assert checks.check_version(version, None) == version


@pytest.mark.parametrize(
    ("version", "shown"),
    [
        (2**63, str(2**63)),
        (2**64 + 5, str(2**64 + 5)),
        (10**5000, "an int of 16610 bits"),  # Python prints no int of over 4300 digits
    ],
    ids=["2**63", "2**64+5", "10**5000"],
)
def test_a_version_past_int64_is_refused_naming_it(version: int, shown: str) -> None:
    with pytest.raises(ValueError, match="`version`") as refused:
        checks.check_version(version, None)
    assert str(refused.value) == (
        f"`version` must be below 2**63 (an int64), but is {shown} instead."
    )


def test_a_negative_version_is_refused_however_long() -> None:
    with pytest.raises(ValueError, match="`version` must be non-negative, but is -1"):
        checks.check_version(-1, None)
    with pytest.raises(ValueError, match="must be non-negative, but is a negative int of"):
        checks.check_version(-(10**5000), None)


def test_the_last_int64_version_follows_the_one_before() -> None:
    assert checks.check_version(2**63 - 1, 2**63 - 2) == 2**63 - 1


# Channel and subscriber names.

# The names the repository's tests, examples, docs and benchmarks use (``channel_of`` of
# bench/bench_weights.py, and a subscriber's default name: HOST:PID), and the longest.
GOOD_NAMES = [
    "w",
    "c",
    "policy",
    "nobody",
    "s0",
    "s1",
    "s12",
    "c3",
    "steady",
    "bench2-1048576-in-place",
    "node-7.cluster.example.com:12345",
    "A_b.c-d:e",
    "a" * 128,
]
# Each refused, with how its message shows it.
BAD_NAMES = [
    ("", "''"),
    ("a b", "'a b'"),
    ("a/b", "'a/b'"),
    ("tab\there", "'tab\\there'"),
    ("new\nline", "'new\\nline'"),
    ("nul\x00", "'nul\\x00'"),
    ("caf\u00e9", "'caf\u00e9'"),
    ("star*", "'star*'"),
    ("a" * 129, f"{'a' * 40!r}... (129 characters)"),
    ("x" * 10_240, f"{'x' * 40!r}... (10240 characters)"),
]


@pytest.mark.parametrize("name", GOOD_NAMES)
def test_the_names_in_use_are_taken(name: str) -> None:
    assert checks.check_channel(name) == name
    assert checks.check_name(name) == name


@pytest.mark.parametrize(("name", "shown"), BAD_NAMES)
def test_a_channel_name_that_is_not_short_and_plain_is_refused(name: str, shown: str) -> None:
    with pytest.raises(ValueError, match="`channel`") as refused:
        checks.check_channel(name)
    assert str(refused.value) == (
        "`channel` must be a non-empty str of at most 128 letters, digits and '._-:' (no '/' "
        f"or spaces), but is {shown} instead."
    )


@pytest.mark.parametrize(("name", "shown"), BAD_NAMES)
def test_a_subscriber_name_that_is_not_short_and_plain_is_refused(name: str, shown: str) -> None:
    with pytest.raises(ValueError, match="`name`") as refused:
        checks.check_name(name)
    assert str(refused.value) == (
        "`name` must be a non-empty str of at most 128 letters, digits and '._-:' (no '/' "
        f"or spaces), but is {shown} instead."
    )


def test_no_name_takes_the_default() -> None:
    assert checks.check_name(None) is None


def test_a_tensor_inside_a_functorch_transform_is_refused() -> None:
    """Its storage is not its values' (vmap's batched tensor has none; functionalize's a
    null data pointer)."""
    messages: list[str] = []

    def check(tensor: torch.Tensor) -> torch.Tensor:
        with pytest.raises(ValueError, match="tensors") as refused:
            checks.check_tensors({"x": tensor})
        messages.append(str(refused.value))
        return tensor

    torch.vmap(check)(torch.zeros(3, 4))
    torch.func.functionalize(check)(torch.zeros(3))
    assert messages[0].startswith("`tensors['x']` must have a storage of its own"), messages
    assert messages[1].startswith("`tensors['x']` must have its bytes in memory"), messages
