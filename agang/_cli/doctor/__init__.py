"""``agang doctor``: what ``agang.init`` would make of this process's job, checked before
it runs: the launcher's variables, this host's torch build and hardware, and whether the
ranks can meet at the store's address and port.

Its checks are pure functions of plain data (the environment, this host's facts, a
network probe passed in as a value), so tests drive them without a real job, and the
findings are rendered apart from them, as text or JSON. Where set-up has a rule (which
launcher started the process, the NCCL settings ``agang.init`` makes, the interface it
chooses), the doctor reads set-up's own table or function, so the two cannot disagree.
"""
