"""Raw config trees: the YAML a user or a run directory supplies, before validation.

``fuseflow.config`` validates and freezes these trees; this module only reads them
(one reader for every YAML file: ``--config FILE``, a run's ``config.yaml``) and
applies dotted ``key=value`` overrides. Every error is a one-line ``ConfigError``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every config section: frozen, and a key it does not know is an error."""

    # extra="forbid" turns a typo in a key into an error instead of a silent default.
    model_config = ConfigDict(extra="forbid", frozen=True)


class ConfigError(ValueError):
    """A bad config value, with a one-line message meant for a person."""


def read_config_file(path: Path, source: str) -> dict[str, Any]:
    """Read a YAML config tree, the one reader for every config file a command takes.

    ``source`` starts every error message, so the user sees which flag and file are at
    fault, e.g. ``--config plan.yaml: not valid YAML (...)``.
    """
    try:
        tree = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"{source}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{source}: expected a mapping of config sections, got {type(tree).__name__}")
    return tree


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into a key path and a YAML-typed value."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value, e.g. trainer.steps=50")
    key, raw = item.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: empty key; expected a dotted key such as trainer.steps")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    """Set ``tree[path[0]][path[1]]... = value``, creating sections; a value in the way is an error."""
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path[: i + 1])}: is a value, not a section; cannot set {'.'.join(path)}")
        node = child
    node[path[-1]] = value
