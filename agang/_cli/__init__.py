"""The ``agang`` commands: ``store`` (a rendezvous store for elastic jobs), ``doctor``
(checks a job's environment before it starts) and ``selfcheck`` (proves the semantics on
this machine)."""
