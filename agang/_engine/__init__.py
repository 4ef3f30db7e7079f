"""The engine of a gang: everything between a user's call and its handle finishing.

- :mod:`agang._engine.engine`: numbering, admission, completion, deadlines, failure and
  closing of one gang's ops (its rules are the semantics users rely on).
- :mod:`agang._engine.scheduler`: the pure core: in flight, may start, late.
- :mod:`agang._engine.room`: refusing, blocking and awaiting room under the bounds.
- :mod:`agang._engine.busy`: which memory an unfinished op still uses.
- :mod:`agang._engine.deadlines`: where and when a gang's one deadline check runs.
- :mod:`agang._engine.coalescer` and :mod:`agang._engine.grouping`: ``coalesce()``
  scopes, flat ops and buckets, grouped by program order only.
- :mod:`agang._engine.reports`: the errors a timeout or a mismatch reports.
"""
