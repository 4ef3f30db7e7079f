"""An elastic gang across two nodes loses one node's link: the store's side reforms.

Node 0 runs the ``agang store`` (bound to its data address) and ranks 0 and 1; node 1
runs rank 2. With node 1's data link cut mid-training, every rank gets an agang error;
the two ranks on node 0 reform into epoch 1 and train on, exactly; rank 2, cut off from
the store, cannot reform and fails within its reform deadline, naming the store. When
its link comes back, its old gang still refuses every op, and the new gang's results
stay exact. Nodes are network namespaces (``tests/support/netns.py``).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest
from netns import Cluster
from noderun import Lines, node_env, start

OP_TIMEOUT = 2.0
REFORM_SECONDS = 4.0
STEPS_AFTER = 20
THIS = __file__

pytestmark = pytest.mark.gloo


@pytest.fixture(scope="module")
def scenario(netns: None) -> dict[str, Any]:
    with Cluster(num_nodes=2) as cluster:
        store_address = cluster.nodes[0].address("data")
        store = Lines(
            cluster.popen(
                0,
                [sys.executable, "-m", "agang", "store", "--host", store_address, "--quiet"],
                env=node_env(),
            )
        )
        port = int(store.wait_for("agang store listening on", 30).strip().rsplit(":", 1)[1])
        ranks = []
        for rank, node in enumerate((0, 0, 1)):
            env = node_env(
                MASTER_ADDR=store_address,
                MASTER_PORT=str(port),
                RANK=str(rank),
                WORLD_SIZE="3",
                LOCAL_RANK=str(rank if node == 0 else 0),
            )
            ranks.append(start(cluster, node, [THIS, "train"], env))
        for lines in ranks:
            lines.wait_for("READY", timeout=60)
        time.sleep(0.5)  # ops flowing on every rank
        cut = time.time()  # one clock: the nodes share this machine's kernel
        cluster.link_down(1, "data")
        failed = [lines.wait_for_json("FAILED ", timeout=OP_TIMEOUT + 30) for lines in ranks]
        reformed = [
            lines.wait_for_json("REFORMED ", timeout=REFORM_SECONDS + 30) for lines in ranks
        ]
        cluster.link_up(1, "data")
        for lines in ranks:
            lines.send("go")
        results = [lines.wait_for_json("RESULT ", timeout=60) for lines in ranks]
        codes = [lines.process.wait(30) for lines in ranks]
        outputs = ["".join(lines.lines) for lines in ranks]
    return {
        "outputs": outputs,
        "cut": cut,
        "failed": failed,
        "reformed": reformed,
        "results": results,
        "codes": codes,
    }


def test_every_rank_fails_within_the_op_timeout_after_the_cut(scenario: dict[str, Any]) -> None:
    for failure in scenario["failed"]:
        assert failure["error"] in ("GangTimeoutError", "CollectiveError", "GangBrokenError")
        assert 0 < failure["at"] - scenario["cut"] < OP_TIMEOUT + 5, failure


def test_the_ranks_on_the_stores_side_reform_and_train_on_exactly(
    scenario: dict[str, Any],
) -> None:
    first, second, _ = scenario["reformed"]
    ends = [(r.get("epoch"), r.get("rank"), r.get("size")) for r in (first, second)]
    assert ends == [(1, 0, 2), (1, 1, 2)], (first, second)
    for reform in (first, second):
        print(f"reformed {reform['at'] - scenario['cut']:.2f} s after the cut")
        assert reform["at"] - scenario["cut"] < OP_TIMEOUT + 20.0, reform
    for result in scenario["results"][:2]:
        assert result["exact"] == STEPS_AFTER, result
    failed = [i for i, code in enumerate(scenario["codes"]) if code != 0]
    assert not failed, f"exit codes {scenario['codes']}: " + "\n".join(
        scenario["outputs"][i][-3000:] for i in failed
    )


def test_the_cut_off_rank_cannot_reform_and_its_old_gang_stays_broken(
    scenario: dict[str, Any],
) -> None:
    stray = scenario["reformed"][2]
    assert stray["error"] == "GangInitError", stray
    assert stray["at"] - scenario["cut"] < OP_TIMEOUT + REFORM_SECONDS + 5, stray
    result = scenario["results"][2]
    assert result["calls"] > 0, result
    assert result["outcomes"] == ["GangBrokenError"], result  # every call, after the link returned


# -- the ranks' program -------------------------------------------------------------------


async def _train() -> dict[str, Any]:
    import json

    import anyio
    import torch

    import agang

    def say(marker: str, **fields: Any) -> None:
        print(f"{marker} {json.dumps(fields)}", flush=True)

    gang = await agang.init(elastic=agang.Elastic(min_size=2), timeout=60, op_timeout=OP_TIMEOUT)
    print("READY", flush=True)
    while True:
        try:
            await gang.all_reduce(torch.ones(256))
            await anyio.sleep(0.01)
        except agang.GangError as error:
            say("FAILED", error=type(error).__name__, at=time.time())
            break
    old = gang
    try:
        # The cut-off rank gives up soon; the others have time to make their group.
        gang = await gang.reform(timeout=REFORM_SECONDS if gang.rank == 2 else 20.0)
    except agang.GangError as error:
        say("REFORMED", error=type(error).__name__, message=str(error), at=time.time())
        await anyio.to_thread.run_sync(sys.stdin.readline)  # "go": the link is back
        outcomes: set[str] = set()
        calls = 0
        ends = time.monotonic() + 1.0
        while time.monotonic() < ends:
            try:
                with anyio.fail_after(2):
                    await old.all_reduce(torch.ones(4))
                outcomes.add("succeeded")
            except agang.GangError as refused:
                outcomes.add(type(refused).__name__)
            calls += 1
        await old.close()
        return {"calls": calls, "outcomes": sorted(outcomes)}
    say("REFORMED", epoch=gang.epoch, rank=gang.rank, size=gang.size, at=time.time())
    await anyio.to_thread.run_sync(sys.stdin.readline)
    exact = 0
    for step in range(STEPS_AFTER):
        total = await gang.all_reduce(torch.full((4,), float(gang.rank + 1 + step)))
        exact += total.tolist() == [float(2 * step + 3)] * 4
    await gang.close()
    return {"exact": exact}


if __name__ == "__main__":
    import json

    import anyio

    assert sys.argv[1] == "train", sys.argv
    print("RESULT " + json.dumps(anyio.run(_train)), flush=True)
