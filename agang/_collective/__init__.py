"""The one implementation of the ``Gang`` interface: every collective checked and
described, then issued through one engine, and the constructors over each backend."""
