"""The part of the Gang interface that moves blocks between ranks without reducing them:
the gathers, all-to-all, and point-to-point sends and receives, one by one or batched.

A plain ABC that :class:`agang.Gang` inherits, kept apart for its documentation's sake:
the blocks may be uneven (split sizes), and the rules of who must agree with whom are
longer than the calls. Every method here is abstract and part of the Gang's interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from agang._handle import Handle

#: One send or receive of :meth:`GangExchanges.exchange`: a tensor, and the peer's rank.
Transfer = tuple[torch.Tensor, int]


class GangExchanges(ABC):
    """The gathers, all-to-all and point-to-point calls of :class:`agang.Gang`."""

    @abstractmethod
    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        output_split_sizes: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> Handle[torch.Tensor]:
        """Gathers every rank's ``input`` into ``output``, in rank order.

        Without ``output_split_sizes`` every rank's input has one shape and ``output``
        takes either layout: stacked, ``[size, *input.shape]``, or concatenated,
        ``[size * input.shape[0], *input.shape[1:]]`` (c10d's ``all_gather_into_tensor``).

        With ``output_split_sizes`` the ranks' inputs may differ in their first
        dimension: rank r's has ``output_split_sizes[r]`` rows (so
        ``output_split_sizes[rank] == input.shape[0]`` here), and ``output`` is their
        concatenation along dim 0: ``[sum(output_split_sizes), *input.shape[1:]]``.
        Every rank passes the same sizes (the order check compares them); pass them on
        every rank or on none. On Gloo and NCCL this runs as one ``all_to_all_single``
        whose input is this rank's ``input`` repeated ``size`` times (Gloo's all-gather
        refuses uneven blocks): the same bytes on the wire as an all-gather, plus a
        local copy of ``size`` times ``input`` that lives until the op ends.

        Args:
            output: Receives every rank's input.
            input: This rank's block; never modified.
            output_split_sizes: Each rank's number of rows, for uneven blocks; None for
                equal ones.
            timeout: Seconds before the op's deadline; None for the gang's default.

        Returns:
            A handle whose ``await`` returns ``output``; rank r's input is ``output[r]``
            (stacked), ``output.chunk(size)[r]`` (concatenated) or
            ``output.split(output_split_sizes)[r]`` (uneven).

        Example:
            >>> out = await gang.all_gather(torch.empty(gang.size, 4), x)  # x: [4]
            >>> out = await gang.all_gather(torch.empty(gang.size * 4), x)
            >>> sizes = [1, 2, 3]  # rank r's x has sizes[r] rows of 4
            >>> out = await gang.all_gather(torch.empty(6, 4), x, output_split_sizes=sizes)
        """

    @abstractmethod
    def all_gather_to_list(
        self,
        outputs: Sequence[torch.Tensor],
        input: torch.Tensor,
        *,
        timeout: float | None = None,
    ) -> Handle[list[torch.Tensor]]:
        """Gathers every rank's ``input`` into ``outputs[rank]``, one tensor per rank.

        Example:
            >>> outs = await gang.all_gather_to_list([torch.empty(4) for _ in range(n)], x)
        """

    @abstractmethod
    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> Handle[torch.Tensor]:
        """Sends block j of ``input`` to rank j; block j of ``output`` comes from rank j.

        Blocks are runs of rows (along the first dimension). Without split sizes they
        are equal: ``input`` and ``output`` have one shape, whose first dimension is a
        multiple of ``size``. With split sizes (c10d's ``all_to_all_single``), block j
        of ``input`` has ``input_split_sizes[j]`` rows and block j of ``output`` has
        ``output_split_sizes[j]``; ``input`` has ``sum(input_split_sizes)`` rows and
        ``output`` ``sum(output_split_sizes)``, with the same dtype and the same shape
        past the first dimension. As in c10d, one may be given without the other: the
        missing one means equal blocks of its tensor (whose first dimension is then a
        multiple of ``size``). This rank's block to itself is checked here
        (``input_split_sizes[rank] == output_split_sizes[rank]``).

        The sizes differ by rank: rank i's ``input_split_sizes[j]`` must equal rank
        j's ``output_split_sizes[i]``, which no rank can check alone, and c10d does not
        check it either. On Gloo (measured with torch 2.13) a receiver that expects
        more rows than its peer sends completes without error and leaves the missing
        rows as they were, and one that expects fewer is killed by Gloo (SIGABRT:
        "Received data size doesn't match expected size"); NCCL does not define it. So
        agree on the sizes first when they come from data (an MoE router: all-to-all
        the per-expert counts, then the tokens). A peer that never calls is what any
        collective's deadline catches: :class:`agang.GangTimeoutError`. The order
        check compares the dtype, the shape past the first dimension, and whether
        split sizes were given (pass them on every rank or on none), and with split
        sizes it checks every pair of ranks too: sizes that disagree fail the op on
        every rank with :class:`agang.CollectiveMismatchError` naming the pairs,
        before any row moves.

        Args:
            output: Receives the blocks, in rank order.
            input: The blocks to send, in rank order; never modified.
            output_split_sizes: Rows received from each rank; None for equal blocks.
            input_split_sizes: Rows sent to each rank; None for equal blocks.
            timeout: Seconds before the op's deadline; None for the gang's default.

        Returns:
            A handle whose ``await`` returns ``output``.

        Example:
            >>> await gang.all_to_all(torch.empty(n * 2), tokens)
            >>> counts = torch.tensor(tokens_per_expert)  # rows this rank sends to each
            >>> received = await gang.all_to_all(torch.empty_like(counts), counts)
            >>> out = torch.empty(int(received.sum()), hidden)
            >>> await gang.all_to_all(
            ...     out,
            ...     tokens,
            ...     output_split_sizes=received.tolist(),
            ...     input_split_sizes=counts.tolist(),
            ... )
        """

    @abstractmethod
    def send(
        self, tensor: torch.Tensor, destination_rank: int, *, timeout: float | None = None
    ) -> Handle[None]:
        """Sends ``tensor`` to ``destination_rank``, which must :meth:`recv` it.

        Example:
            >>> await gang.send(activations, destination_rank=gang.rank + 1)
        """

    @abstractmethod
    def recv(
        self, tensor: torch.Tensor, source_rank: int, *, timeout: float | None = None
    ) -> Handle[torch.Tensor]:
        """Receives into ``tensor`` what ``source_rank`` sends.

        Example:
            >>> x = await gang.recv(torch.empty(8), source_rank=gang.rank - 1)
        """

    @abstractmethod
    def exchange(
        self,
        sends: Sequence[Transfer] = (),
        recvs: Sequence[Transfer] = (),
        *,
        timeout: float | None = None,
    ) -> Handle[list[torch.Tensor]]:
        """Sends and receives as one batch: every ``(tensor, destination_rank)`` of
        ``sends`` and every ``(tensor, source_rank)`` of ``recvs`` (c10d's
        ``batch_isend_irecv``; on NCCL one coalesced group).

        The order of sends against receives does not matter, so a ring or a two-way
        pipeline step cannot deadlock; between one pair of ranks in one direction, the
        sends match the peer's receives in order (with those of :meth:`send` and
        :meth:`recv` too), and a matched pair must agree on shape and dtype. Only the
        ranks named take part. Like :meth:`send`, it is not order-checked. On NCCL, if
        this is the first op on the gang's communicator, every rank of the gang must
        take part in it (torch's rule for ``batch_isend_irecv``); an op on the gang
        first (a barrier) lifts that.

        Args:
            sends: The tensors to send and where; never modified.
            recvs: The tensors to receive into and from where.
            timeout: Seconds before the op's deadline; None for the gang's default.

        Returns:
            A handle that finishes when every send and receive has, whose ``await``
            returns the receive tensors, in the order of ``recvs``.

        Raises:
            ValueError: There is nothing to send or receive, a rank is this one or out
                of range, or a receive tensor overlaps another tensor of the batch
                (sends may share memory: one tensor may go to several peers).

        Example:
            >>> after, before = (gang.rank + 1) % gang.size, (gang.rank - 1) % gang.size
            >>> [x] = await gang.exchange([(mine, after)], [(torch.empty(8), before)])
        """
