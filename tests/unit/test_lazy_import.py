"""``import agang`` is cheap: the package loads a public name's module on first use
(PEP 562), so ``agang --help``, ``agang --version`` and ``import agang`` load no torch.

The assertions are structural (which modules a fresh interpreter imported, as
``python -X importtime`` lists them), not timings, so they hold on any machine.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import agang

INIT = Path(agang.__file__)


def imported_modules(*arguments: str) -> set[str]:
    """The modules a fresh ``python -X importtime ARGUMENTS`` imported."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", *arguments],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
    return {line.rsplit("|", 1)[1].strip() for line in lines[1:]}  # the first is a header


@pytest.mark.parametrize(
    "arguments",
    [
        ["-c", "import agang"],
        ["-c", "import agang; agang.GangError; agang.__version__"],
        ["-m", "agang", "--help"],
        ["-m", "agang", "--version"],
        ["-m", "agang", "doctor", "--help"],
        ["-m", "agang", "store", "--help"],
    ],
    ids=["import", "errors", "help", "version", "doctor-help", "store-help"],
)
def test_no_torch_is_imported(arguments: list[str]) -> None:
    modules = imported_modules(*arguments)
    assert "agang" in modules  # the listing is read right
    assert "torch" not in modules
    assert not {name for name in modules if name.startswith("torch.")}


def type_checking_imports(path: Path = INIT) -> dict[str, str]:
    """Public name -> its module, from the ``if TYPE_CHECKING:`` imports of ``path``."""
    found: dict[str, str] = {}
    for node in ast.parse(path.read_text()).body:
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Name | ast.Attribute)):
            continue  # ``if not TYPE_CHECKING:`` is the interpreter's side
        if not ast.unparse(node.test).endswith("TYPE_CHECKING"):
            continue
        for statement in node.body:
            assert isinstance(statement, ast.ImportFrom), ast.unparse(statement)
            assert statement.module, ast.unparse(statement)
            for alias in statement.names:
                assert alias.asname == alias.name, "a re-export: `import X as X`"
                found[alias.name] = statement.module
    return found


def test_the_lazy_table_is_the_type_checkers_imports_and_all() -> None:
    seen = type_checking_imports()
    assert seen == agang._EXPORTS
    assert set(seen) == set(agang.__all__)


@pytest.mark.parametrize("name", agang.__all__)
def test_every_export_is_its_modules_object(name: str) -> None:
    module = importlib.import_module(agang._EXPORTS[name])
    assert getattr(agang, name) is getattr(module, name)
    namespace: dict[str, object] = {}
    exec(f"from agang import {name}", namespace)
    assert namespace[name] is getattr(module, name)


def test_a_fresh_interpreter_loads_each_name_on_first_use() -> None:
    program = (
        "import sys, agang\n"
        "assert 'agang._setup.init' not in sys.modules\n"
        "init = agang.init\n"
        "assert 'agang._setup.init' in sys.modules and 'torch' in sys.modules\n"
        "assert agang.init is init and vars(agang)['init'] is init  # loaded once\n"
        "print(sorted(set(agang.__all__) - set(dir(agang))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'agang' has no attribute 'Gnag'"):
        agang.Gnag  # type: ignore[attr-defined]  # noqa: B018
    assert not hasattr(agang, "Gnag")
    with pytest.raises(ImportError, match="cannot import name 'Gnag'"):
        exec("from agang import Gnag", {})
