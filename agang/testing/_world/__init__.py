"""``FakeWorld``: many ranks of a gang in one process, on one event loop or threads,
with no network: its gang, its backend and the compute its ops do."""
