"""The public inputs' checks: each error names the parameter and what it got."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from agang._membership.store import parse_address
from agang._validate import check_deadline as check_agang_deadline

#: The dtypes of quantized tensors: their bytes are not all of their value (the scale and
#: zero point are held apart), and copying them as bytes crashed the process.
_QUANTIZED = frozenset({torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4})
#: The most characters of a channel's or a subscriber's name (they are parts of store
#: keys and of Gloo groups' names).
MAX_NAME = 128
_NAME = re.compile(r"[A-Za-z0-9._:-]+")
_NAME_RULE = f"a non-empty str of at most {MAX_NAME} letters, digits and '._-:' (no '/' or spaces)"
_INT64_LIMIT = 2**63
#: The devices a channel's tensors may be on: a transport reaches each (``site``).
_DEVICES = ("cpu", "cuda")


def check_tensors(tensors: object) -> dict[str, torch.Tensor]:
    """``tensors`` as a dict: a non-empty mapping of str to plain dense tensors on one
    device, each a contiguous run of its own bytes that ``agang._weights.buckets`` can
    copy as such: no sparse, nested or quantized tensor, no tensor subclass with a
    ``__torch_dispatch__`` of its own (its values are not its storage's bytes), no
    tensor whose storage is smaller than its bytes (freed, as FSDP does), and no lazy
    (conjugated or negated) view. Every other dtype moves byte for byte; tensors that
    require grad are read and written through uint8 views, which autograd does not
    track."""
    if not isinstance(tensors, Mapping):
        raise TypeError(
            f"`tensors` must be a mapping of names to tensors (a state_dict()), but is of "
            f"type `{type(tensors).__name__}` instead."
        )
    if not tensors:
        raise ValueError("`tensors` must hold at least one tensor, but is empty.")
    checked: dict[str, torch.Tensor] = {}
    device: torch.device | None = None
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"`tensors` must have non-empty str names, but has {name!r}.")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"`tensors['{name}']` must be a tensor, but is of type "
                f"`{type(tensor).__name__}` instead."
            )
        _check_kind(name, tensor)
        if not tensor.is_contiguous():
            raise ValueError(
                f"`tensors['{name}']` must be contiguous, but has strides "
                f"{tuple(tensor.stride())} for shape {tuple(tensor.shape)} instead."
            )
        if tensor.is_conj() or tensor.is_neg():
            raise ValueError(
                f"`tensors['{name}']` must not be a lazy conjugated or negated view: call "
                f".resolve_conj() or .resolve_neg() first."
            )
        if tensor.device.type in _DEVICES:  # the others are refused below
            _check_storage(name, tensor)
        if device is None:
            device = tensor.device
        elif tensor.device != device:
            raise ValueError(
                f"`tensors` must all be on one device, but '{name}' is on {tensor.device} "
                f"and the first on {device}."
            )
        checked[name] = tensor
    assert device is not None
    if device.type not in _DEVICES:
        raise ValueError(
            f"`tensors` must be on the CPU (Gloo) or a CUDA GPU (NCCL), but are on {device}."
        )
    return checked


def device_of(tensors: dict[str, torch.Tensor]) -> torch.device:
    """The one device of ``check_tensors``' result."""
    return next(iter(tensors.values())).device


def _check_kind(name: str, tensor: torch.Tensor) -> None:
    """Refuses the tensors whose values are not one dense run of bytes in their storage."""
    if tensor.is_nested:
        raise ValueError(
            f"`tensors['{name}']` must be a dense (strided) tensor, but is a nested tensor "
            f"instead: send its components (.unbind()) as tensors of their own."
        )
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise ValueError(
            f"`tensors['{name}']` must be a dense (strided) tensor, but has layout "
            f"{tensor.layout} instead: call .to_dense() first."
        )
    if tensor.is_quantized or tensor.dtype in _QUANTIZED:
        raise ValueError(
            f"`tensors['{name}']` must not be quantized, but is of dtype "
            f"{str(tensor.dtype).removeprefix('torch.')} instead: its scale and zero point "
            f"do not move with its bytes. Send .int_repr() and the quantization's "
            f"parameters as tensors of their own, or .dequantize() it."
        )
    dispatch = getattr(type(tensor), "__torch_dispatch__", None)
    if dispatch is not torch.Tensor.__torch_dispatch__:
        raise ValueError(
            f"`tensors['{name}']` must be a plain tensor, but is a `{type(tensor).__name__}`, "
            f"a tensor subclass with a __torch_dispatch__ of its own (its values are not "
            f"its storage's bytes) instead: send plain tensors (a DTensor's .full_tensor() "
            f"or .to_local(), say)."
        )


def _check_storage(name: str, tensor: torch.Tensor) -> None:
    """Refuses a tensor whose storage does not hold its bytes (one freed by resizing it
    to 0, as FSDP does): reading or writing them crashed the process."""
    if tensor.numel() == 0:
        return
    needed = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    try:
        held = tensor.untyped_storage().nbytes()
        address = tensor.data_ptr()
    except RuntimeError as error:  # a wrapper of functorch's (vmap's)
        raise ValueError(
            f"`tensors['{name}']` must have a storage of its own, but has none instead "
            f"({error}): give a plain tensor."
        ) from None
    if held < needed:
        raise ValueError(
            f"`tensors['{name}']` must have a storage that holds its bytes, but its storage "
            f"has {held} bytes where it needs {needed} (freed?) instead: give a tensor with "
            f"its memory allocated."
        )
    if address == 0:
        raise ValueError(
            f"`tensors['{name}']` must have its bytes in memory, but has a null data "
            f"pointer (a functorch wrapper's, say) instead: give a plain tensor."
        )


def _shown(value: str) -> str:
    """``value`` quoted, cut to its first 40 characters (and its length said) when long."""
    if len(value) <= 40:
        return repr(value)
    return f"{value[:40]!r}... ({len(value)} characters)"


def _is_name(value: str) -> bool:
    return len(value) <= MAX_NAME and _NAME.fullmatch(value) is not None


def check_channel(channel: object) -> str:
    """A channel's name: at most ``MAX_NAME`` ASCII letters, digits and ``._-:``."""
    if not isinstance(channel, str):
        raise TypeError(f"`channel` must be a str, but is of type `{type(channel).__name__}`.")
    if not _is_name(channel):
        raise ValueError(f"`channel` must be {_NAME_RULE}, but is {_shown(channel)} instead.")
    return channel


def check_name(name: object) -> str | None:
    """A subscriber's name, or None: as a channel's (``check_channel``)."""
    if name is None:
        return None
    if not isinstance(name, str):
        raise TypeError(f"`name` must be a str or None, but is of type `{type(name).__name__}`.")
    if not _is_name(name):
        raise ValueError(f"`name` must be {_NAME_RULE}, but is {_shown(name)} instead.")
    return name


def check_store(store: object) -> tuple[str, int]:
    """``store`` (``"HOST:PORT"``, IPv6 in brackets) as a host and a port."""
    return parse_address(store, name="store")


def check_version(version: object, last: int | None) -> int:
    """An int above ``last`` (the last version pushed, or None), and an int64 (the
    round's header holds it in one): in [0, 2**63)."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"`version` must be an int, but is of type `{type(version).__name__}`.")
    if version < 0:
        raise ValueError(f"`version` must be non-negative, but is {_shown_int(version)}.")
    if version >= _INT64_LIMIT:
        raise ValueError(
            f"`version` must be below 2**63 (an int64), but is {_shown_int(version)} instead."
        )
    if last is not None and version <= last:
        raise ValueError(
            f"`version` must increase: {version} is not above the last pushed, {last}."
        )
    return version


def _shown_int(value: int) -> str:
    """``value``, or its size where printing it would be long (or refused: Python
    prints no int of more than 4300 digits)."""
    if abs(value) < 10**40:
        return str(value)
    return f"{'a negative' if value < 0 else 'an'} int of {value.bit_length()} bits"


def check_bool(value: object, *, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, but is of type `{type(value).__name__}`.")
    return value


def check_deadline(timeout: object, *, default: float | None = None) -> float | None:
    """``timeout`` in agang's one meaning of a timeout argument (``agang._validate``):
    None is ``default``, ``math.inf`` is no deadline (None), a number is seconds."""
    return check_agang_deadline(timeout, name="timeout", default=default)


def check_secret(secret: object) -> bytes | None:
    """A channel's secret as bytes (``str`` is taken as UTF-8), or None: at least 16
    bytes, so that it cannot be guessed by trying."""
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes):
        raise TypeError(
            f"`secret` must be a str, bytes or None, but is of type `{type(secret).__name__}` "
            f"instead."
        )
    if len(secret) < 16:
        raise ValueError(
            f"`secret` must be at least 16 bytes (say, `secrets.token_hex(16)`), but is "
            f"{len(secret)} bytes instead."
        )
    return secret
