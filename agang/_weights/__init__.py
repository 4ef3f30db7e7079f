"""Weights to a changing fleet: one trainer pushes a ``state_dict`` to inference
servers that come and go, without a global restart and without hanging on a server
that is wedged.

It sits above set-up and the membership layer (``agang._membership``: the store, the
member record, epochs, beats) and below the public face, which re-exports its classes.
Its rounds run on each epoch's [`agang.Gang`][agang.Gang], made by a factory (over the
store in production: Gloo for CPU tensors, NCCL for a GPU's, ``agang._weights.site``),
through the gang's public interface only.

- ``agang._weights.plan``: the fingerprinted plan (names, order, shapes, dtypes,
  tied tensors) that both sides agree on before bytes move, and its buckets.
- ``agang._weights.buckets``: the flat byte buffers a round moves, packed from and
  unpacked into the tensors.
- ``agang._weights.sharded``: ``Sharded``, a plain tensor that is a rank's shard.
- ``agang._weights.sharding``: how a gang holds each tensor (``DTensor`` placements),
  and each rank's share of a bucket.
- ``agang._weights.channel``: the channel's keys in the store: the holder, the plan,
  the joiners, each epoch's members, beats, drops, and the status questions of blame.
- ``agang._weights.epoch``: what a round's header says, and an epoch gang's name.
- ``agang._weights.fleet``: the publisher's view of its subscribers, on a thread.
- ``agang._weights.housekeeping``: which keys no one reads again, deleted.
- ``agang._weights.publisher``: ``WeightPublisher``, the trainer's side.
- ``agang._weights.admission``: ``Admission``, the publisher's members and epochs.
- ``agang._weights.upstream``: a subscriber's view of its publisher and store, on a
  thread.
- ``agang._weights.service``: the subscriber's side of every round, on a thread
  and event loop of its own, so that no push waits for the server's application code.
- ``agang._weights.subscriber``: ``WeightSubscriber``, what the server's code holds.
- ``agang._weights.relay``: a sharded server's rank 0: each bucket through a ring
  of buffers, its slices staged and the other ranks' sent on over the gang.
- ``agang._weights.relayed``: a sharded server's other ranks: their slices, on a
  thread of their own.
- ``agang._weights.server_rank``: ``ServerRank``, a sharded server's rank as its
  subscriber holds it: its staging, and ``receive`` agreed over the gang.
- ``agang._weights.report``: ``PushReport``, what one push did.
- ``agang._weights.blocking``: the channel's bounded waits off the loop.
- ``agang._weights.checks``: the public inputs' checks, each naming its parameter.
"""
