"""The public inputs' checks: each error names the parameter and what it got."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch


def check_tensors(tensors: object) -> dict[str, torch.Tensor]:
    """``tensors`` as a dict: a non-empty mapping of str to contiguous tensors on one
    device, none a lazy (conjugated or negated) view."""
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
        if tensor.is_sparse or tensor.layout != torch.strided:
            raise ValueError(f"`tensors['{name}']` must be a dense (strided) tensor.")
        if device is None:
            device = tensor.device
        elif tensor.device != device:
            raise ValueError(
                f"`tensors` must all be on one device, but '{name}' is on {tensor.device} "
                f"and the first on {device}."
            )
        checked[name] = tensor
    assert device is not None
    if device.type != "cpu":
        raise ValueError(
            f"`tensors` must be on the CPU in this version of agang's weights (Gloo), but "
            f"are on {device}."
        )
    return checked


def check_channel(channel: object) -> str:
    if not isinstance(channel, str):
        raise TypeError(f"`channel` must be a str, but is of type `{type(channel).__name__}`.")
    if not channel or "/" in channel or any(c.isspace() for c in channel):
        raise ValueError(
            f"`channel` must be a non-empty str without '/' or spaces, but is {channel!r}."
        )
    return channel


def check_name(name: object) -> str | None:
    if name is None:
        return None
    if not isinstance(name, str):
        raise TypeError(f"`name` must be a str or None, but is of type `{type(name).__name__}`.")
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"`name` must be a non-empty str without spaces, but is {name!r}.")
    return name


def check_store(store: object) -> tuple[str, int]:
    """``store`` (``"HOST:PORT"``, IPv6 in brackets) as a host and a port."""
    if not isinstance(store, str):
        raise TypeError(
            f"`store` must be a str 'HOST:PORT', but is of type `{type(store).__name__}`."
        )
    host, sep, port_text = store.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"`store` must be 'HOST:PORT' (an agang store), but is {store!r}.")
    return host, int(port_text)


def check_timeout(timeout: object, *, name: str = "timeout") -> float | None:
    """A positive number of seconds, or None."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(
            f"`{name}` must be a positive number of seconds or None, but is of type "
            f"`{type(timeout).__name__}` instead."
        )
    if math.isnan(timeout) or timeout <= 0:
        raise ValueError(
            f"`{name}` must be a positive number of seconds or None, but is {timeout}."
        )
    return float(timeout)


def check_version(version: object, last: int | None) -> int:
    """An int above ``last`` (the last version pushed, or None)."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"`version` must be an int, but is of type `{type(version).__name__}`.")
    if version < 0:
        raise ValueError(f"`version` must be non-negative, but is {version}.")
    if last is not None and version <= last:
        raise ValueError(
            f"`version` must increase: {version} is not above the last pushed, {last}."
        )
    return version


def check_bool(value: object, *, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, but is of type `{type(value).__name__}`.")
    return value
