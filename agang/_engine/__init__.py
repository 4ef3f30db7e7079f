"""The engine of a gang: everything between a user's checked call and its handle finishing.

One engine per gang numbers, admits, starts, completes and times out that gang's ops,
and breaks and closes the gang (``engine``, whose rules are the semantics users rely
on). Around it: what an op is to it (``ops``), the pure core that decides what is in
flight and what may start (``scheduler``), room under the in-flight bounds (``room``),
the memory unfinished ops still use (``busy``), the deadline timer and what happens when
it finds an op late (``deadlines``), learning of an end where the backend must be asked
(``polling``), ``coalesce()`` scopes and buckets grouped by program
order only (``coalescer``, ``grouping``), and the errors a timeout or a mismatch reports
(``reports``). Helpers that are objects of their own reach the engine through small
interfaces they define (``ops.OpOwner``, ``deadlines.Expiring``), never through its class.
"""
