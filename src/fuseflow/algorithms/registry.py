"""Name -> function registries for advantage estimators and policy losses.

The config names an estimator or a loss by string; adding a variant is one
function plus one decorator line, never a copied trainer. Registered functions keep
their own natural signatures; :func:`call_with_inputs` lets a caller that holds a
pool of named tensors call any of them uniformly.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "ADVANTAGES",
    "POLICY_LOSSES",
    "register_advantage",
    "register_policy_loss",
    "get_advantage",
    "get_policy_loss",
    "call_with_inputs",
]

F = TypeVar("F", bound=Callable[..., Any])

ADVANTAGES: dict[str, Callable[..., Any]] = {}
POLICY_LOSSES: dict[str, Callable[..., Any]] = {}


def _register(table: dict[str, Callable[..., Any]], kind: str, name: str) -> Callable[[F], F]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name must be a non-empty string, got {name!r}")

    def deco(fn: F) -> F:
        if name in table and table[name] is not fn:
            raise ValueError(f"{kind} {name!r} is already registered to {table[name].__qualname__}; "
                             "pick another name")
        table[name] = fn
        return fn

    return deco


def _lookup(table: dict[str, Callable[..., Any]], kind: str, name: str) -> Callable[..., Any]:
    try:
        return table[name]
    except KeyError:
        known = ", ".join(sorted(table)) or "(none registered)"
        raise ValueError(f"unknown {kind} {name!r}; known: {known}") from None


def register_advantage(name: str) -> Callable[[F], F]:
    """Decorator that makes an advantage estimator selectable by ``name``.

    Example: ``@register_advantage("my_adv")`` above ``def my_adv(scores, group_ids)``;
    registering a different function under a taken name is a ValueError.
    """
    return _register(ADVANTAGES, "advantage estimator", name)


def register_policy_loss(name: str) -> Callable[[F], F]:
    """Decorator that makes a policy loss selectable by ``name``."""
    return _register(POLICY_LOSSES, "policy loss", name)


def get_advantage(name: str) -> Callable[..., Any]:
    """Return the advantage estimator registered as ``name``; ValueError lists the known ones."""
    return _lookup(ADVANTAGES, "advantage estimator", name)


def get_policy_loss(name: str) -> Callable[..., Any]:
    """Return the policy loss registered as ``name``; ValueError lists the known ones."""
    return _lookup(POLICY_LOSSES, "policy loss", name)


def call_with_inputs(fn: Callable[..., Any], **inputs: Any) -> Any:
    """Call ``fn`` with the subset of ``inputs`` its signature names.

    A trainer holds every tensor it might need (``token_rewards``, ``values``,
    ``scores``, ``group_ids``, ``gamma`` ...) and lets each estimator take what it
    uses. A required parameter missing from ``inputs`` is a ValueError naming it.
    """
    sig = inspect.signature(fn)
    kwargs: dict[str, Any] = {}
    for pname, param in sig.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if pname in inputs:
            kwargs[pname] = inputs[pname]
        elif param.default is param.empty:
            name = getattr(fn, "__name__", repr(fn))
            raise ValueError(f"{name} needs input {pname!r}, which was not provided "
                             f"(provided: {', '.join(sorted(inputs)) or 'nothing'})")
    return fn(**kwargs)
