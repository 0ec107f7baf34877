"""Typed configuration: pydantic models, a YAML file, and dotted overrides.

Every config model derives from `StrictModel` (`extra="forbid"`), documents each field with a
docstring under it, and is loaded with `load_config(Model, path, overrides)`. Overrides are
`a.b.c=value` strings whose value is parsed as YAML (`trainer.lr=1e-6`, `tags=[a,b]`). An
unknown key is rejected with the list of valid keys at that level.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from omniloop.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    """Base of every config model: unknown keys are an error, field docstrings are descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)


def _valid_keys(model: type[BaseModel], path: list[str]) -> list[str] | None:
    """The field names of the sub-model reached by `path`, or None if the path leaves models."""
    current: type[BaseModel] | None = model
    for part in path:
        field = current.model_fields.get(part) if current is not None else None
        if field is None:
            return None
        annotation = field.annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        current = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
        if current is None:
            return None
    return sorted(current.model_fields) if current is not None else None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set `a.b.c=value` overrides into a nested dict (values parsed as YAML)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    f"override {item!r}: {part!r} holds {child!r}, not a section with keys"
                )
            node = child
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    return data


def format_validation_error(model: type[BaseModel], err: ValidationError) -> str:
    """A readable message: each bad value with its dotted path, and the valid keys for typos."""
    lines = [f"invalid {model.__name__} configuration:"]
    for e in err.errors():
        path = [str(p) for p in e["loc"]]
        dotted = ".".join(path) or "<root>"
        if e["type"] == "extra_forbidden":
            valid = _valid_keys(model, path[:-1])
            hint = f"; valid keys here: {', '.join(valid)}" if valid else ""
            lines.append(f"  {dotted}: unknown key{hint}")
        else:
            lines.append(f"  {dotted}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def load_config(model: type[M], path: str | Path | None, overrides: list[str] | None = None) -> M:
    """Load `model` from a YAML file (optional) plus dotted overrides; raise `ConfigError`."""
    data: dict[str, Any] = {}
    base_dir: Path | None = None
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
        data = loaded
        base_dir = path.parent.resolve()
    data = apply_overrides(data, list(overrides or []))
    try:
        return model.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as err:
        raise ConfigError(format_validation_error(model, err)) from None


def dump_config(config: BaseModel) -> str:
    """The resolved configuration as YAML, for printing and saving with a run."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def import_object(spec: str, base_dir: Path | None = None) -> Any:
    """Resolve `package.module:attr` or `path/to/file.py:attr` (relative to `base_dir`)."""
    import importlib
    import importlib.util
    import sys

    module_part, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise ConfigError(f"{spec!r} is not of the form module:attribute or file.py:attribute")
    if module_part.endswith(".py"):
        path = Path(module_part)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if not path.is_file():
            raise ConfigError(f"{spec!r}: file {str(path)!r} does not exist")
        name = f"omniloop_user_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(name)
        if module is None:
            file_spec = importlib.util.spec_from_file_location(name, path)
            if file_spec is None or file_spec.loader is None:
                raise ConfigError(f"{spec!r}: cannot load {str(path)!r} as Python")
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[name] = module
            file_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as err:
            raise ConfigError(f"{spec!r}: cannot import {module_part!r}: {err}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{spec!r}: {module_part!r} has no attribute {attr!r}") from None
