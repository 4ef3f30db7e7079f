"""The package's shape: folders that name its parts, layers that import one way, no
import circles, modules sized by their code, and no class spread over two modules.

A newcomer reads the layout as the architecture; these checks keep it so as it grows.
Every import counts, whether at module level, under ``TYPE_CHECKING`` or inside a
function: a circle through a type-only or a lazy import is a circle in the design all
the same. A lazy import kept so that importing agang stays cheap is named in
:data:`LAZY_IMPORTS` with its reason.

An object's private attributes (``_name``) are read and written by its own class's
module only; code elsewhere goes through that module's narrow functions or methods. The
accesses that remain are another library's privates, each listed in
:data:`PRIVATE_ACCESSES` with its reason, so that their number cannot grow unseen.

The checkers are plain functions over an import graph; ``test_the_checks_catch_*`` runs
them on planted packages, so a checker that quietly stopped seeing is itself caught.
"""

from __future__ import annotations

import ast
import collections
import importlib
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
from collections.abc import Mapping
from pathlib import Path

import pytest

import agang

ROOT = Path(agang.__file__).parent
TESTS = Path(__file__).resolve().parents[1]  # tests/, above unit/
MODULES = sorted(ROOT.rglob("*.py"))
MAX_CODE_LINES = 500
MAX_TOP_LEVEL_PRIVATE_MODULES = 10

# The layers, top to bottom: a module may import its own layer's modules and those of
# the layers below it, never those above. By module-name prefix; the longest matches.
LAYERS: dict[str, int] = {
    "agang.__main__": 1,
    "agang._cli": 1,  # the commands
    "agang.testing": 2,  # public testing tools
    "agang.ray": 2,  # agang on Ray (the extra agang[ray]): a public tool above the face
    "agang": 3,  # the public face: re-exports only
    "agang._weights": 3,  # weights to a changing fleet: above set-up, re-exported
    "agang._setup": 4,  # making the root gang, elastic gangs, epoch gangs
    "agang._parallel": 4,  # gangs for parallel layouts, DeviceMesh
    "agang._gradient_sync": 4,  # a feature on the public Gang API
    "agang._membership": 5,  # the store, members, epochs, beats: below both features
    "agang._collective": 6,  # the one Gang implementation and its collectives
    "agang._engine": 7,  # one gang's op machinery
    "agang._gang": 7,  # the interface
    "agang._backends": 8,  # the seam and what stands behind it
    "agang._handle": 8,  # what a call returns
    "agang._runtime": 9,  # loops, threads, fork, futures
    "agang._policy": 9,
    "agang._errors": 10,
    "agang._reduce_op": 10,
    "agang._statistics": 10,
    "agang._validate": 10,
}

# Imports inside functions, each with the reason it is not at module level.
LAZY_IMPORTS: dict[tuple[str, str], str] = {
    ("agang.__main__", "agang._cli.store"): "the store command's modules load for it only",
    ("agang.__main__", "agang._cli.selfcheck.run"): "torch's CUDA paths load for it only",
    ("agang.__main__", "agang._cli.doctor.command"): "torch loads for the doctor only",
    ("agang._cli.selfcheck.run", "agang._cli.selfcheck.cuda_harness"): "only with a GPU",
    ("agang._cli.store", "agang._setup.rendezvous"): "torch.distributed loads on bind only",
    ("agang._parallel.gangs", "agang._parallel.mesh"): "torch's DeviceMesh loads on use only",
}

# Modules allowed past MAX_CODE_LINES: each its own cap, with words its first paragraph
# must contain (where it says why it is one piece). Every other module keeps 500.
LONG_MODULES: dict[str, tuple[int, str]] = {
    # A gang's engine is its kernel: every rule reads and writes the same state under the
    # gang's one lock, and the common op passes through it in one go, so it is one long
    # module in banner sections ("# ---- Admission ----") rather than halves that read
    # each other's fields; twice it was trimmed back under 500 with no natural split left.
    # Its own cap still bounds it: past it, something in it has a home of its own.
    "_engine/engine.py": (550, "one piece"),
}


# Another library's private names that agang uses, by reason: "module: expression", one
# entry per use (a use twice in a module is listed twice). Everything else private that
# agang touches is its own, used only by the module that defines it.
PRIVATE_ACCESSES: dict[str, list[str]] = {
    # Module privates (a private name of another library's module).
    "c10d's default group and store: torch.distributed has no public way to ask for the "
    "default group without making one, nor for the store it was made on": [
        "_backends/c10d/children.py: dist.distributed_c10d._get_default_group",
        "_backends/c10d/children.py: dist.distributed_c10d._get_default_store",
        "_backends/c10d/world.py: dist.distributed_c10d._get_default_store",
        "_parallel/mesh.py: dist.distributed_c10d._get_default_group",
        "_setup/elastic_gang.py: dist.distributed_c10d._get_default_group",
        "_setup/init.py: dist.distributed_c10d._get_default_group",
        "_setup/init.py: dist.distributed_c10d._get_default_group",
        "_setup/rendezvous.py: dist.distributed_c10d._get_default_group",
    ],
    "c10d's registry of groups (_world): whether a group is still registered before "
    "destroying it, and whether a mesh's group is known by name": [
        "_backends/c10d/backend.py: dist.distributed_c10d._world",
        "_parallel/mesh.py: dist.distributed_c10d._world",
    ],
    "a forked child forgets the parent's groups: c10d has no public way to empty its "
    "registry without destroying the groups, which the parent still uses": [
        "_backends/c10d/fork.py: c10d._world",
        "_backends/c10d/fork.py: c10d._update_default_pg",
        "_backends/c10d/fork.py: c10d._unregister_all_process_groups",
    ],
    "asyncio's running loop or None, without the exception get_running_loop raises (C, "
    "once per op on the hot path; asyncio's own code calls it so)": [
        "_engine/deadlines.py: asyncio._get_running_loop",
        "_runtime/fork.py: asyncio._get_running_loop",
        "_runtime/loops.py: asyncio._get_running_loop",
        "_runtime/loops.py: asyncio._get_running_loop",
        "_runtime/loops.py: asyncio._get_running_loop",
        "_runtime/loops.py: asyncio._get_running_loop",
        "_runtime/loops.py: asyncio._get_running_loop",
    ],
    "torch's fused C++ flatten and multi-tensor copy, what torch's DDP buckets use: "
    "views and copies one by one from Python cost microseconds a tensor": [
        "_engine/grouping.py: torch._C._nn",
        "_engine/grouping.py: torch._foreach_copy_",
        "_engine/grouping.py: torch._foreach_copy_",
        "_engine/grouping.py: torch._foreach_copy_",
    ],
    "autograd's engine, whose queue_callback runs at the end of the running backward "
    "(what DDP uses for the same purpose)": [
        "_gradient_sync.py: torch.autograd.Variable._execution_engine",
    ],
    "the caller's frame for an order check's call site: inspect.stack reads every "
    "frame's source, far too slow per op": [
        "_backends/fingerprint.py: sys._getframe",
    ],
    "a GPU kernel that runs for a given number of cycles: the self-check's slow op": [
        "_cli/selfcheck/cuda_harness.py: torch.cuda._sleep",
        "_cli/selfcheck/cuda_harness.py: torch.cuda._sleep",
    ],
    # Object privates (a private attribute of another library's object).
    "ProcessGroup's flat collectives and coalescing, the methods torch.distributed's own "
    "functions call, called on the group itself so that a group double works too": [
        "_backends/c10d/calls.py: group._allgather_base",
        "_backends/c10d/calls.py: group._reduce_scatter_base",
        "_backends/c10d/calls.py: group._start_coalescing",
        "_backends/c10d/calls.py: group._end_coalescing",
        "_backends/c10d/calls.py: group._end_coalescing",
    ],
    "a ProcessGroup's backend for one device: NCCL's eager connect and error, Gloo's "
    "options and abort, which the group itself does not offer": [
        "_backends/c10d/abort.py: group._get_backend",
        "_backends/c10d/calls.py: group._get_backend",
        "_backends/cuda/runtime.py: process_group._get_backend",
    ],
    "an epoch's Gloo (or NCCL) group made on a store of its own, bound to one interface "
    "(or device), as "
    "torch.distributed's new_group makes one inside (its public path needs a default "
    "group, which an epoch gang must not have)": [
        "_setup/epoch_gang.py: dist.ProcessGroupGloo._Options",
        "_setup/epoch_gang.py: options._devices",
        "_setup/epoch_gang.py: options._timeout",
        "_setup/epoch_gang.py: group._register_backend",
        "_setup/epoch_gang.py: group._set_default_backend",
        "_setup/epoch_gang.py: group._set_group_name",
        "_setup/nccl_epoch_gang.py: options._timeout",
    ],
    "a forked child's asyncio loop gets a selector and self-pipe of its own, sharing "
    "none with the parent's (asyncio has no public way)": [
        "_runtime/fork.py: loop._selector",
        "_runtime/fork.py: loop._close_self_pipe",
        "_runtime/fork.py: loop._make_self_pipe",
    ],
}


# The import graph.


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str, root: Path) -> bool:
    relative = Path(*name.split(".")[1:])
    return (root / relative).with_suffix(".py").exists() or (
        root / relative / "__init__.py"
    ).exists()


def imports_of(path: Path, root: Path = ROOT) -> dict[str, bool]:
    """The package's modules ``path`` imports, anywhere in it (module level, under
    ``TYPE_CHECKING``, inside functions), each with whether it is inside a function."""
    package = root.name
    tree = ast.parse(path.read_text())
    found: dict[str, bool] = {}

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                assert child.level == 0, f"{path}: {package} uses absolute imports"
                base = child.module or ""
                for alias in child.names:
                    candidate = f"{base}.{alias.name}"
                    names.append(candidate if _is_module(candidate, root) else base)
            for name in names:
                if name == package or name.startswith(f"{package}."):
                    found[name] = found.get(name, True) and in_function
            visit(child, nested)

    visit(tree, False)
    return found


def import_graph(root: Path = ROOT) -> dict[str, dict[str, bool]]:
    """Module -> {imported module: only inside functions}. Importing a module runs its
    packages' ``__init__`` first; a package's ``__init__`` importing its own children,
    and a module importing its own package, are not edges."""
    modules = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, dict[str, bool]] = {}
    for name, path in modules.items():
        edges = imports_of(path, root)
        graph[name] = {
            target: lazy
            for target, lazy in edges.items()
            if target in modules
            and target != name
            and not name.startswith(f"{target}.")
            and not (path.name == "__init__.py" and target.startswith(f"{name}."))
        }
    return graph


def find_circle(graph: Mapping[str, Mapping[str, bool]]) -> list[str] | None:
    """One import circle of ``graph`` as a path that ends where it starts, or None."""
    visiting: list[str] = []
    done: set[str] = set()

    def visit(name: str) -> list[str] | None:
        if name in done:
            return None
        if name in visiting:
            return [*visiting[visiting.index(name) :], name]
        visiting.append(name)
        for target in sorted(graph[name]):
            circle = visit(target)
            if circle is not None:
                return circle
        visiting.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        circle = visit(name)
        if circle is not None:
            return circle
    return None


def layer_of(module: str, layers: Mapping[str, int] = LAYERS) -> int:
    matches = [p for p in layers if module == p or module.startswith(f"{p}.")]
    assert matches, f"{module} is in no layer: add its folder to LAYERS"
    return layers[max(matches, key=len)]


def upward_imports(
    graph: Mapping[str, Mapping[str, bool]], layers: Mapping[str, int] = LAYERS
) -> list[str]:
    """The imports that run from a lower layer up to a higher one."""
    return [
        f"{source} (layer {layer_of(source, layers)}) -> {target} "
        f"(layer {layer_of(target, layers)})"
        for source, targets in sorted(graph.items())
        for target in sorted(targets)
        if layer_of(target, layers) < layer_of(source, layers)
    ]


def longest_chain(graph: Mapping[str, Mapping[str, bool]]) -> list[str]:
    """The longest path of imports (the graph has no circle)."""
    best: dict[str, list[str]] = {}

    def chain(name: str) -> list[str]:
        if name not in best:
            tails = [chain(target) for target in graph[name]]
            best[name] = [name, *max(tails, key=len, default=[])]
        return best[name]

    return max((chain(name) for name in graph), key=len)


def code_lines(text: str) -> int:
    """Lines that hold code: not blank, not only a comment, not part of a docstring."""
    tree = ast.parse(text)
    docstrings: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    skipped = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT}
    skipped |= {tokenize.DEDENT, tokenize.ENDMARKER}
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in skipped:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


# The package.


def test_no_import_circle_counting_type_only_and_function_level_imports() -> None:
    assert find_circle(import_graph()) is None


def test_no_import_runs_up_a_layer() -> None:
    assert upward_imports(import_graph()) == []


def test_every_function_level_import_is_listed_with_its_reason() -> None:
    lazy = {
        (source, target)
        for source, targets in import_graph().items()
        for target, in_function in targets.items()
        if in_function
    }
    assert lazy == set(LAZY_IMPORTS)


def test_no_module_is_over_its_cap_of_lines_of_code_and_a_long_one_says_why() -> None:
    sizes = {p.relative_to(ROOT).as_posix(): code_lines(p.read_text()) for p in MODULES}
    over = {
        path: n for path, n in sizes.items() if n > LONG_MODULES.get(path, (MAX_CODE_LINES, ""))[0]
    }
    assert over == {}, "past its cap (500, or its own in LONG_MODULES)"
    for path, (_, words) in LONG_MODULES.items():
        docstring = ast.get_docstring(ast.parse((ROOT / path).read_text())) or ""
        assert words in docstring.split("\n\n")[0], path


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_private_names(tree: ast.AST) -> set[str]:
    """The private names that the module's classes define: their methods, class-level
    names and ``__slots__``, and what their methods assign on ``self`` or ``cls``."""
    names: set[str] = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in cls.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        names.add(target.id)
                        if target.id == "__slots__" and node.value is not None:
                            names.update(
                                c.value
                                for c in ast.walk(node.value)
                                if isinstance(c, ast.Constant) and isinstance(c.value, str)
                            )
        names.update(_self_stores(cls))
    return {name for name in names if _is_private(name)}


def _self_stores(cls: ast.ClassDef) -> set[str]:
    return {
        node.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id in ("self", "cls")
    }


def private_accesses(path: Path, root: Path = ROOT) -> list[str]:
    """``"module: expression"`` for each access in ``path`` to a private attribute
    (``x._name``, not a dunder) of anything but ``self`` or ``cls``, where no class of
    that module defines ``_name``: another module's object's privates, or another
    library's. A chain (``torch._C._nn``) counts once."""
    tree = ast.parse(path.read_text())
    own = _own_private_names(tree)
    inner = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and _is_private(node.attr)
    }
    where = path.relative_to(root).as_posix()
    return [
        f"{where}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and _is_private(node.attr)
        and id(node) not in inner
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        and node.attr not in own
    ]


def inherited_private_writes(modules: list[types.ModuleType], package: str = "agang") -> list[str]:
    """``"module.Class: Base._name"`` for each private attribute that a class's methods
    assign on ``self`` and that a base class of another module of the package defines:
    a subclass writing its base's state in place of the base's own code."""
    trees: dict[str, ast.Module] = {}

    def class_def(cls: type) -> ast.ClassDef | None:
        module = sys.modules[cls.__module__]
        if module.__file__ not in trees:
            trees[module.__file__ or ""] = ast.parse(Path(module.__file__ or "").read_text())
        tree = trees[module.__file__ or ""]
        return next(
            (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__),
            None,
        )

    writes = []
    for module in modules:
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != module.__name__:
                continue
            mine = class_def(cls)
            if mine is None:
                continue
            stores = {name for name in _self_stores(mine) if _is_private(name)}
            for base in cls.__mro__[1:]:
                home = base.__module__
                if home == cls.__module__ or not (
                    home == package or home.startswith(f"{package}.")
                ):
                    continue
                theirs = class_def(base)
                if theirs is None:
                    continue
                defined = _self_stores(theirs) | set(getattr(base, "__slots__", ()))
                writes.extend(
                    f"{cls.__module__}.{cls.__qualname__}: {base.__qualname__}.{name}"
                    for name in sorted(stores & defined)
                )
    return writes


def stray_methods(modules: list[types.ModuleType], package: str = "agang") -> list[str]:
    """The methods of the modules' classes that are functions of another module of the
    package: ``name = other_module.function`` in a class body spreads a class over two
    files, its methods living where a reader of the class does not look."""
    strays = []
    for module in modules:
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != module.__name__:
                continue
            for name, value in vars(cls).items():
                function = getattr(value, "__func__", value)  # staticmethod, classmethod
                home = getattr(function, "__module__", None) or ""
                if (
                    inspect.isfunction(function)
                    and (home == package or home.startswith(f"{package}."))
                    and home != cls.__module__
                ):
                    strays.append(f"{cls.__module__}.{cls.__qualname__}.{name} ({home})")
    return strays


def test_no_class_has_methods_defined_in_another_module() -> None:
    modules = [importlib.import_module(module_name(path)) for path in MODULES]
    assert stray_methods(modules) == []


def test_only_the_listed_private_names_of_other_libraries_are_used() -> None:
    found = collections.Counter(access for path in MODULES for access in private_accesses(path))
    allowed = collections.Counter(a for accesses in PRIVATE_ACCESSES.values() for a in accesses)
    assert {a: n for a, n in found.items() if n > allowed[a]} == {}, "new: add a reason or a method"
    assert {a: n for a, n in allowed.items() if n > found[a]} == {}, "gone: take them off the list"


def test_no_class_writes_the_private_state_of_a_base_in_another_module() -> None:
    modules = [importlib.import_module(module_name(path)) for path in MODULES]
    assert inherited_private_writes(modules) == []


def test_the_top_level_holds_few_private_modules() -> None:
    top = [p.name for p in ROOT.glob("_*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(top) <= MAX_TOP_LEVEL_PRIVATE_MODULES, sorted(top)


def test_every_folder_is_a_regular_package_that_says_what_it_holds() -> None:
    # A folder without __init__.py is a namespace package: an editable install finds it,
    # but a built wheel leaves it out (setuptools' find_packages skips it).
    for folder in sorted({p.parent for p in MODULES}):
        init = folder / "__init__.py"
        assert init.exists(), folder
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init} has no docstring"


def test_the_code_cites_no_document_outside_the_repository() -> None:
    outside = re.compile(r"design\.md|facts\.md|fault[- ]matrix|nccl-audit|style\.md|\.\./shared")
    tests = sorted(TESTS.rglob("*.py"))  # every folder of tests, support included
    seen = {p.relative_to(TESTS).parts[0] for p in tests}
    assert {"conftest.py", "unit", "world", "gloo", "support"} <= seen, seen
    cited = [
        f"{p.name}:{i}"
        for p in [*MODULES, *tests]
        if p.name != Path(__file__).name
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if outside.search(line)
    ]
    assert cited == []


# The checks themselves, on planted packages.


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


@pytest.mark.parametrize(
    "import_b_to_a",
    [
        "from pkg import a",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A",
        "def f():\n    from pkg.a import A",
    ],
    ids=["module-level", "type-checking", "function-level"],
)
def test_the_checks_catch_a_planted_circle(tmp_path: Path, import_b_to_a: str) -> None:
    root = _plant(
        tmp_path,
        {"__init__.py": '"""pkg"""', "a.py": "from pkg import b\nA = 1\n", "b.py": import_b_to_a},
    )
    graph = import_graph(root)
    assert find_circle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    assert graph["pkg.b"] == {"pkg.a": import_b_to_a.startswith("def")}


def test_the_checks_catch_a_planted_upward_import(tmp_path: Path) -> None:
    root = _plant(
        tmp_path,
        {
            "__init__.py": '"""pkg"""',
            "high/__init__.py": '"""high"""',
            "high/h.py": "from pkg.low import l\n",
            "low/__init__.py": '"""low"""',
            "low/l.py": "import typing\nif typing.TYPE_CHECKING:\n    import pkg.high.h\n",
        },
    )
    graph = import_graph(root)
    layers = {"pkg": 1, "pkg.high": 2, "pkg.low": 3}
    assert find_circle(graph) == ["pkg.high.h", "pkg.low.l", "pkg.high.h"]
    assert upward_imports(graph, layers) == ["pkg.low.l (layer 3) -> pkg.high.h (layer 2)"]
    assert longest_chain({"a": {"b": False}, "b": {"c": False}, "c": {}}) == ["a", "b", "c"]


def test_the_checks_catch_a_planted_method_from_another_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _plant(
        tmp_path,
        {
            "__init__.py": '"""pkg"""',
            "ending.py": "def complete(self):\n    return 1\n",
            "engine.py": "from pkg import ending\nclass Engine:\n    complete = ending.complete\n",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    engine = importlib.import_module("pkg.engine")
    try:
        assert stray_methods([engine], package="pkg") == ["pkg.engine.Engine.complete (pkg.ending)"]
    finally:
        for name in [name for name in sys.modules if name == "pkg" or name.startswith("pkg.")]:
            del sys.modules[name]


def test_code_lines_leave_out_docstrings_comments_and_blank_lines() -> None:
    text = '''
    """A module.

    Its docstring.
    """

    # A comment.
    X = (
        1,  # a comment after code
    )


    def f() -> str:
        """A docstring."""
        return """a string that is code"""
    '''
    assert code_lines(textwrap.dedent(text)) == 5


def test_the_checks_catch_a_planted_private_access(tmp_path: Path) -> None:
    root = _plant(
        tmp_path,
        {
            "__init__.py": '"""pkg"""',
            "box.py": """
                class Box:
                    __slots__ = ("_held",)

                    def __init__(self):
                        self._held = 1

                    def _take(self):
                        return self._held

                def peek(box):
                    return box._held, box._take()  # the module's own: not counted
            """,
            "user.py": """
                import torch

                def use(box, other):
                    other._held = 2
                    return box._take(), torch._C._nn, self_free(box).__class__
            """,
        },
    )
    assert private_accesses(root / "box.py", root) == []
    assert sorted(private_accesses(root / "user.py", root)) == [
        "user.py: box._take",
        "user.py: other._held",
        "user.py: torch._C._nn",
    ]


def test_the_checks_catch_a_planted_write_of_a_base_classes_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _plant(
        tmp_path,
        {
            "__init__.py": '"""pkg"""',
            "base.py": "class Base:\n    def __init__(self):\n        self._state = 0\n",
            "child.py": (
                "from pkg.base import Base\n"
                "class Child(Base):\n"
                "    def __init__(self):\n"
                "        self._state = 1\n"
                "        self._own = 2\n"
            ),
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    child = importlib.import_module("pkg.child")
    try:
        assert inherited_private_writes([child], package="pkg") == ["pkg.child.Child: Base._state"]
    finally:
        for name in [name for name in sys.modules if name == "pkg" or name.startswith("pkg.")]:
            del sys.modules[name]
