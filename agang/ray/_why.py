"""What a death notice filed for Ray says: Ray's error, made one line.

Ray's errors span lines and hold tabs (the actor's class, id, pid, name, namespace and
address, one per line), and a notice's ``why`` is one line of at most 1,000 characters
(``agang._membership.deaths``, rule 2). The line says which actor (its name, node and
pid: what a user looks up in Ray's dashboard and logs), then Ray's words, whitespace
collapsed and cut to fit.
"""

from __future__ import annotations

#: The most characters of a notice's ``why`` (``agang.report_death``'s bound).
MOST = 1000
#: The most characters of Ray's own words kept: its first lines say what happened; the
#: rest (the actor's id, namespace, common causes) is in Ray's logs.
RAY_WORDS = 300


def actor_label(name: str | None, node: str, pid: int) -> str:
    """How a notice names an actor: "actor 'NAME' (node NODE, pid PID)"."""
    who = f"actor '{name}'" if name else "an unnamed actor"
    return f"{who} (node {node[:12]}, pid {pid})"


def death_why(label: str, error: BaseException) -> str:
    """The notice's one line for the actor ``label`` that Ray reported gone by ``error``."""
    words = " ".join(str(error).split())
    if len(words) > RAY_WORDS:
        words = words[: RAY_WORDS - 3] + "..."
    restarted = type(error).__name__ == "ActorUnavailableError"
    verb = "is gone (Ray restarts it)" if restarted else "died"
    line = f"{label} {verb} (Ray: {type(error).__name__}: {words})"
    if len(line) > MOST:
        line = line[: MOST - 4] + "...)"
    return line
