"""Typed configuration for all three stages: YAML mapped onto dataclasses.

One YAML file per experiment drives generate-data, distill and eval-speedup.
Unknown keys, wrong types and impossible values fail here, with a clear
message, before any model is loaded: each section lists its own problems and
`Config.validate` adds the checks that span sections. The sections live in
common/config_training.py (generate, distill) and common/config_eval.py (eval,
engines, wandb), their shared checks in common/config_checks.py; this module
holds the whole Config and its loading, overrides and coercion.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from common.config_checks import suggest
from common.config_eval import EnginesConfig, EvalConfig, WandbConfig
from common.config_training import DistillConfig, GenerateConfig, OnPolicyConfig
from common.errors import UserError


_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


class ConfigError(UserError):
    """A configuration problem, reported before any heavy work starts."""


@dataclass
class Config:
    name: str = "default"
    seed: int = 0
    device: str = "auto"
    """'auto' (cuda when available), 'cpu' or 'cuda'."""
    target: str = "embedded:smollm2-135m-instruct"
    """Target model: 'embedded:smollm2-135m-instruct', 'tiny:target', a local HF directory or a hub id."""
    draft: str = "runs/default/final"
    """Draft model for eval-speedup (same reference kinds as target)."""
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    onpolicy: OnPolicyConfig = field(default_factory=OnPolicyConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    engines: EnginesConfig = field(default_factory=EnginesConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def validate(self) -> None:
        """Check values that are well-typed but impossible, in every section. Raises ConfigError."""
        problems = (self.generate.problems() + self.distill.problems() + self.onpolicy.problems()
                    + self.eval.problems() + self.engines.problems())
        if "data:eval" in self.eval.prompts and self.generate.eval_fraction == 0:
            problems.append("eval.prompts: 'data:eval' is the held-out split of generate.out_dir, which "
                            "generate.eval_fraction=0 leaves empty")
        if problems:
            raise ConfigError("invalid config:\n  " + "\n  ".join(problems))

    def check_model_refs(self, *keys: str) -> None:
        """Fail before any heavy work when a model reference cannot load: a missing or incomplete
        local folder, an unknown embedded/tiny name, a hub id while the hub is offline.
        `keys` are the references this stage uses, e.g. 'target' or 'distill.init'."""
        from common.models import reference_problem  # torch + transformers: only where models are used

        problems = [f"{key}: {problem}" for key in keys
                    if (problem := reference_problem(_value_at(self, key)))]
        if problems:
            raise ConfigError("\n".join(problems))


def _value_at(config: Config, key: str):
    """config.distill.init for 'distill.init'."""
    value = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _coerce(value, annotation, where: str):
    """Check `value` against a type annotation; build nested dataclasses."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        return _build(annotation, value, where)
    if origin is list:
        if not isinstance(value, list):
            value = [value] if not isinstance(value, dict) else value
            if isinstance(value, dict):
                raise ConfigError(f"{where}: expected a list, got a mapping")
        (item,) = typing.get_args(annotation)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        key_t, val_t = typing.get_args(annotation)
        return {_coerce(k, key_t, where): _coerce(v, val_t, f"{where}.{k}") for k, v in value.items()}
    if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 reads 1e-4 as a string (only 1.0e-4 is a float there)
    if annotation in (int, str, bool) and isinstance(value, annotation) and not (
            annotation is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"{where}: expected {getattr(annotation, '__name__', annotation)}, "
                      f"got {type(value).__name__} {value!r}")


def _build(cls, data: dict, where: str):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            raise ConfigError(f"unknown config key {path!r}{suggest(key, names)}")
        kwargs[key] = _coerce(value, hints[key], path)
    return cls(**kwargs)


def parse_overrides(overrides: list[str]) -> dict:
    """['eval.ks=[1,2]', 'seed=3'] -> nested dict, values parsed as YAML scalars/lists."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        key, raw = item.split("=", 1)
        node = tree
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({_yaml_reason(e)})") from e
        node[parts[-1]] = _WholeMapping(value) if isinstance(value, dict) else value
    return tree


class _WholeMapping(dict):
    """A mapping given whole as an override's value (`distill.loss={tvd: 1.0}`): it replaces the
    setting instead of merging into it."""


def _merge(base: dict, extra: dict, cls=None) -> dict:
    """base updated by extra, key by key into sections and mappings (`generate.vllm.llm_args.x=1` adds
    one argument), except a mapping-valued setting given whole, which replaces (`distill.loss={tvd: 1.0}`
    is TVD alone, not TVD added to the preset's forward KL). `cls`: the dataclass base and extra fill."""
    hints = typing.get_type_hints(cls) if cls is not None else {}
    out = dict(base)
    for key, value in extra.items():
        section = hints.get(key) if dataclasses.is_dataclass(hints.get(key)) else None
        whole = isinstance(value, _WholeMapping) and section is None
        if isinstance(value, dict) and not whole and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value, section)
        else:
            out[key] = value
    return out


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config, apply `key.sub=value` overrides, type-check and validate it.

    An empty file (or one with only comments) is an error, not a run with every default."""
    data: dict = {}
    if path is not None:
        data = _read_yaml(Path(path))
    data = _merge(data, parse_overrides(overrides or []), Config)
    config = _build(Config, data, "")
    config.validate()
    return config


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML ({_yaml_reason(e)})") from e
    if data is None:
        raise ConfigError(f"config file {str(path)!r} is empty; see configs/ for examples")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r}: the top level must be a mapping of keys to values")
    return data


def _yaml_reason(error: yaml.YAMLError) -> str:
    """'<problem> at line L, column C' from a PyYAML error, without its multi-line excerpt."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def config_to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def save_config(config: Config, path: str | os.PathLike) -> None:
    """Write the resolved config next to the artefacts it produced."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
