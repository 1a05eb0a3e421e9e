"""Every public function, class, method and property of fuseflow has a docstring (STYLE.md, item 9).

A method that overrides a documented one inherits its docstring (``inspect.getdoc``), so an
implementation of ``Task.reward`` needs none of its own; a new public name without one fails here.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
import types

import fuseflow


def undocumented(module: types.ModuleType) -> list[str]:
    """Dotted names of the public functions, classes, methods and properties defined in ``module`` that have
    no docstring of their own and inherit none."""
    missing = []
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if inspect.getdoc(obj) is None:
            missing.append(f"{module.__name__}.{name}")
        if not inspect.isclass(obj):
            continue
        for attr, member in vars(obj).items():
            if attr.startswith("_"):
                continue
            if not (inspect.isfunction(member) or isinstance(member, (staticmethod, classmethod, property))):
                continue
            if inspect.getdoc(getattr(obj, attr)) is None:  # a property on the class is the property itself
                missing.append(f"{module.__name__}.{name}.{attr}")
    return missing


def test_every_public_name_of_fuseflow_has_a_docstring():
    missing = []
    for info in pkgutil.walk_packages(fuseflow.__path__, "fuseflow."):
        missing += undocumented(importlib.import_module(info.name))
    assert not missing, f"{len(missing)} public names without a docstring: {', '.join(missing)}"


def test_the_check_finds_what_lacks_a_docstring(monkeypatch):
    module = types.ModuleType("fake")
    monkeypatch.setitem(sys.modules, "fake", module)  # inspect.getdoc finds a method's class through it
    source = '''
def documented():
    """Has one."""

def bare():
    pass

class Base:
    """A base."""

    def run(self):
        """Runs."""

class Child(Base):
    def run(self):  # inherits Base.run's docstring
        pass

    def extra(self):
        pass

    @property
    def size(self):
        return 1

    def _private(self):
        pass
'''
    exec(compile(source, "fake", "exec"), module.__dict__)  # noqa: S102 - a fixed test module
    assert undocumented(module) == ["fake.bare", "fake.Child.extra", "fake.Child.size"]
