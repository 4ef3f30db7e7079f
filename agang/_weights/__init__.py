"""Weights to a changing fleet: one trainer pushes a ``state_dict`` to inference
servers that come and go, without a global restart and without hanging on a server
that is wedged.

It sits above set-up (it connects to an ``agang store`` as elastic set-up does, and
makes its groups itself) and below the public face, which re-exports its classes.

- :mod:`~agang._weights.plan`: the fingerprinted plan (names, order, shapes, dtypes)
  that both sides agree on before bytes move, and its buckets.
- :mod:`~agang._weights.buckets`: the flat byte buffers a round moves, packed from and
  unpacked into the tensors.
- :mod:`~agang._weights.channel`: the channel's keys in the store: the plan, the
  joiners, each epoch's members, beats, drops, and the status questions of blame.
- :mod:`~agang._weights.epoch`: one epoch's gang over a Gloo group of its own (never
  the process's default group), and the round header.
- :mod:`~agang._weights.publisher`: ``WeightPublisher``, the trainer's side.
- :mod:`~agang._weights.service`: the subscriber's side of every round, on a thread
  and event loop of its own, so that no push waits for the server's application code.
- :mod:`~agang._weights.subscriber`: ``WeightSubscriber``, what the server's code holds.
- :mod:`~agang._weights.report`: ``PushReport``, what one push did.
- :mod:`~agang._weights.checks`: the public inputs' checks, each naming its parameter.
"""
