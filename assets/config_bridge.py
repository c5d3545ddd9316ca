"""Dagster ``Config`` classes derived from posttrain's config dataclasses: one field list, not two.

A recipe's library config (``SupervisedConfig``, ``DpoConfig``, ``RLConfig`` ...) is the single source of
its fields, types, defaults and ``Literal`` choices. :func:`dagster_config` turns it into a ``dg.Config``
for the launchpad: the ``training: TrainingConfig`` part is flattened to the top level (users type
``learning_rate``, not ``training.learning_rate``), other nested dataclasses (``adam``) stay nested,
``Literal`` types become launchpad enums, and a few asset-specific defaults may be overridden. Fields
the asset fills in itself (``log_dir``, ``base_model``) are left out, and Dagster-only fields (e.g.
``init_from`` naming a checkpoint) are added. :func:`library_config` maps a launchpad config back.

Float fields accept a number in any notation (:data:`LaunchpadFloat`): the launchpad re-writes its YAML
in JavaScript, which prints ``1e-12`` (never ``1.0e-12``), and Dagster parses the YAML with PyYAML (YAML
1.1), which reads ``1e-12`` as a *string*; a plain ``Float`` field then refuses the scaffolded default
(Adam's eps) and any rate a person types as ``1e-5``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import dagster as dg
import pydantic
from pydantic import Field

from posttrain.training.config import TrainingConfig, config_from_dict


def _as_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a number, got {value!r}")
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"expected a number such as 0.0001 or 1e-12, got {value!r}") from None


LaunchpadFloat = typing.Annotated[Any, pydantic.AfterValidator(_as_float)]
"""A float Dagster's config system types as Any (so the YAML string ``1e-12`` passes its check) and pydantic
turns into a float, with an error naming the value when it is not a number."""

# Filled in by the training asset, never by a user.
ASSET_OWNED_FIELDS = frozenset({"log_dir", "base_model", "init_from"})
DEFAULT_DOC = "See the recipe's library config in posttrain for details."


def _is_dataclass_type(annotation: Any) -> bool:
    return isinstance(annotation, type) and dataclasses.is_dataclass(annotation)


def _fields(cls: type) -> list[tuple[str, Any, Any, str]]:
    """(name, type, default, description) of each field of dataclass ``cls``; the training part flattened."""
    hints = typing.get_type_hints(cls)
    found = []
    for field in dataclasses.fields(cls):
        annotation = hints[field.name]
        if field.name == "training" and annotation is TrainingConfig:
            found.extend(item for item in _fields(TrainingConfig) if item[0] not in ASSET_OWNED_FIELDS)
            continue
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            raise TypeError(f"{cls.__name__}.{field.name} has no default: every launchpad field needs one")
        found.append((field.name, annotation, default, field.metadata.get("doc", DEFAULT_DOC)))
    return found


def dagster_config(
    name: str,
    library_cls: type,
    *,
    defaults: dict[str, Any] | None = None,
    extra: dict[str, tuple[Any, Any, str]] | None = None,
    exclude: frozenset[str] = frozenset(),
) -> type[dg.Config]:
    """A ``dg.Config`` named ``name`` with the fields of ``library_cls`` (see the module docstring).

    ``defaults`` overrides library defaults for this asset; ``extra`` adds Dagster-only fields as
    ``{name: (type, default, description)}``; ``exclude`` drops fields the asset sets itself.
    """
    defaults = defaults or {}
    model_fields: dict[str, Any] = {}
    for field_name, annotation, default, doc in _fields(library_cls):
        if field_name in exclude:
            continue
        value = defaults.get(field_name, default)
        if _is_dataclass_type(annotation):
            nested = dagster_config(f"{name}{annotation.__name__}", annotation)
            initial = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else dict(value)
            model_fields[field_name] = (nested, Field(default_factory=lambda n=nested, v=initial: n(**v), description=doc))
        else:
            model_fields[field_name] = (_launchpad_type(annotation), Field(default=value, description=doc))
    for field_name, (annotation, default, doc) in (extra or {}).items():
        model_fields[field_name] = (annotation, Field(default=default, description=doc))
    unknown = set(defaults) - set(model_fields)
    if unknown:
        raise TypeError(f"dagster_config({name}): default overrides for unknown fields {sorted(unknown)}")
    return pydantic.create_model(name, __base__=dg.Config, **model_fields)


def _launchpad_type(annotation: Any) -> Any:
    """``float`` → :data:`LaunchpadFloat` (also inside ``float | None``); every other type as it is."""
    if annotation is float:
        return LaunchpadFloat
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and float in typing.get_args(annotation):
        return typing.Optional[LaunchpadFloat] if type(None) in typing.get_args(annotation) else annotation
    return annotation


def library_config(config: dg.Config, library_cls: type, **asset_owned: Any):
    """The library dataclass for a launchpad ``config`` plus the fields the asset fills in."""
    values = {key: value for key, value in config.model_dump().items() if key in {f[0] for f in _fields(library_cls)}}
    return config_from_dict(library_cls, {**values, **asset_owned})
