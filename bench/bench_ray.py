"""agang on Ray: how fast a killed actor's peers learn of it, with Ray's death notices
(the actor class mixes in ``agang.ray.Member``) and without (the same class without it).

Method:
    One local Ray cluster (``RAY_ADDRESS`` if set, else one started here: 4 logical
    CPUs, no dashboard), its actors on ``num_cpus=0``, never restarted; the job's store
    (``agang.ray.store``) on 127.0.0.1. Each repetition runs three scenarios in both
    modes, the modes' order alternating, on fresh actors, and SIGKILLs one actor by pid:

    1. *Fixed gang*: 3 actors form a gang (``agang.ray.plan``, op_timeout 30 s); the
       two survivors wait inside an ``all_reduce`` when the third is killed (victim
       ``rep % 3``). Timed: from the kill to the later survivor's failed op (seconds,
       ``time.time()`` on one machine); noted: whether every message names Ray's cause.
    2. *Elastic recovery*: the same, planned with ``elastic=agang.Elastic(min_size=2)``;
       each survivor reforms as soon as its op fails. Timed: from the kill until both
       survivors' ``reform()`` returned a gang of 2 in a new epoch.
    3. *Weights push*: a ``WeightPublisher`` in this process, 2 subscriber actors
       (``agang.ray.subscribe``, 8 small tensors) that took version 1; one is killed,
       and 0.5 s later version 2 is pushed. Timed: that ``push_sync`` (its report's
       ``seconds``); noted: whether the report's dropped why names "Ray:".

    The table gives each mode's median and max over the repetitions, and the ratio of
    the medians (with / without notices), then the goals (every survivor told within
    0.1 s of the kill; elastic recovery within 0.2 s), judged on the max with notices.
    With notices, the keeper's ``filed()`` gives how long each notice took to file
    after Ray's word.

Usage:
    python bench/bench_ray.py               # 5 repetitions
    python bench/bench_ray.py --quick       # 1 repetition

It prints the table, writes ``ray.json`` and, with matplotlib, ``ray.png`` under
``--out`` (default bench/out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import add_out_argument, write_plots

ROOT = Path(__file__).resolve().parents[1]

HOST = "127.0.0.1"
MODES = ("with notices", "without notices")
SCENARIOS = ("fixed gang", "elastic recovery", "weights push")
#: Goals (seconds, the max with notices): every survivor told; elastic recovery.
GOALS = {"fixed gang": 0.1, "elastic recovery": 0.2}
WAIT = 60.0  # the longest any one driver wait may take
SETTLE = 0.5  # survivors inside their all_reduce, or Ray's word in, before the next step


# -- the actors (pickled by value from __main__: Ray's workers need not import this) ----


class Plain:
    """A gang member and weights subscriber, without agang.ray.Member: no death notices."""

    def __init__(self) -> None:
        self.gang: Any = None
        self.subscriber: Any = None
        self.tensors: dict[str, Any] = {}

    async def pid(self) -> int:
        return os.getpid()

    async def join(self, spec: Any) -> int:
        import agang.ray as ar

        self.gang = await ar.join(spec)
        return int(self.gang.rank)

    async def all_reduce(self, reform: bool = False) -> dict[str, Any]:
        """One all_reduce; on its failure, when and why, and (``reform``) the reform."""
        import torch

        tensor = torch.ones(4)
        try:
            await self.gang.all_reduce(tensor)
        except Exception as error:
            outcome: dict[str, Any] = {"at": time.time(), "message": str(error)}
            if reform:
                self.gang = await self.gang.reform()
                outcome |= {
                    "reformed": time.time(),
                    "size": self.gang.size,
                    "epoch": self.gang.epoch,
                }
            return outcome
        return {"result": tensor.tolist(), "at": time.time()}

    async def subscribe(self, store: str, channel: str) -> str:
        import torch

        import agang.ray as ar

        self.tensors = {f"w{i}": torch.zeros(16) for i in range(8)}
        self.subscriber = await ar.subscribe(
            self.tensors, store=store, channel=channel, timeout=WAIT
        )
        return str(self.subscriber.name)

    async def receive(self) -> int:
        return int(await self.subscriber.receive())


def watched_class() -> type:
    """``Plain`` with ``agang.ray.Member`` mixed in: the keeper watches it."""
    import agang.ray as ar

    class Watched(Plain, ar.Member):
        """Plain, watched: its death is told by Ray."""

    return Watched


# -- the driver -----------------------------------------------------------------------


class Bench:
    """The cluster's handles: the store, its keeper, the actors started (all killed)."""

    def __init__(self) -> None:
        import ray

        import agang.ray as ar

        self.ray = ray
        self.ar = ar
        self.store = ar.store(host=HOST)
        self.keeper = ray.get_actor("agang-store")
        self.classes = {MODES[0]: watched_class(), MODES[1]: Plain}
        self.started: list[Any] = []
        self.count = 0

    def actors(self, mode: str, count: int) -> list[Any]:
        made = []
        for _ in range(count):
            self.count += 1
            made.append(
                self.ray.remote(self.classes[mode])
                .options(name=f"bench-{self.count}", num_cpus=0, max_restarts=0)
                .remote()
            )
        self.started.extend(made)
        return made

    def end(self, actors: list[Any]) -> None:
        for actor in actors:
            self.ray.kill(actor, no_restart=True)

    def filed(self) -> list[tuple[str, int, float]]:
        return list(self.ray.get(self.keeper.filed.remote(), timeout=WAIT))

    def kill(self, actor: Any) -> float:
        pid = self.ray.get(actor.pid.remote(), timeout=WAIT)
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        return killed

    def gang(self, mode: str, rep: int, elastic: bool) -> dict[str, Any]:
        import agang

        ray = self.ray
        actors = self.actors(mode, 3)
        try:
            name = f"{'elastic' if elastic else 'fixed'}-{rep}-{mode.split()[0]}"
            spec = self.ar.plan(
                actors,
                store=self.store,
                name=name,
                timeout=WAIT,
                op_timeout=30.0,
                elastic=agang.Elastic(min_size=2) if elastic else None,
            )
            ray.get([a.join.remote(spec) for a in actors], timeout=WAIT)
            ray.get([a.all_reduce.remote() for a in actors], timeout=WAIT)  # connected
            victim = rep % 3
            survivors = [a for i, a in enumerate(actors) if i != victim]
            before = len(self.filed())
            pending = [a.all_reduce.remote(elastic) for a in survivors]
            time.sleep(SETTLE)  # both wait inside the all_reduce for the victim
            killed = self.kill(actors[victim])
            outcomes = ray.get(pending, timeout=WAIT)
            filed = self.filed()[before:]
        finally:
            self.end(actors)
        result: dict[str, Any] = {
            "victim": victim,
            "told": [o["at"] - killed for o in outcomes],
            "ray_cause": all("Ray:" in o.get("message", "") for o in outcomes),
            "messages": [o.get("message") for o in outcomes],
            "filed": filed,
        }
        if elastic:
            result["reformed"] = [o["reformed"] - killed for o in outcomes]
            result["new_gang"] = [(o["size"], o["epoch"]) for o in outcomes]
            result["seconds"] = max(result["reformed"])
        else:
            result["seconds"] = max(result["told"])
        return result

    def push(self, mode: str, rep: int) -> dict[str, Any]:
        import torch

        import agang

        ray = self.ray
        servers = self.actors(mode, 2)
        weights = {f"w{i}": torch.zeros(16) for i in range(8)}
        channel = f"push-{rep}-{mode.split()[0]}"
        publisher = agang.WeightPublisher.open_sync(
            weights, store=self.store, channel=channel, timeout=WAIT
        )
        try:
            names = ray.get(
                [s.subscribe.remote(self.store, channel) for s in servers], timeout=WAIT
            )
            first = publisher.push_sync(1)
            assert sorted(first.delivered) == sorted(names), first
            ray.get([s.receive.remote() for s in servers], timeout=WAIT)
            victim = rep % 2
            before = len(self.filed())
            self.kill(servers[victim])
            time.sleep(SETTLE)
            for tensor in weights.values():
                tensor.fill_(2.0)
            report = publisher.push_sync(2)
            filed = self.filed()[before:]
        finally:
            publisher.close_sync()
            self.end(servers)
        why = report.dropped.get(names[victim], "")
        return {
            "victim": victim,
            "seconds": report.seconds,
            "first_push": first.seconds,
            "delivered": list(report.delivered),
            "dropped": dict(report.dropped),
            "ray_cause": "Ray:" in why,
            "filed": filed,
        }

    def run(self, scenario: str, mode: str, rep: int) -> dict[str, Any]:
        if scenario == "weights push":
            return self.push(mode, rep)
        return self.gang(mode, rep, elastic=scenario == "elastic recovery")


def start_ray() -> Any:
    """Connects to ``RAY_ADDRESS``, or starts a cluster of this machine's own."""
    import ray

    # Ray's workers import agang (and torch) from the repository too.
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    address = os.environ.get("RAY_ADDRESS")
    options: dict[str, Any] = {"namespace": f"agang-bench-{os.getpid()}", "log_to_driver": False}
    if address:
        ray.init(address=address, **options)
    else:  # "local": a new cluster, never another one running on this machine
        ray.init(address="local", num_cpus=4, include_dashboard=False, **options)
    return ray


def seconds_text(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def table(results: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    """The table's lines and its figures (median, max, Ray's cause) per scenario and mode."""
    rows = [
        f"| scenario | {MODES[0]}: median / max | {MODES[1]}: median / max "
        f"| ratio (medians) | Ray's cause named (with / without) |",
        "| --- | --- | --- | --- | --- |",
    ]
    figures: dict[str, Any] = {}
    for scenario in SCENARIOS:
        cells, named = [], []
        figures[scenario] = {}
        for mode in MODES:
            picked = [r for r in results if r["scenario"] == scenario and r["mode"] == mode]
            times = [r["seconds"] for r in picked]
            median = statistics.median(times)
            figures[scenario][mode] = {
                "median": median,
                "max": max(times),
                "ray_cause": sum(r["ray_cause"] for r in picked),
                "runs": len(picked),
            }
            cells.append(f"{seconds_text(median)} / {seconds_text(max(times))}")
            named.append(f"{sum(r['ray_cause'] for r in picked)}/{len(picked)}")
        ratio = figures[scenario][MODES[0]]["median"] / figures[scenario][MODES[1]]["median"]
        rows.append(
            f"| {scenario} | {cells[0]} | {cells[1]} | {ratio:.2f}x | {' / '.join(named)} |"
        )
    return rows, figures


def goal_lines(figures: dict[str, Any], results: list[dict[str, Any]]) -> list[str]:
    lines = []
    told = max(
        max(r["told"])
        for r in results
        if r["mode"] == MODES[0] and r["scenario"] in ("fixed gang", "elastic recovery")
    )
    goal = GOALS["fixed gang"]
    lines.append(
        f"Goal: every survivor told within {goal * 1e3:.0f} ms of the kill (with notices, "
        f"max over both gang scenarios): {seconds_text(told)}: "
        f"{'MET' if told <= goal else 'MISSED'}"
    )
    recovery = figures["elastic recovery"][MODES[0]]["max"]
    goal = GOALS["elastic recovery"]
    lines.append(
        f"Goal: elastic recovery within {goal * 1e3:.0f} ms (with notices, max): "
        f"{seconds_text(recovery)}: {'MET' if recovery <= goal else 'MISSED'}"
    )
    filed = [f[2] for r in results if r["mode"] == MODES[0] for f in r["filed"]]
    if filed:
        lines.append(
            f"Keeper: {len(filed)} notices filed, median {statistics.median(filed) * 1e3:.1f}"
            f" ms / max {max(filed) * 1e3:.1f} ms after Ray's word; without notices: "
            f"{sum(len(r['filed']) for r in results if r['mode'] == MODES[1])} filed"
        )
    return lines


def draw(plt: Any, figures: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for offset, mode in ((-width / 2, MODES[0]), (width / 2, MODES[1])):
        medians = [figures[s][mode]["median"] * 1e3 for s in SCENARIOS]
        maxima = [figures[s][mode]["max"] * 1e3 for s in SCENARIOS]
        positions = [i + offset for i in range(len(SCENARIOS))]
        ax.bar(positions, medians, width, label=mode)
        ax.scatter(positions, maxima, marker="_", color="black", s=200)
    ax.set_xticks(range(len(SCENARIOS)), SCENARIOS)
    ax.set_yscale("log")
    ax.set_ylabel("ms from the kill (bar: median, tick: max)")
    ax.legend()
    ax.set_title("agang on Ray: a killed actor, with and without Ray's death notices")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--repeats", type=int, default=5, help="repetitions of each scenario")
    parser.add_argument("--quick", action="store_true", help="one repetition (a smoke test)")
    add_out_argument(parser)
    args = parser.parse_args()
    repeats = 1 if args.quick else args.repeats
    if repeats < 1:
        parser.error(f"--repeats must be at least 1, but is {repeats}")
    import torch

    ray = start_ray()
    started = time.monotonic()
    print(
        f"{os.cpu_count()} cores, {platform.platform()}, "
        f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, ray {ray.__version__}, "
        f"torch {torch.__version__}; {repeats} repetitions; store on {HOST}",
        flush=True,
    )
    results: list[dict[str, Any]] = []
    try:
        bench = Bench()
        for rep in range(repeats):
            for scenario in SCENARIOS:
                for mode in MODES[rep % 2 :] + MODES[: rep % 2]:
                    result = {"scenario": scenario, "mode": mode, "rep": rep}
                    result |= bench.run(scenario, mode, rep)
                    results.append(result)
                    print(
                        f"  rep {rep}: {scenario}, {mode}: {seconds_text(result['seconds'])}"
                        f"{', Ray named' if result['ray_cause'] else ''}",
                        flush=True,
                    )
    finally:
        ray.shutdown()
    rows, figures = table(results)
    print()
    print("Seconds from the SIGKILL: fixed gang, to the later survivor's failed op; elastic")
    print("recovery, to both survivors' reform() returned; weights push: the push after it.")
    for row in rows + goal_lines(figures, results):
        print(row)
    args.out.mkdir(parents=True, exist_ok=True)
    document = {"repeats": repeats, "figures": figures, "goals": GOALS, "runs": results}
    (args.out / "ray.json").write_text(json.dumps(document, indent=1, default=str) + "\n")
    written = write_plots(
        [args.out / "ray.png"], lambda plt: draw(plt, figures, args.out / "ray.png")
    )
    print(
        f"Wrote {', '.join(str(p) for p in [args.out / 'ray.json', *written])} "
        f"in {time.monotonic() - started:.0f} s."
    )


if __name__ == "__main__":
    main()
