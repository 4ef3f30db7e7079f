"""The Gang interface: a set of ranks that run collectives together, awaitably.

Every collective is a plain method that checks its input, issues the op at once, and
returns a [`Handle`][agang.Handle]. All ranks of a gang must issue its collectives in the
same order (one gang is one ordering domain).

Timeouts, as everywhere in agang: ``timeout=None`` means the default (for an op, the
gang's ``op_timeout``), ``math.inf`` means no deadline, and a number is seconds from
issue. When a deadline passes the handle raises [`GangTimeoutError`][agang.GangTimeoutError]; with
the default policy (``on_timeout="abort"``) the gang is then broken: every later call
raises [`GangBrokenError`][agang.GangBrokenError] at once.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Literal, overload

import torch

from agang._backends.cuda.runtime import StreamOrder
from agang._errors import GangError
from agang._handle import Coalesced, Handle
from agang._reduce_op import ReduceOp
from agang._statistics import GangStatistics

#: One send or receive of [`Gang.exchange`][agang.Gang.exchange]: a tensor, and the peer's rank.
Transfer = tuple[torch.Tensor, int]
#: The formats of the object collectives: ``"safe"`` (plain data only) or ``"pickle"``.
Serializer = Literal["safe", "pickle"]


class Gang(ABC):
    """A set of ranks that run collectives together.

    Implementations: the process-group gang returned by [`agang.init`][agang.init],
    [`agang.FakeGang`][agang.FakeGang], and the gangs of
    [`agang.testing.FakeWorld`][agang.testing.FakeWorld].
    """

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank in the gang, from 0 to ``size - 1``."""

    @property
    @abstractmethod
    def size(self) -> int:
        """The number of ranks in the gang."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """The device the gang's tensors must live on."""

    @property
    @abstractmethod
    def backend(self) -> str:
        """``"gloo"``, ``"nccl"``, or ``"fake"`` for gangs that simulate one."""

    @property
    @abstractmethod
    def name(self) -> str:
        """A name for messages and logs (``"root"``, or the sub-gang's ranks)."""

    @property
    @abstractmethod
    def closed(self) -> bool:
        """True once [`close`][agang.Gang.close] has been called."""

    @abstractmethod
    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, timeout: float | None = None
    ) -> Handle[torch.Tensor]:
        """Reduces ``tensor`` across all ranks, in place.

        Args:
            tensor: The input, overwritten with the result on every rank.
            op: How to combine the ranks' values.
            timeout: Seconds before the op's deadline; None for the gang's default.

        Returns:
            A handle whose ``await`` returns ``tensor``.

        Example:
            ```python
            import asyncio

            import torch

            from agang import ReduceOp
            from agang.testing import FakeWorld


            async def step(gang):
                grad = torch.full((2,), float(gang.rank))
                await gang.all_reduce(grad, ReduceOp.MEAN)  # grad now holds the mean
                return grad.tolist()


            assert asyncio.run(FakeWorld(2).run(step)) == [[0.5, 0.5], [0.5, 0.5]]
            ```
        """

    @abstractmethod
    def coalesce(self) -> contextlib.AbstractContextManager[Coalesced]:
        """A scope whose all-reduces are issued together, as few flat ops, when it ends.

        Inside the scope, ``all_reduce`` returns its handle at once but holds the op;
        when the scope ends, the held ops are grouped by reduce op, dtype and device (in
        the order of their first member) and each group is issued as one flat
        all-reduce. Each handle then resolves to its own tensor, updated in place, and
        carries the sequence number of its group's op. Grouping follows program order
        only, never timing, so every rank that makes the same calls groups them alike.

        The scope belongs to the task (or thread) that opened it: other tasks' calls
        pass straight through. Any other kind of op inside the scope first issues what
        the scope holds, so program order is kept. Awaiting a held handle inside the
        scope raises ``RuntimeError`` (it could never finish); await after the block.

        Returns:
            A context manager whose value, a [`agang.Coalesced`][agang.Coalesced], is awaitable once
            the scope has ended: it waits for all of the scope's all-reduces at once.

        Example:
            ```python
            import asyncio

            import torch

            from agang.testing import FakeWorld


            async def step(gang):
                grads = [torch.ones(2), torch.ones(3)]
                with gang.coalesce() as batch:  # one flat all-reduce when the block ends
                    handles = [gang.all_reduce(g) for g in grads]
                await batch  # or await each handle
                return [g.tolist() for g in grads]


            assert asyncio.run(FakeWorld(2).run(step))[0] == [[2.0, 2.0], [2.0, 2.0, 2.0]]
            ```
        """

    @overload
    def all_reduce_bucketed(
        self,
        tensors: Sequence[torch.Tensor],
        op: ReduceOp = ...,
        *,
        bucket_bytes: int = ...,
        timeout: float | None = ...,
        per_bucket: Literal[False] = ...,
    ) -> Handle[list[torch.Tensor]]: ...

    @overload
    def all_reduce_bucketed(
        self,
        tensors: Sequence[torch.Tensor],
        op: ReduceOp = ...,
        *,
        bucket_bytes: int = ...,
        timeout: float | None = ...,
        per_bucket: Literal[True],
    ) -> list[Handle[list[torch.Tensor]]]: ...

    @abstractmethod
    def all_reduce_bucketed(
        self,
        tensors: Sequence[torch.Tensor],
        op: ReduceOp = ReduceOp.SUM,
        *,
        bucket_bytes: int = 25 * 1024 * 1024,
        timeout: float | None = None,
        per_bucket: bool = False,
    ) -> Handle[list[torch.Tensor]] | list[Handle[list[torch.Tensor]]]:
        """Reduces ``tensors`` in place, as size-capped flat buckets in list order.

        The DDP gradient-bucket pattern: tensors are packed, in list order, into
        buckets of at most ``bucket_bytes`` (one open bucket per dtype and device; a
        tensor larger than the cap is a bucket of its own), and each bucket is one flat
        all-reduce, issued as soon as it is full. Every rank must pass the same shapes
        and dtypes in the same order.

        Args:
            tensors: The tensors, each overwritten with its result.
            op: How to combine the ranks' values.
            bucket_bytes: The most bytes a bucket holds.
            timeout: Seconds before each bucket's deadline; None for the gang's default.
            per_bucket: Return one handle per bucket (each resolving to its tensors)
                instead of one handle for all.

        Returns:
            A handle whose ``await`` returns ``tensors`` as a list, or a list of handles.

        Example:
            ```python
            import asyncio

            import torch

            from agang import ReduceOp
            from agang.testing import FakeWorld


            async def step(gang):
                grads = [torch.full((1000,), float(gang.rank)) for _ in range(8)]
                await gang.all_reduce_bucketed(grads, ReduceOp.MEAN, bucket_bytes=2**14)
                return grads[-1][0].item()


            assert asyncio.run(FakeWorld(2).run(step)) == [0.5, 0.5]
            ```
        """

    @abstractmethod
    async def lane(self, name: str, *, high_priority: bool = False) -> Gang:
        """A gang over the same ranks with its own communicator and its own order.

        Use a lane when two tasks issue collectives concurrently, e.g. gradient
        all-reduces from backward hooks while another task broadcasts metrics: on one
        gang, their interleaving could differ across ranks and deadlock or mix up data,
        because one gang is one ordering domain. Give each task its own lane.

        The first call for a name is a collective call on this gang (every rank makes
        it, in the same order relative to this gang's other calls); later calls return
        the same gang at once. Lanes inherit this gang's policy and close with it.

        Args:
            name: The lane's name; equal on every rank.
            high_priority: NCCL: run the lane on a high-priority CUDA stream.

        Returns:
            The lane's gang.

        Example:
            ```python
            import asyncio

            import torch

            from agang.testing import FakeWorld


            async def step(gang):
                grads = await gang.lane("grads")  # every rank, in the same order
                metrics = await gang.lane("metrics")
                loss, count = torch.ones(1), torch.ones(1)
                # Two tasks may issue concurrently, each on its own lane.
                await asyncio.gather(grads.all_reduce(loss), metrics.all_reduce(count))
                return (loss + count).item()


            assert asyncio.run(FakeWorld(2).run(step)) == [4.0, 4.0]
            ```
        """

    @abstractmethod
    async def wait_for_room(self, num_bytes: int = 0) -> None:
        """Waits until the in-flight bounds leave room for one more op of ``num_bytes``.

        Back-pressure for a task that issues in a loop: past the bounds
        ([`agang.InFlightLimits`][agang.InFlightLimits]), a call still returns its handle at once
        and its op waits in the gang's queue, so a producer that never awaits would grow that queue
        without limit. Awaiting this before each call keeps what the gang holds within the bounds
        instead. It is advice, not a reservation: another task may take the room first. Always a
        checkpoint, even when there is room already.

        Args:
            num_bytes: The size of the op about to be issued (its tensors' bytes).

        Raises:
            GangClosedError: The gang is closed, or closes while waiting.
            GangBrokenError: The gang is broken, or breaks while waiting.

        Example:
            ```python
            import asyncio

            import torch

            import agang
            from agang.testing import FakeWorld


            async def step(gang):
                grads, handles = [torch.ones(4) for _ in range(100)], []
                for grad in grads:
                    await gang.wait_for_room(grad.nbytes)  # the gang holds at most 8 ops
                    handles.append(gang.all_reduce(grad))
                for handle in handles:
                    await handle
                return grads[-1][0].item()


            world = FakeWorld(2, limits=agang.InFlightLimits(max_ops=8))
            assert asyncio.run(world.run(step)) == [2.0, 2.0]
            ```
        """

    @abstractmethod
    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        timeout: float | None = None,
    ) -> Handle[torch.Tensor]:
        """Reduces ``input`` and scatters it; ``input`` in either layout: stacked,
        ``[size, *output.shape]``, or concatenated, ``[size * output.shape[0],
        *output.shape[1:]]`` (c10d's ``reduce_scatter_tensor``).

        Rank r receives in ``output`` the reduction over ranks of the r-th block of
        ``input`` (``input[r]`` stacked, ``input.chunk(size)[r]`` concatenated). ``input``
        is never modified.

        Example:
            ```python
            import asyncio

            import torch

            from agang.testing import FakeWorld


            async def step(gang):
                grads = torch.arange(gang.size * 4.0)  # concatenated: [size * 4]
                shard = await gang.reduce_scatter(torch.empty(4), grads)
                stacked = grads.view(gang.size, 4)
                same = await gang.reduce_scatter(torch.empty(4), stacked)
                assert torch.equal(shard, same)
                return shard.tolist()


            shards = asyncio.run(FakeWorld(2).run(step))
            assert shards == [[0.0, 2.0, 4.0, 6.0], [8.0, 10.0, 12.0, 14.0]]
            ```
        """

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
            ```python
            import asyncio

            import torch

            from agang.testing import FakeWorld


            async def step(gang):
                x = torch.full((4,), float(gang.rank))
                # Stacked: row r is rank r's x; or concatenated.
                out = await gang.all_gather(torch.empty(gang.size, 4), x)
                flat = await gang.all_gather(torch.empty(gang.size * 4), x)
                sizes = [1, 2]  # uneven: rank r sends sizes[r] rows of 4
                rows = torch.full((sizes[gang.rank], 4), float(gang.rank))
                uneven = await gang.all_gather(torch.empty(3, 4), rows, output_split_sizes=sizes)
                return out[:, 0].tolist(), flat.numel(), uneven[:, 0].tolist()


            assert asyncio.run(FakeWorld(2).run(step))[0] == ([0.0, 1.0], 8, [0.0, 1.0, 1.0])
            ```
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
            ```python
            import asyncio

            import torch

            from agang.testing import FakeWorld


            async def step(gang):
                x = torch.full((4,), float(gang.rank))
                outs = await gang.all_gather_to_list([torch.empty(4) for _ in range(gang.size)], x)
                return [out[0].item() for out in outs]


            assert asyncio.run(FakeWorld(3).run(step)) == [[0.0, 1.0, 2.0]] * 3
            ```
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
        collective's deadline catches: [`agang.GangTimeoutError`][agang.GangTimeoutError].
        The order check compares the dtype, the shape past the first dimension, and
        whether split sizes were given (pass them on every rank or on none), and with
        split sizes it checks every pair of ranks too: sizes that disagree fail the op
        on every rank with [`agang.CollectiveMismatchError`][agang.CollectiveMismatchError]
        naming the pairs, before any row moves.

        Args:
            output: Receives the blocks, in rank order.
            input: The blocks to send, in rank order; never modified.
            output_split_sizes: Rows received from each rank; None for equal blocks.
            input_split_sizes: Rows sent to each rank; None for equal blocks.
            timeout: Seconds before the op's deadline; None for the gang's default.

        Returns:
            A handle whose ``await`` returns ``output``.

        Raises:
            ValueError: ``output`` overlaps ``input`` in memory (in place, or shifted by
                rows): each rank writes ``output`` while its peers still read ``input``,
                so some ranks would get rows already overwritten, with no error.

        Example:
            ```python
            import asyncio

            import torch

            from agang.testing import FakeWorld


            async def step(gang):
                tokens = torch.full((gang.size * 2,), float(gang.rank))  # 2 for each rank
                even = await gang.all_to_all(torch.empty(gang.size * 2), tokens)

                # Uneven: first the counts, then the rows (as a mixture of experts sends tokens).
                counts = torch.tensor([gang.rank + 1] * gang.size)  # rows this rank sends to each
                rows = torch.ones(int(counts.sum()), 8)
                received = await gang.all_to_all(torch.empty_like(counts), counts)
                out = torch.empty(int(received.sum()), 8)
                await gang.all_to_all(
                    out,
                    rows,
                    output_split_sizes=received.tolist(),
                    input_split_sizes=counts.tolist(),
                )
                return even.tolist(), out.shape[0]


            assert asyncio.run(FakeWorld(2).run(step)) == [([0.0, 0.0, 1.0, 1.0], 3)] * 2
            ```
        """

    @abstractmethod
    def send(
        self, tensor: torch.Tensor, destination_rank: int, *, timeout: float | None = None
    ) -> Handle[None]:
        """Sends ``tensor`` to ``destination_rank``, which must [`recv`][agang.Gang.recv] it.

        Example:
            ```python
            import asyncio

            import torch

            from agang.testing import FakeWorld


            async def step(gang):
                if gang.rank == 0:
                    await gang.send(torch.ones(8), destination_rank=1)
                    return None
                return (await gang.recv(torch.empty(8), source_rank=0)).sum().item()


            assert asyncio.run(FakeWorld(2).run(step)) == [None, 8.0]
            ```
        """

    @abstractmethod
    def recv(
        self, tensor: torch.Tensor, source_rank: int, *, timeout: float | None = None
    ) -> Handle[torch.Tensor]:
        """Receives into ``tensor`` what ``source_rank`` sends.

        ``tensor`` must have the sent tensor's shape and dtype: order checking does not
        cover transfers (see the collectives guide). The example under
        [`send`][agang.Gang.send] shows a matched pair.
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
        sends match the peer's receives in order (with those of [`send`][agang.Gang.send] and
        [`recv`][agang.Gang.recv] too), and a matched pair must agree on shape and dtype. Only the
        ranks named take part. Like [`send`][agang.Gang.send], it is not order-checked. On NCCL, if
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
            ```python
            import asyncio

            import torch

            from agang.testing import FakeWorld


            async def step(gang):
                after, before = (gang.rank + 1) % gang.size, (gang.rank - 1) % gang.size
                mine = torch.full((8,), float(gang.rank))
                # A ring step: send to the next rank, receive from the one before.
                [x] = await gang.exchange([(mine, after)], [(torch.empty(8), before)])
                return x[0].item()


            assert asyncio.run(FakeWorld(3).run(step)) == [2.0, 0.0, 1.0]
            ```
        """

    @abstractmethod
    def broadcast(
        self, tensor: torch.Tensor, source_rank: int = 0, *, timeout: float | None = None
    ) -> Handle[torch.Tensor]:
        """Copies ``tensor`` of ``source_rank`` into ``tensor`` on every other rank.

        Example:
            ```python
            import asyncio

            import torch

            from agang.testing import FakeWorld


            async def step(gang):
                weights = torch.full((3,), float(gang.rank))
                await gang.broadcast(weights, source_rank=0)
                return weights.tolist()


            assert asyncio.run(FakeWorld(2).run(step)) == [[0.0, 0.0, 0.0]] * 2
            ```
        """

    @abstractmethod
    def reduce(
        self,
        tensor: torch.Tensor,
        destination_rank: int,
        op: ReduceOp = ReduceOp.SUM,
        *,
        timeout: float | None = None,
    ) -> Handle[torch.Tensor]:
        """Reduces ``tensor`` across ranks into ``tensor`` of ``destination_rank``.

        ``await`` returns ``tensor`` on every rank. On the destination it holds the
        reduction; on the other ranks its contents are unspecified afterwards (Gloo
        leaves partial reductions there): pass a copy to keep them.

        Example:
            ```python
            import asyncio

            import torch

            from agang import ReduceOp
            from agang.testing import FakeWorld


            async def step(gang):
                loss = torch.tensor([float(gang.rank)])
                loss = await gang.reduce(loss, destination_rank=0, op=ReduceOp.MEAN)
                return loss.item() if gang.rank == 0 else None


            assert asyncio.run(FakeWorld(2).run(step)) == [0.5, None]
            ```
        """

    @abstractmethod
    def gather(
        self,
        output: torch.Tensor | None,
        input: torch.Tensor,
        destination_rank: int,
        *,
        timeout: float | None = None,
    ) -> Handle[torch.Tensor | None]:
        """Gathers every rank's ``input`` into ``output`` of ``destination_rank``.

        On the destination ``output`` is stacked, ``[size, *input.shape]``, or
        concatenated, ``[size * input.shape[0], *input.shape[1:]]``, and receives rank
        r's ``input`` as its r-th block; on the other ranks it must be None. ``await``
        returns ``output``: the tensor on the destination, None elsewhere. ``input`` is
        never modified.

        Example:
            ```python
            import asyncio

            import torch

            from agang.testing import FakeWorld


            async def step(gang):
                metrics = torch.full((4,), float(gang.rank))
                rows = torch.empty(gang.size, 4) if gang.rank == 0 else None
                rows = await gang.gather(rows, metrics, destination_rank=0)
                return None if rows is None else rows[:, 0].tolist()


            assert asyncio.run(FakeWorld(2).run(step)) == [[0.0, 1.0], None]
            ```
        """

    @abstractmethod
    def scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor | None,
        source_rank: int,
        *,
        timeout: float | None = None,
    ) -> Handle[torch.Tensor]:
        """Sends block r of ``source_rank``'s ``input`` into ``output`` of rank r.

        On the source ``input`` is stacked, ``[size, *output.shape]``, or concatenated,
        ``[size * output.shape[0], *output.shape[1:]]``, and is never modified; on the
        other ranks it must be None. ``await`` returns ``output`` on every rank.

        Example:
            ```python
            import asyncio

            import torch

            from agang.testing import FakeWorld


            async def step(gang):
                batch = torch.arange(8.0)
                shards = batch.view(gang.size, -1) if gang.rank == 0 else None
                shard = await gang.scatter(torch.empty(batch.numel() // gang.size), shards, 0)
                return shard.tolist()


            shards = asyncio.run(FakeWorld(2).run(step))
            assert shards == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
            ```
        """

    @abstractmethod
    def broadcast_objects(
        self,
        objects: list[Any],
        source_rank: int = 0,
        *,
        timeout: float | None = None,
        serializer: Serializer = "safe",
    ) -> Handle[list[Any]]:
        """Sends the ``objects`` of ``source_rank`` to every rank.

        On the other ranks the contents of ``objects`` are replaced by the received ones
        when the handle's result is taken (``await``), on the awaiting thread.

        Args:
            objects: The list to send (on ``source_rank``) or to fill (elsewhere).
            source_rank: The rank whose ``objects`` are sent.
            timeout: Seconds before the op fails, as for every collective.
            serializer: ``"safe"`` (plain data only: None, bool, int, float, str,
                bytes, list, tuple, dict; reading it runs no code) or ``"pickle"`` (any
                picklable object; unpickling runs whatever code the sender chose, so
                only between ranks that trust each other). Pass the same on every rank.

        Returns:
            A handle whose ``await`` returns ``objects``.

        Raises:
            TypeError: On ``source_rank``, once the op is issued, when ``objects``
                cannot be written in the ``serializer``'s format; the other ranks'
                ``await`` then raises ``ValueError`` naming it, and the gang stays usable.

        Example:
            ```python
            import asyncio

            from agang.testing import FakeWorld


            async def step(gang):
                config = {"lr": 0.1} if gang.rank == 0 else None
                config = (await gang.broadcast_objects([config]))[0]
                return config


            assert asyncio.run(FakeWorld(2).run(step)) == [{"lr": 0.1}, {"lr": 0.1}]
            ```
        """

    @abstractmethod
    def all_gather_objects(
        self, obj: Any, *, timeout: float | None = None, serializer: Serializer = "safe"
    ) -> Handle[list[Any]]:
        """Gathers one object from every rank; ``serializer`` as for
        [`broadcast_objects`][agang.Gang.broadcast_objects].

        Returns:
            A handle whose ``await`` returns a list with rank r's object at index r,
            decoded when the result is taken.

        Raises:
            TypeError: On a rank whose ``obj`` cannot be written in the ``serializer``'s
                format, once the op is issued; the other ranks' ``await`` then raises
                ``ValueError`` naming every such rank, and the gang stays usable.

        Example:
            ```python
            import asyncio

            from agang.testing import FakeWorld


            async def step(gang):
                return await gang.all_gather_objects(f"host{gang.rank}")


            assert asyncio.run(FakeWorld(2).run(step)) == [["host0", "host1"]] * 2
            ```
        """

    @abstractmethod
    def barrier(self, *, timeout: float | None = None) -> Handle[None]:
        """Completes once every rank has reached it.

        Example:
            ```python
            import asyncio

            from agang.testing import FakeWorld


            async def step(gang):
                await gang.barrier()  # every rank is here


            asyncio.run(FakeWorld(2).run(step))
            ```
        """

    @abstractmethod
    async def create_gang(self, ranks: Sequence[int]) -> Gang | None:
        """Makes a gang of some of this gang's ranks; every rank of this gang must call it.

        Args:
            ranks: The members, as ranks of this gang; a member's rank in the new gang is
                its position in the sorted ``ranks``.

        Returns:
            The new gang, or None on ranks that are not in ``ranks``.

        Example:
            ```python
            import asyncio

            from agang.testing import FakeWorld


            async def step(gang):
                pair = await gang.create_gang([0, 1])  # every rank calls it; rank 2 gets None
                return None if pair is None else pair.size


            assert asyncio.run(FakeWorld(3).run(step)) == [2, 2, None]
            ```
        """

    @abstractmethod
    async def close(self) -> None:
        """Releases the gang; pending waiters get [`GangClosedError`][agang.GangClosedError].

        Idempotent. Closing a gang also closes the sub-gangs made from it. With work
        still running, close aborts the gang's communicator. On NCCL that abort returns
        only once this rank's GPU has reached the gang's queued kernels, so close waits
        for the device to get past the work queued ahead of them (a peer that never
        comes is not waited for), but at most 5 seconds: past that it returns with the
        gang closed, and the release ends on its own thread once the device got there.
        """

    @abstractmethod
    def close_sync(self) -> None:
        """[`close`][agang.Gang.close] for synchronous code."""

    @abstractmethod
    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether an op of this gang may still read or write ``tensor``'s memory.

        True while an op that was given the tensor has not ended, including one that a
        deadline, a cancelled wait, a failure or [`close`][agang.Gang.close] abandoned: c10d cannot
        cancel an op, and one behind a dead link can go on for seconds after its
        communicator's abort. Such a tensor is busy (another op refuses it); a caller
        that must go on without waiting for it uses other memory. False once every op
        that used the tensor has ended. Closed gangs answer too.

        Example:
            ```python
            import asyncio

            import torch

            from agang.testing import FakeWorld


            async def step(gang):
                buffer = torch.ones(4)
                handle = gang.all_reduce(buffer)
                if gang.holds(buffer):
                    buffer = torch.empty_like(buffer)  # the old op keeps the old one
                return (await handle).tolist()


            assert asyncio.run(FakeWorld(2).run(step)) == [[2.0] * 4] * 2
            ```
        """

    def _stream_order(self) -> StreamOrder | None:
        """How code above the gang orders its device work around the gang's ops (CUDA
        streams and events), or None where there is nothing to order (a CPU, a fake).
        Private, for agang's own features over the public interface (``GradientSync``)."""
        return None

    @abstractmethod
    def statistics(self) -> GangStatistics:
        """Returns counters and latencies of the ops this gang has run."""

    # Elastic gangs (``agang.init(elastic=...)``) override these.

    @property
    def epoch(self) -> int:
        """An elastic gang's epoch: 0 for the first formation, one more per reform; 0
        for every other gang."""
        return 0

    async def reform(self, timeout: float | None = None) -> Gang:  # noqa: ASYNC109
        """An elastic gang's next epoch ([`agang.ElasticGang.reform`][agang.ElasticGang.reform]).

        Raises:
            GangError: This gang is not elastic (made without ``elastic=``).
        """
        raise GangError(f"Gang '{self.name}' is not elastic: make it with agang.init(elastic=...).")

    def waiting_to_join(self) -> int:
        """An elastic gang's count of processes waiting to join that the next reform
        could admit (none while the gang is at its ``max_size``).

        Raises:
            GangError: This gang is not elastic (made without ``elastic=``).
        """
        raise GangError(f"Gang '{self.name}' is not elastic: make it with agang.init(elastic=...).")


def stream_order_of(gang: Gang) -> StreamOrder | None:
    """``gang``'s stream order (``Gang._stream_order``), for agang's own features over the
    public interface (``GradientSync``)."""
    return gang._stream_order()
