"""`python -m src.run --help`: the config groups and the COMMON settings; `--help hydra/help=all`:
every option with the docstring its schema gives it.

The field docstrings in src/config/schema.py and src/config/tasks.py are the reference; Python keeps no
such strings at run time, so they are read from the source with `ast`. The templates of conf/hydra/help/
(perflab.yaml, the default, and all.yaml) place this text under the config groups' listing
(`${perflab_groups:}`, then `${perflab_common:}` or `${perflab_options:}`, resolvers).
"""
from __future__ import annotations

import ast
import dataclasses
import textwrap
from pathlib import Path

from omegaconf import OmegaConf

WIDTH = 100


SCHEMA_FILES = ("schema.py", "tasks.py")


def _schema_sources() -> list[Path]:
    """The schema files, and each architecture's config.py (src/models/ARCH/)."""
    from src.models.config import MODELS_DIR, arch_configs

    return [Path(__file__).with_name(name) for name in SCHEMA_FILES] + [MODELS_DIR / "config.py"] + [MODELS_DIR / arch / "config.py" for arch in arch_configs()]


def field_docs(source: Path | None = None) -> dict[str, dict[str, str]]:
    """{class name: {field: docstring}} for every class in the schema files (or in `source`)."""
    sources = [source] if source else _schema_sources()
    nodes = [node for path in sources for node in ast.parse(path.read_text()).body]
    docs: dict[str, dict[str, str]] = {}
    for node in nodes:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, str] = {}
        for stmt, nxt in zip(node.body, node.body[1:] + [None]):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr) \
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                fields[stmt.target.id] = " ".join(nxt.value.value.split())
        docs[node.name] = fields
    return docs


def _value(root, key: str) -> str:
    """The value in the config being composed (`--help model=mini_llm` shows mini_llm's widths)."""
    node = OmegaConf.select(root, key, throw_on_missing=False) if root is not None else None
    if OmegaConf.is_config(node):
        node = OmegaConf.to_container(node, resolve=False, enum_to_str=True)
        if isinstance(node, dict):
            return "{...}"
    if node is None or isinstance(node, bool):
        text = {None: "null", True: "true", False: "false"}[node]
    else:
        text = str(node)
    return text if len(text) <= 30 else text[:27] + "..."


def options_help(*, _root_=None) -> str:
    """The options of every group and section, one a line: `  key=value   docstring`."""
    from src.config import GROUPS

    docs = field_docs()
    out = []
    for name, schema in _sections():
        what = (schema.__doc__ or "").strip().splitlines()[0] if schema.__doc__ and not schema.__doc__.startswith(schema.__name__ + "(") else ""
        out.append(f"{name}.*" + (f"  [the group {name}=OPTION sets these]" if name in GROUPS else ""))
        if what:
            out.append(textwrap.fill(what, WIDTH, initial_indent="  ", subsequent_indent="  "))
        for f in dataclasses.fields(schema):
            if f.name == "name" and name in GROUPS:
                continue
            out += _option_lines(f"{name}.{f.name}", _doc(docs, schema, f.name), _root_)
        out.append("")
        if name == "model":
            out += _arch_options(docs, _root_)
    return "\n".join(out).replace("$", "$$")  # Hydra fills the template with string.Template


def _doc(docs: dict, schema: type, field: str) -> str:
    """A field's docstring, from the class that declares it or the nearest one above it that does."""
    for cls in schema.__mro__:
        if field in docs.get(cls.__name__, {}):
            return docs[cls.__name__][field]
    return ""


def _arch_options(docs: dict, root) -> list[str]:
    """Each architecture's own model.* settings, beyond those every model has."""
    from src.models.config import ModelConfig, arch_configs

    out = []
    for arch, schema in arch_configs().items():
        parent = next(c for c in schema.__mro__[1:] if dataclasses.is_dataclass(c))
        inherited = {f.name: f.default for f in dataclasses.fields(parent)}
        own = [f for f in dataclasses.fields(schema) if f.name not in inherited or (parent is not ModelConfig and f.default != inherited[f.name])]
        own = [f for f in own if f.name not in {g.name for g in dataclasses.fields(ModelConfig)} or parent is not ModelConfig]
        own = [f for f in own if f.name not in ("name", "arch")]
        if not own:
            continue
        what = (schema.__doc__ or "").strip().splitlines()[0]
        out.append(f"model.* of model.arch={arch}" + (f" (and of {parent.arch})" if parent is not ModelConfig else ""))
        out.append(textwrap.fill(what, WIDTH, initial_indent="  ", subsequent_indent="  "))
        composed = root is not None and OmegaConf.select(root, "model.arch", throw_on_missing=False) == arch
        out += [line for f in own for line in _option_lines(f"model.{f.name}", _doc(docs, schema, f.name), root if composed else None,
                                                             default=None if composed else f.default)]
        out.append("")
    return out


def _sections() -> list[tuple[str, type]]:
    """(name, schema) of each group, then of each section with a schema of its own (dist, optim, ...)."""
    from src.config import GROUPS, RunConfig

    sections = [(name, schema) for name, schema in GROUPS.items()]
    sections += [(f.name, f.default_factory) for f in dataclasses.fields(RunConfig) if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)]
    return sections


def _option_lines(key: str, doc: str, root, max_lines: int | None = None, default=None) -> list[str]:
    """`  key=value   docstring`, the docstring wrapped at WIDTH (cut to `max_lines` lines if given);
    `default`: the value shown where `root` has none (another architecture's setting)."""
    value = _value(root, key) if default is None else _value(OmegaConf.create({"v": default}), "v")
    head = f"  {key}={value}"
    if not doc:
        return [head]
    lines = []
    if len(head) >= 44:  # a long default: the docstring starts on the next line
        lines.append(head)
        head = ""
    return lines + textwrap.wrap(doc, WIDTH, initial_indent=head.ljust(44), subsequent_indent=" " * 44, max_lines=max_lines, placeholder=" ...")


# The short --help's settings: those that README.md's and docs/'s commands set most, less the float8
# and speed recipes' finer switches, in the full listing's order.
COMMON = (
    "precision.reduce_dtype", "precision.fp8_recipe", "precision.fp8_impl", "kernels.fused", "speed.cudagraphs",
    "data.batch_size", "data.seq_len", "tracking.uri", "dist.nproc", "dist.nnodes", "dist.fake",
    "optim.lr", "optim.grad_clip", "optim.impl", "optim.schedule", "train.steps", "train.untimed_steps",
    "ac.mode", "checkpoint.enabled", "checkpoint.resume",
)


def common_help(*, _root_=None) -> str:
    """The COMMON settings as options_help writes them, each docstring cut to two lines."""
    docs = field_docs()
    schemas = dict(_sections())
    out = []
    for key in COMMON:
        section, _, name = key.partition(".")
        out += _option_lines(key, _doc(docs, schemas[section], name), _root_, max_lines=2)
    return "\n".join(out).replace("$", "$$")


def groups_help() -> str:
    """Each config group of conf/ and its options, wrapped at WIDTH (Hydra's $APP_CONFIG_GROUPS puts
    a group on one line however long)."""
    conf = Path(__file__).resolve().parents[2] / "conf"
    lines = []
    for group in sorted(p for p in conf.iterdir() if p.is_dir() and p.name != "hydra"):  # hydra/: Hydra's own settings
        options = ", ".join(sorted(f.stem for f in group.glob("*.yaml")))
        lines.append(textwrap.fill(options, WIDTH, initial_indent=f"{group.name}: ", subsequent_indent="  "))
    return "\n".join(lines)


def share_config_store() -> None:
    """For a process that prints `--help` (or `--hydra-help`) and exits. Hydra lists each group's
    options through a fresh copy of its config repository, and hydra-core 1.3's copy deep-copies the
    ConfigStore that its structured source holds: a hundred copies of every schema, most of the
    help's time. Upstream Hydra reads the live store instead; here every copy shares it, which only
    reads it."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.__deepcopy__ = lambda self, memo: self


def register() -> None:
    if not OmegaConf.has_resolver("perflab_options"):
        OmegaConf.register_new_resolver("perflab_options", options_help, use_cache=False)
    if not OmegaConf.has_resolver("perflab_common"):
        OmegaConf.register_new_resolver("perflab_common", common_help, use_cache=False)
    if not OmegaConf.has_resolver("perflab_groups"):
        OmegaConf.register_new_resolver("perflab_groups", groups_help, use_cache=False)
