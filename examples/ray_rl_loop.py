"""An RL-style loop on Ray: a gang of trainers, a weights channel to rollout actors,
and a rollout actor SIGKILLed while a push is in flight.

One command on a local cluster (``pip install 'agang[ray]'`` first)::

    python examples/ray_rl_loop.py [--steps 12] [--push-every 3] [--seed 0]

It starts a local Ray cluster (or joins the one ``RAY_ADDRESS`` names) and the job's
agang store, then:

- two ``Trainer`` actors form an agang gang (``agang.ray.join``) and train the same
  small MLP on their own shards of a synthetic regression task, all-reducing the
  gradients (sum, then / gang size), so their parameters stay identical;
- trainer rank 0 publishes its weights on the channel "policy" (an
  ``agang.WeightPublisher`` over detached copies it refreshes before each push) every
  ``--push-every`` steps, and returns each push's report;
- two ``Rollout`` actors ("rollout-0", "rollout-1", ``max_restarts=1``) subscribe
  (``agang.ray.subscribe``) and serve the newest version they received;
- at the second push the driver starts the step, then SIGKILLs rollout-1; the push
  drops it (with why), Ray restarts it, it subscribes again under its name and is
  admitted at the next push.

It prints a timeline and exits non-zero unless: every rollout's versions never go
back, rollout-1's drop is reported with why and Ray's cause (in the push's report where
Ray spoke first; else in the watcher's notice, which for an actor Ray restarts comes
only at its restart), the trainers end with identical parameters, and the restarted
rollout serves the last version, bit for bit.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import signal
import sys
import time
from typing import Any

import ray
import torch

import agang
import agang.ray as ar

CHANNEL = "policy"


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(1, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].detach().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class Trainer(ar.Member):
    """One member of the trainers' gang; rank 0 also publishes the weights."""

    def __init__(self, seed: int) -> None:
        torch.set_num_threads(1)
        self.seed = seed
        self.model = make_model(seed)  # the same start on every trainer
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.gang: Any = None
        self.publisher: Any = None
        self.weights: dict[str, torch.Tensor] = {}

    async def join(self, spec: ar.GangSpec, store: str) -> int:
        self.gang = await ar.join(spec)
        self.data = torch.Generator().manual_seed(self.seed * 100 + self.gang.rank)
        if self.gang.rank == 0:
            state = self.model.state_dict()
            self.weights = {name: t.detach().clone() for name, t in state.items()}
            self.publisher = await agang.WeightPublisher.open(
                self.weights, store=store, channel=CHANNEL, timeout=20
            )
        return int(self.gang.rank)

    async def step(self, push: int | None) -> dict[str, Any]:
        x = torch.rand(64, 1, generator=self.data) * 4 - 2  # this rank's own shard
        loss = torch.nn.functional.mse_loss(self.model(x), torch.sin(3 * x))
        self.optimizer.zero_grad()
        loss.backward()
        for param in self.model.parameters():
            await self.gang.all_reduce(param.grad)
            param.grad /= self.gang.size
        self.optimizer.step()
        result: dict[str, Any] = {"loss": loss.item()}
        if push is not None and self.publisher is not None:
            for name, tensor in self.model.state_dict().items():
                self.weights[name].copy_(tensor)
            report = await self.publisher.push(push)
            result.update(
                version=report.version,
                delivered=list(report.delivered),
                dropped=dict(report.dropped),
                checksum=checksum(self.weights),
            )
        return result

    async def params(self) -> str:
        return checksum(self.model.state_dict())


class Rollout(ar.Member):
    """Serves the newest weights it received on the channel."""

    def __init__(self, seed: int) -> None:
        torch.set_num_threads(1)
        shapes = make_model(seed).state_dict()
        self.tensors = {name: torch.zeros_like(t) for name, t in shapes.items()}
        self.subscriber: Any = None

    async def pid(self) -> int:
        return os.getpid()

    async def subscribe(self, store: str) -> str:
        self.subscriber = await ar.subscribe(self.tensors, store=store, channel=CHANNEL, timeout=30)
        return str(self.subscriber.name)

    async def serve(self) -> dict[str, Any]:
        with contextlib.suppress(TimeoutError):  # the newest version that came, if any
            await self.subscriber.receive(timeout=0.5)
        return {"version": self.subscriber.version, "checksum": checksum(self.tensors)}


def when_up(call: Any, seconds: float = 60.0) -> Any:
    """``call()``'s result once the actor Ray restarts answers."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return ray.get(call(), timeout=seconds)
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def short(why: str, limit: int = 120) -> str:
    return why if len(why) <= limit else why[: limit - 3] + "..."


def main() -> int:
    parser = argparse.ArgumentParser(
        description="agang on Ray: trainers' gang, a weights channel, a killed rollout.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=12, help="training steps")
    parser.add_argument("--push-every", type=int, default=3, help="push every K steps")
    parser.add_argument("--seed", type=int, default=0, help="the model's and data's seed")
    args = parser.parse_args()
    every = args.push_every
    if every < 1 or args.steps < 3 * every:
        parser.error("needs --push-every >= 1 and --steps >= 3 * --push-every (3 pushes)")
    kill_at = 2 * every  # the second push; at least one more follows
    address = os.environ.get("RAY_ADDRESS")
    own = {} if address else {"num_cpus": 4}  # a cluster of our own, else join it
    ray.init(address=address, include_dashboard=False, log_to_driver=False, **own)
    try:
        return run(args, kill_at)
    finally:
        ray.shutdown()  # the actors and the store die with the driver


def run(args: argparse.Namespace, kill_at: int) -> int:
    store = ar.store(host="127.0.0.1")
    trainers = [ray.remote(Trainer).options(num_cpus=0).remote(args.seed) for _ in range(2)]
    rollouts = [
        ray.remote(Rollout)
        .options(name=f"rollout-{i}", num_cpus=0, max_restarts=1)
        .remote(args.seed)
        for i in range(2)
    ]
    spec = ar.plan(trainers, store=store, name="trainers", timeout=60, op_timeout=30)
    ray.get([t.join.remote(spec, store) for t in trainers], timeout=90)  # opens the channel
    print("subscribed:", ray.get([r.subscribe.remote(store) for r in rollouts], timeout=60))
    served: dict[str, list[int]] = {"rollout-0": [], "rollout-1": []}
    reports: list[dict[str, Any]] = []
    started = time.monotonic()
    for step in range(1, args.steps + 1):
        push = step if step % args.push_every == 0 else None
        pid = ray.get(rollouts[1].pid.remote()) if push == kill_at else None
        pending = [t.step.remote(push) for t in trainers]
        if pid is not None:  # the push step is under way: kill rollout-1 now
            os.kill(pid, signal.SIGKILL)
            print(
                f"[{time.monotonic() - started:6.2f}s] step {step}: SIGKILL rollout-1 (pid {pid})"
            )
        result = ray.get(pending, timeout=120)[0]
        if push is None:
            continue
        reports.append(result)
        held = {}
        for name, rollout in zip(served, rollouts, strict=True):
            if name == "rollout-1" and push == kill_at:
                held[name] = "down"
                continue
            state = ray.get(rollout.serve.remote(), timeout=60)
            held[name] = state["version"]
            if state["version"] is not None:
                served[name].append(state["version"])
        dropped = {n: short(w) for n, w in result["dropped"].items()}
        print(
            f"[{time.monotonic() - started:6.2f}s] step {step}: push v{result['version']} "
            f"delivered={result['delivered']} dropped={dropped} held={held}"
        )
        if push == kill_at:  # Ray restarts it; it subscribes again under its name
            name = when_up(lambda: rollouts[1].subscribe.remote(store))
            print(f"[{time.monotonic() - started:6.2f}s] {name} restarted and subscribed again")
    return check(trainers, rollouts, served, reports)


def rays_word(actor: str, seconds: float = 30.0) -> list[str]:
    """The watcher's notices that name ``actor``, waited for: Ray tells of a restarted
    actor's death around its restart, and the watcher then asks the new incarnation's
    pid before it files the notice (the example may come to its checks first)."""
    deadline = time.monotonic() + seconds
    while True:
        told = [line for line in ar.death_notices() if actor in line]
        if told or time.monotonic() > deadline:
            return told
        time.sleep(0.1)


def check(
    trainers: list[Any],
    rollouts: list[Any],
    served: dict[str, list[int]],
    reports: list[dict[str, Any]],
) -> int:
    failures = []
    for name, versions in served.items():
        if versions != sorted(versions):
            failures.append(f"{name}'s versions went back: {versions}")
    whys = [r["dropped"]["rollout-1"] for r in reports if "rollout-1" in r["dropped"]]
    if not whys:
        failures.append("no push report dropped rollout-1")
    elif any("Ray:" in why for why in whys):
        print("rollout-1's drop names Ray's cause:", short(whys[0]))
    else:
        # Ray restarts rollout-1 (max_restarts=1), and tells of a restartable actor's
        # death only once it restarts it: seconds later, after this push dropped it on
        # agang's own blame. Ray's word then comes as the watcher's notice.
        told = rays_word("'rollout-1'")
        if not any("Ray:" in line for line in told):
            failures.append(f"no notice of Ray's names rollout-1's death: {told}")
        else:
            print("rollout-1's drop, by agang's blame:", short(whys[0]))
            print("and Ray's word, by the watcher:", short(told[0]))
    params = ray.get([t.params.remote() for t in trainers], timeout=60)
    if len(set(params)) != 1:
        failures.append(f"the trainers' parameters differ: {params}")
    last = reports[-1]
    final = ray.get(rollouts[1].serve.remote(), timeout=60)
    if (final["version"], final["checksum"]) != (last["version"], last["checksum"]):
        failures.append(
            f"rollout-1 serves v{final['version']} ({final['checksum']}), not the last push "
            f"v{last['version']} ({last['checksum']})"
        )
    for failure in failures:
        print("CHECK FAILED:", failure)
    if failures:
        return 1
    print("ray_rl_loop: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
