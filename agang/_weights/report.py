"""What one push did."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PushReport:
    """The outcome of [`agang.WeightPublisher.push`][agang.WeightPublisher.push].

    Attributes:
        version: The version pushed.
        delivered: The names of the subscribers that hold ``version`` (they confirmed it).
        dropped: The subscribers dropped during this push, each with why (from blame:
            "no answer (dead, stopped, or cut off from the store)", ...). A dropped
            subscriber that comes back is admitted again at a later push.
        seconds: How long the push took, recovery included.
        bytes: The bytes of one copy of the weights (what each subscriber received).
        epoch: The membership epoch the last round ran in.
    """

    version: int
    delivered: tuple[str, ...]
    dropped: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    bytes: int = 0
    epoch: int = 0
