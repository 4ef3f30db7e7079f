"""What a collective's arguments are checked against, and the checks of its tensors.

A ``Group`` is one gang as its collectives see it: this rank's place, and the
device and dtypes its backend takes. Each collective's check-and-describe function
(``even``, ``rooted``, ``uneven``, ``objects``) checks its tensors against it with
``Group.tensor`` and the shape, dtype and split-size checks here, then describes the op.
The scalar checks (timeouts, ranks, ints) are ``agang._validate``'s, shared with set-up.

Every message follows ``agang._validate``'s template: the parameter in backticks, what
was expected, and what was given. Tensor checks are per backend because Gloo and NCCL
accept different dtypes.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

from agang._backends.contract import Backend
from agang._reduce_op import ReduceOp


@dataclass(frozen=True, slots=True)
class Group:
    """One gang as its collectives check arguments against it."""

    rank: int
    size: int
    device: torch.device
    #: The backend's kind: ``"gloo"``, ``"nccl"`` or ``"fake"``.
    kind: str
    #: The dtypes the backend's collectives accept, less the complex ones: those that
    #: ``is_usual_tensor`` passes at once.
    real_dtypes: frozenset[torch.dtype]

    @classmethod
    def of(cls, backend: Backend) -> Group:
        real_dtypes = supported_dtypes(backend.kind) - _COMPLEX
        return cls(backend.rank, backend.size, backend.device, backend.kind, real_dtypes)

    def tensor(self, value: object, name: str) -> torch.Tensor:
        """``value``, checked as a tensor this gang can send, named ``name`` in errors."""
        if is_usual_tensor(value, self.device, self.real_dtypes):  # at once, no message made
            return value
        return check_tensor(value, name=name, device=self.device, backend=self.kind)


_GLOO_DTYPES = frozenset(
    {
        torch.bool,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    }
)
_NCCL_DTYPES = _GLOO_DTYPES | {torch.float8_e4m3fn, torch.float8_e5m2}
_COMPLEX = frozenset({torch.complex32, torch.complex64, torch.complex128})
_STRIDED = torch.strided


def supported_dtypes(backend: str) -> frozenset[torch.dtype]:
    """The dtypes the backend's collectives accept (measured for Gloo: int16 is refused)."""
    if backend == "nccl":
        return _NCCL_DTYPES
    return _GLOO_DTYPES


def check_tensor(
    tensor: object,
    *,
    name: str,
    device: torch.device,
    backend: str,
) -> torch.Tensor:
    """Checks that ``tensor`` is a dense, contiguous tensor the gang can send."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"`{name}` must be a `torch.Tensor`, but is of type `{type(tensor).__name__}` instead."
        )
    if tensor.layout != torch.strided:
        raise TypeError(
            f"`{name}` must be a dense (strided) tensor, but has layout {tensor.layout} instead."
        )
    if tensor.device != device:
        raise ValueError(
            f"`{name}` must be on the gang's device ({device}), but is on {tensor.device} instead."
        )
    if not tensor.is_contiguous():
        raise ValueError(
            f"`{name}` must be contiguous, but has strides {tensor.stride()} for shape "
            f"{tuple(tensor.shape)} instead; call `.contiguous()` first."
        )
    if tensor.dtype not in supported_dtypes(backend):
        raise TypeError(
            f"`{name}` must have a dtype the {backend} backend supports, "
            f"but has dtype {tensor.dtype} instead."
        )
    # A lazily conjugated or negated view (``x.conj()``, the ``.imag`` of one) keeps the
    # values before the conjugation or negation in memory, and torch applies it only
    # where the values are read. A backend moves the memory: on Gloo a negated view is
    # reduced un-negated (a wrong result, and no error), and a conjugated one fails once
    # issued, which breaks the gang on every rank. So both are refused before issue.
    if tensor.is_conj():
        raise ValueError(
            f"`{name}` must hold its values in memory, but is a lazily conjugated view "
            f"(`is_conj()` is True) instead; call `.resolve_conj()` first."
        )
    if tensor.is_neg():
        raise ValueError(
            f"`{name}` must hold its values in memory, but is a lazily negated view "
            f"(`is_neg()` is True) instead; call `.resolve_neg()` first."
        )
    return tensor


def is_usual_tensor(
    tensor: object, device: torch.device, real_dtypes: frozenset[torch.dtype]
) -> TypeGuard[torch.Tensor]:
    """Whether ``tensor`` passes ``check_tensor``, in one expression: the usual tensor
    costs no more. ``real_dtypes`` are the backend's dtypes less the complex ones: a real
    tensor can carry one lazy flag (negation), tested here, and a complex one two
    (negation and conjugation), so complex tensors, which are rare, take the full check
    and the usual tensor pays one flag test. Any other goes to ``check_tensor``,
    which names its first fault."""
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.layout is _STRIDED
        and tensor.device == device
        and tensor.is_contiguous()
        and tensor.dtype in real_dtypes
        and not tensor.is_neg()
    )


def check_reduce_dtype(tensor: torch.Tensor, op: ReduceOp, *, name: str) -> None:
    """Checks the combinations of dtype and reduce op that no backend defines."""
    if op is ReduceOp.MEAN and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(
            f"`{name}` must have a floating-point or complex dtype for ReduceOp.MEAN, "
            f"but has dtype {tensor.dtype} instead."
        )
    if tensor.is_complex() and op not in (ReduceOp.SUM, ReduceOp.MEAN):
        raise TypeError(
            f"`{name}` must have a real dtype for {op}, but has dtype {tensor.dtype} instead "
            f"(complex tensors support SUM and MEAN only)."
        )


def check_same_dtype(output: torch.Tensor, input: torch.Tensor) -> None:
    if output.dtype != input.dtype:
        raise TypeError(
            f"`output` must have the dtype of `input` ({input.dtype}), "
            f"but has dtype {output.dtype} instead."
        )


def check_shape(tensor: torch.Tensor, expected: Sequence[int], *, name: str) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(
            f"`{name}` must have shape {tuple(expected)}, but has shape "
            f"{tuple(tensor.shape)} instead."
        )


def check_stacked_or_concatenated(
    tensor: torch.Tensor, size: int, part: Sequence[int], *, name: str
) -> None:
    """``tensor`` holds one ``part``-shaped block per rank, in either layout: stacked,
    ``[size, *part]``, or concatenated along the first dimension,
    ``[size * part[0], *part[1:]]`` (c10d's ``all_gather_into_tensor`` and
    ``reduce_scatter_tensor`` layout). Both are the same bytes in the same order."""
    part = tuple(part)
    stacked = (size, *part)
    if tuple(tensor.shape) == stacked:
        return
    if part:
        concatenated = (size * part[0], *part[1:])
        if tuple(tensor.shape) == concatenated:
            return
        layouts = f"{stacked} (stacked) or {concatenated} (concatenated)"
    else:
        layouts = f"{stacked}"
    raise ValueError(
        f"`{name}` must have shape {layouts}, but has shape {tuple(tensor.shape)} instead."
    )


def check_tensor_list(tensors: object, *, name: str, length: int | None) -> list[Any]:
    """``tensors`` as a list; ``length`` (one per rank) unless None."""
    if not isinstance(tensors, list | tuple):
        raise TypeError(
            f"`{name}` must be a list of tensors, but is of type `{type(tensors).__name__}` "
            f"instead."
        )
    if length is not None and len(tensors) != length:
        raise ValueError(
            f"`{name}` must have one tensor per rank ({length}), but has {len(tensors)} instead."
        )
    return list(tensors)


def check_distinct(tensors: Sequence[torch.Tensor], *, name: str) -> None:
    """Two arguments of one op must not share memory unless the op is in-place.

    Sorts the address ranges (n log n): gradient lists have thousands of tensors.
    """
    ranges = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t.numel()
    )
    for (_, first_end), (second_start, _) in itertools.pairwise(ranges):
        if second_start < first_end:
            raise ValueError(
                f"`{name}` must not overlap in memory, but two of its tensors do; "
                f"pass separate buffers."
            )


def check_apart(tensors: Sequence[tuple[str, torch.Tensor, bool]]) -> None:
    """No tensor that the op writes overlaps another of its tensors in memory.

    ``tensors`` are ``(name, tensor, written)``. Tensors only read may overlap each
    other (exchange sends one tensor to several peers). A written one must not: the op
    writes it while it still reads (or writes) the other, and the backend does not say
    in which order, so the ranks would get some rows already overwritten, and no error.

    Sorts the address ranges by start (n log n: an exchange may hold many transfers): a
    range overlaps an earlier one iff it starts before the furthest end so far, so
    keeping that end over all ranges and over written ones finds every overlap that
    involves a written tensor.
    """
    ranges = sorted(
        (t.data_ptr(), t.data_ptr() + t.nbytes, name, written)
        for name, t, written in tensors
        if t.nbytes
    )
    furthest: tuple[int, str] = (-1, "")
    furthest_written: tuple[int, str] = (-1, "")
    for start, end, name, written in ranges:
        other = furthest if written else furthest_written
        if start < other[0]:
            written_name, other_name = (name, other[1]) if written else (other[1], name)
            raise ValueError(
                f"`{written_name}` must not overlap `{other_name}` in memory, but does; "
                f"pass separate buffers."
            )
        if end > furthest[0]:
            furthest = (end, name)
        if written and end > furthest_written[0]:
            furthest_written = (end, name)


def check_root_only(value: object, *, is_root: bool, name: str, root: str) -> None:
    """``value`` (a tensor the op only uses on its root) is given on the root, named
    ``root`` in messages, and None on every other rank, where it would be ignored."""
    if is_root and value is None:
        raise TypeError(f"`{name}` must be a tensor on the {root}, but is None instead.")
    if not is_root and value is not None:
        raise ValueError(
            f"`{name}` must be None on ranks other than the {root}, but is of type "
            f"`{type(value).__name__}` instead."
        )


def check_split_sizes(sizes: object, size: int, *, name: str) -> list[int]:
    """``sizes`` as a list of ``size`` non-negative ints: rows per rank along dim 0."""
    if isinstance(sizes, str | bytes) or not isinstance(sizes, Sequence):
        raise TypeError(
            f"`{name}` must be a sequence of ints, but is of type `{type(sizes).__name__}` instead."
        )
    if len(sizes) != size:
        raise ValueError(
            f"`{name}` must have one size per rank ({size}), but has {len(sizes)} instead."
        )
    checked = []
    for value in sizes:
        try:  # ints, and what stands for one (NumPy's, a 0-dim integer tensor)
            if isinstance(value, bool):
                raise TypeError
            number = operator.index(value)
        except TypeError:
            raise TypeError(
                f"`{name}` must contain ints only, but contains {value!r} of type "
                f"`{type(value).__name__}` instead."
            ) from None
        if number < 0:
            raise ValueError(
                f"`{name}` must contain sizes of 0 or more, but contains {number} instead."
            )
        checked.append(number)
    return checked


def check_rows(tensor: torch.Tensor, sizes: Sequence[int], *, name: str, sizes_name: str) -> None:
    """``tensor`` has ``sum(sizes)`` rows (its first dimension), as ``sizes_name`` says."""
    if tensor.dim() == 0 or tensor.shape[0] != sum(sizes):
        raise ValueError(
            f"`{name}` must have a first dimension of sum(`{sizes_name}`) = {sum(sizes)}, but "
            f"has shape {tuple(tensor.shape)} instead."
        )


def check_trailing_shape(output: torch.Tensor, input: torch.Tensor) -> None:
    """``output`` and ``input`` agree past their first dimension (rows of one shape)."""
    if output.dim() == 0 or tuple(output.shape[1:]) != tuple(input.shape[1:]):
        raise ValueError(
            f"`output` must have the shape of `input` past the first dimension "
            f"({tuple(input.shape[1:])}), but has shape {tuple(output.shape)} instead."
        )
