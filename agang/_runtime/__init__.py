"""Process-wide runtime: which event loop is running, the threads agang starts and how
exit waits for them, what a forked child forgets, and the futures that handles are."""
