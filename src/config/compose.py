"""Compose the config outside @hydra.main (preflight, torchrun workers, tests) and explain failures
in one line that names the bad value and the fix."""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import yaml
from hydra import compose, version
from hydra._internal.hydra import Hydra
from hydra._internal.utils import create_config_search_path
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from src.config import schema as _schemas  # registers the schemas in the ConfigStore
from src.models.config import HFConfigError, resolve

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


_TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


class ConfigError(Exception):
    """A setting that cannot work. The message is the one line the user sees."""


def compose_config(overrides: list[str], config_name: str = "config", with_hydra: bool = False, config_dir: str | None = None) -> DictConfig:
    """Compose exactly what `python -m src.run OVERRIDES` would, without creating an output dir.
    `config_dir`: Hydra's --config-dir, a folder of extra config files searched after conf/."""
    gh = GlobalHydra.instance()
    if gh.is_initialized():
        gh.clear()
    try:
        _init_hydra(config_dir)
        try:
            return finish(compose(config_name, overrides=overrides, return_hydra_config=with_hydra), overrides)
        except OverrideParseException as exc:
            raise ConfigError(explain_parse_error(exc, overrides)) from None
        except (ConfigCompositionException, MissingConfigException, OmegaConfBaseException) as exc:
            raise ConfigError(explain_compose_error(exc, overrides)) from exc
        except yaml.YAMLError as exc:  # Hydra lets the YAML parser's own error through, with ~30 lines of traceback
            raise ConfigError(explain_yaml_error(exc)) from None
    finally:
        GlobalHydra.instance().clear()


def finish(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """What composing leaves to do, in place: model=hf becomes the model its folder holds
    (src/models/config.py). Called on every composed config, Hydra's own (src/run.py) too."""
    try:
        return resolve(cfg, overrides)
    except HFConfigError as err:
        raise ConfigError(str(err)) from None


def _init_hydra(config_dir: str | None) -> None:
    """Hydra's search path as `python -m src.run [--config-dir DIR]` builds it: conf/, then DIR
    where hydra.main puts it (hydra/_internal/utils.py, run_hydra: before the structured schemas)."""
    version.setbase("1.3")
    search_path = create_config_search_path(str(CONF_DIR))  # as initialize_config_dir gives it
    if config_dir is not None:
        folder = os.path.abspath(config_dir)
        if not os.path.isdir(folder):
            what = "a file, not a folder" if os.path.exists(folder) else "no such folder"
            raise ConfigError(f"--config-dir {config_dir}: {what}; give a folder of extra config files, "
                              "e.g. DIR/model/mine.yaml for model=mine")
        search_path.prepend(provider="command-line", path=f"file://{folder}", anchor=SearchPathQuery(provider="schema"))
    Hydra.create_main_hydra2(task_name="app", config_search_path=search_path)  # initialize_config_dir's job name


def explain_yaml_error(exc: yaml.YAMLError) -> str:
    """The YAML parser's error as one line: the file, the line and what the parser expected."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
    if mark is None:
        return f"a config file is not valid YAML ({problem}); fix it"
    path = Path(mark.name)
    shown = path.relative_to(Path.cwd()) if path.is_absolute() and path.is_relative_to(Path.cwd()) else path
    context = getattr(exc, "context", None)
    start = getattr(exc, "context_mark", None)
    where = f" ({context} that starts on line {start.line + 1})" if context and start is not None and start.line != mark.line else ""
    return f"{shown}, line {mark.line + 1}, column {mark.column + 1}: not valid YAML: {problem}{where}; fix that line"


def _override_for(key: str, overrides: list[str]) -> str:
    for ov in overrides:
        if ov.lstrip("+~").split("=", 1)[0] == key:
            return ov
    return key


def explain_parse_error(exc: Exception, overrides: list[str]) -> str:
    """Hydra's parse error as one line that names the override it could not read."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    given = "an override"
    for ov in overrides:
        try:
            parser.parse_overrides([ov])
        except OverrideParseException:
            given = ov
            break
    what = (str(exc).strip().splitlines() or ["a syntax error"])[0]
    return (f"{given}: cannot parse it ({what}); quote a value that holds brackets, commas or '=', "
            "e.g. key='a,b' (https://hydra.cc/docs/advanced/override_grammar/basic/)")



def explain_compose_error(exc: Exception, overrides: list[str]) -> str:
    text = str(exc)
    missing = re.search(r"Could not find '([^']+)/([^']+)'", text)
    if isinstance(exc, MissingConfigException) and missing:
        group, option = missing.groups()
        options = re.findall(r"^\t(\S+)$", text.split("Config search path")[0], flags=re.M)
        options = [o for o in options if not o.startswith("base_")]
        return f"{group}={option}: no such option in group '{group}'; use one of: {', '.join(options)}"
    cause = exc.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        m = re.search(r"Key '([^']+)' not in '(\w+)'", str(cause))
        full_key = getattr(cause, "full_key", None) or (m.group(1) if m else "?")
        parent = full_key.rsplit(".", 1)[0] if "." in full_key else ""
        fields = _fields_of(parent, m.group(2) if m else None)
        hint = f"; valid keys in {parent or 'the config'}: {', '.join(fields)}" if fields else ""
        return f"{_override_for(full_key, overrides)}: unknown key '{full_key}'{hint}"
    if isinstance(cause, ValidationError):
        full_key = getattr(cause, "full_key", "") or "?"
        choices = re.search(r"Invalid value '([^']*)', expected one of \[([^\]]*)\]", str(cause))
        if choices:
            value, options = choices.groups()
            return f"{full_key}={value}: not a choice of {full_key}; use one of: {options}"
        first = str(cause).splitlines()[0]
        kind = _field_type(full_key)
        fix = f"; {full_key} takes {_TYPE_WORDS.get(kind, kind)}" if kind else ""
        return f"{_override_for(full_key, overrides)}: {first}{fix}"
    not_in_defaults = re.search(r"Could not override '([^']+)'", text)
    if not_in_defaults:
        group = not_in_defaults.group(1)
        given = _override_for(group, overrides)
        return f"{given}: '{group}' is not in the default list, so there is nothing to override; append it with +{given.lstrip('+~')}"
    if text.startswith("Ambiguous value for argument"):
        arg = re.search(r"argument '([^']+)'", text)
        given = arg.group(1) if arg else "a value with commas"
        key = given.split("=", 1)[0]
        return f"{given}: a list of values is a sweep: add -m (python -m src.run -m {given}); for one list value write {key}=[...]"
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return f"cannot compose the config: {first}"


def _schema_node(key: str):
    node = OmegaConf.structured(_schemas.RunConfig)
    for part in [p for p in key.split(".") if p]:
        node = node._get_node(part) if isinstance(node, DictConfig) else None
        if node is None:
            return None
    return node


def _fields_of(key: str, schema_name: str | None = None) -> list[str]:
    """The settings under `key`; `schema_name`: the class the error names (a model's architecture's own)."""
    group = key.split(".")[0] if key else ""
    schema = _schemas.GROUPS.get(group)
    if group == "model" and schema_name:
        schema = next((s for s in _schemas.arch_configs().values() if s.__name__ == schema_name), schema)
    if schema is not None and "." not in key:
        return [f.name for f in dataclasses.fields(schema) if f.name not in ("name", "arch")]
    node = _schema_node(key) if key else OmegaConf.structured(_schemas.RunConfig)
    return list(node.keys()) if isinstance(node, DictConfig) else []


def _field_type(full_key: str) -> str | None:
    parent, _, leaf = full_key.rpartition(".")
    schema = _schemas.GROUPS.get(parent)
    if schema is None:
        node = _schema_node(parent)
        schema = getattr(node, "_metadata", None) and node._metadata.object_type
    fields = getattr(schema, "__dataclass_fields__", {})
    if leaf in fields:
        t = fields[leaf].type
        return t if isinstance(t, str) else getattr(t, "__name__", str(t))
    return None
