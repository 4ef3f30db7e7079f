"""agang.ray's pure parts, without a cluster: the plan's checks, a spec's ranks and
pickling, Ray's error as one line of a death notice, and the extra's import."""

from __future__ import annotations

import math
import pickle
import subprocess
import sys

import pytest
from rayfakes import Handle

import agang
from agang._membership import deaths
from agang.ray._spec import GangSpec, plan
from agang.ray._why import MOST, actor_label, death_why

STORE = "127.0.0.1:29500"


def test_a_spec_keeps_the_actors_order_and_its_deadlines_and_pickles() -> None:
    actors = [Handle("a"), Handle("b"), Handle("c")]
    spec = plan(actors, store=STORE, name="trainers", timeout=30, op_timeout=math.inf)
    copy = pickle.loads(pickle.dumps(spec))
    assert isinstance(copy, GangSpec)
    assert copy == spec
    assert [copy.rank_of(Handle(i)) for i in "abc"] == [0, 1, 2]  # by id, any copy
    assert (copy.size, copy.timeout, copy.op_timeout) == (3, 30, math.inf)
    assert copy.namespace == f"agang/ray/trainers/{spec.plan_id}"
    # Planned again under the same name: keys of its own (rule 3).
    assert plan(actors, store=STORE, name="trainers").namespace != spec.namespace
    assert plan(actors, store=STORE, timeout=None).timeout == 60.0
    assert plan(actors, store=STORE, timeout=math.inf).timeout is None


def test_an_actor_outside_the_spec_is_refused_naming_the_members() -> None:
    spec = plan([Handle("a")], store=STORE)
    with pytest.raises(ValueError, match=r"not a member of gang 'gang'.*Handle\(a\)"):
        spec.rank_of(Handle("z"))


@pytest.mark.parametrize(
    ("arguments", "error", "words"),
    [
        ({"actors": []}, ValueError, "`actors` must name at least one"),
        ({"actors": "ab"}, TypeError, "`actors` must be a list"),
        ({"actors": [Handle("a"), Handle("a")]}, ValueError, r"`actors\[1\]` is `actors\[0\]`"),
        ({"store": "nowhere"}, ValueError, "`store` must be 'HOST:PORT'"),
        ({"name": "a b"}, ValueError, "`name` must be"),
        ({"name": ""}, ValueError, "`name` must be"),
        ({"timeout": -1}, ValueError, "timeout"),
        ({"op_timeout": "soon"}, TypeError, "op_timeout"),
        ({"elastic": 3}, TypeError, "`elastic` must be"),
        ({"elastic": agang.Elastic(min_size=3)}, ValueError, "min_size"),
        ({"elastic": agang.Elastic(min_size=1, max_size=1)}, ValueError, "max_size"),
    ],
)
def test_plan_refuses_bad_arguments_naming_them(
    arguments: dict[str, object], error: type[Exception], words: str
) -> None:
    given: dict[str, object] = {"actors": [Handle("a"), Handle("b")], "store": STORE}
    given.update(arguments)
    with pytest.raises(error, match=words):
        plan(**given)  # type: ignore[arg-type]


def test_a_non_actor_is_refused_where_handles_are_checked() -> None:
    with pytest.raises(TypeError, match=r"`actors\[1\]` must be a Ray actor handle"):
        plan(
            [Handle("a"), object()],
            store=STORE,
            is_actor=lambda actor: isinstance(actor, Handle),
        )


def test_rays_error_becomes_one_line_a_death_notice_takes() -> None:
    ray_words = "The actor died unexpectedly.\n\tclass_name: Rollout\n\tpid: 4242\n" + "x" * 5000
    error = type("ActorDiedError", (Exception,), {})(ray_words)
    why = death_why(actor_label("rollout-1", "3e33831c29a1ffff", 4242), error)
    assert why.startswith("actor 'rollout-1' (node 3e33831c29a1, pid 4242) died (Ray: ")
    assert "ActorDiedError: The actor died unexpectedly. class_name: Rollout" in why
    assert len(why) <= MOST
    assert not any(c in why for c in "\t\n\r")
    assert deaths._one_line(why, "why", MOST) == why  # what report_death accepts
    restarting = type("ActorUnavailableError", (Exception,), {})("restarting")
    assert "is gone (Ray restarts it)" in death_why(actor_label(None, "n", 1), restarting)
    assert actor_label(None, "n", 1).startswith("an unnamed actor")


def test_plain_import_agang_never_imports_ray() -> None:
    code = (
        "import sys, agang\n"
        "for name in agang.__all__: getattr(agang, name)\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_agang_ray_without_ray_says_which_extra_to_install() -> None:
    code = (
        "import sys\n"
        "sys.modules['ray'] = None\n"
        "try:\n"
        "    import agang.ray\n"
        "except ImportError as error:\n"
        "    assert \"pip install 'agang[ray]'\" in str(error), error\n"
        "else:\n"
        "    raise SystemExit('imported')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_join_refuses_what_is_not_a_spec_before_asking_ray() -> None:
    import anyio

    import agang.ray as ar

    with pytest.raises(TypeError, match=r"`spec` must be an agang\.ray\.GangSpec"):
        anyio.run(ar.join, {"name": "trainers"})  # type: ignore[arg-type]
