"""The ``pipelines.yaml`` file: named pipelines of stages, ``defaults``, ``variables`` and ``${VAR}``.

The file is read with PyYAML's composer rather than ``safe_load`` so that every value keeps the line
it was written on: a validation error names the file, the pipeline, the stage and the line. YAML
anchors, aliases and merge keys (``<<: *defaults``) work as usual; a duplicated key is an error
(plain YAML would silently keep the last one).

Schema::

    x-anything: &anchor {...}              # keys starting with x- are ignored: a place for anchors
    variables: {NAME: default, ...}        # defaults for ${NAME}; the environment and --set win
    defaults:  {option: value, ...}        # applied to every stage whose command has that option;
                                           # {command: {option: value}} applies to one command only
    pipelines:
      NAME:
        description: text
        variables: {...}                   # per pipeline, on top of the file's
        defaults:  {...}                   # per pipeline, on top of the file's
        stages:
          - stage: extract                 # the CLI command path ("ingest karpathy", "export vsepp")
            id: vgg19-fne                  # optional label (default: the command, numbered if repeated)
            store: ${STORE}                # options and arguments, named as on the command line
            model: vgg19
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml


class PipelineError(ValueError):
    """A pipeline file or a pipeline run cannot go on; the message names the file, stage and line."""


# where a value was written: (line, ...) keyed by its path in the document ------------------------
@dataclass
class Located:
    """A value with the 1-based line it was written on (and, for mappings, each key's line)."""

    value: Any
    line: int
    key_lines: dict[str, int] = field(default_factory=dict)


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _convert(loader: yaml.SafeLoader, node: yaml.Node, file: str) -> Located:
    """Turn a composed node into plain Python values wrapped in :class:`Located` (recursively)."""
    if isinstance(node, yaml.ScalarNode):
        return Located(loader.construct_object(node, deep=True), _line(node))
    if isinstance(node, yaml.SequenceNode):
        return Located([_convert(loader, item, file) for item in node.value], _line(node))
    if isinstance(node, yaml.MappingNode):
        own: dict[str, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                raise PipelineError(f"{file}, line {_line(key_node)}: mapping keys must be plain names")
            key = str(loader.construct_object(key_node, deep=True))
            if key in own:
                raise PipelineError(f"{file}, line {_line(key_node)}: key {key!r} is given twice "
                                    f"(first on line {own[key]})")
            own[key] = _line(key_node)
        loader.flatten_mapping(node)  # resolves merge keys (<<: *anchor) in place; own keys win
        out: dict[str, Located] = {}
        key_lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(loader.construct_object(key_node, deep=True))
            out[key] = _convert(loader, value_node, file)
            key_lines[key] = _line(key_node)
        return Located(out, _line(node), key_lines)
    raise PipelineError(f"{file}, line {_line(node)}: unsupported YAML node")  # pragma: no cover


def plain(located: Located) -> Any:
    """Strip the line information."""
    v = located.value
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [plain(x) for x in v]
    return v


# the parsed file ---------------------------------------------------------------------------------
@dataclass
class StageSpec:
    """One stage as written: the command path, its label and its raw (unsubstituted) values."""

    index: int                      # 1-based position in the pipeline
    command: str                    # "extract", "ingest karpathy"
    id: str
    line: int
    values: dict[str, Located]      # option/argument name as written -> value
    key_lines: dict[str, int]

    @property
    def label(self) -> str:
        return f"stage {self.index} ({self.id})"


@dataclass
class PipelineSpec:
    name: str
    line: int
    description: str
    variables: dict[str, Located]
    defaults: dict[str, Located]
    stages: list[StageSpec]
    file: str
    cluster: dict[str, Any] = field(default_factory=dict)  # `cluster:` settings for --cluster slurm:N


@dataclass
class PipelineFile:
    path: str
    pipelines: dict[str, PipelineSpec]
    shipped: str | None = None                            # the shipped recipes' file, when merged in
    shadowed: set[str] = field(default_factory=set)       # the user's pipelines that replace a shipped one

    def get(self, name: str) -> PipelineSpec:
        if name not in self.pipelines:
            from ..suggest import did_you_mean

            hint = did_you_mean(name, self.pipelines)
            where = self.path if not self.shipped or self.shipped == self.path else f"{self.path} and {self.shipped}"
            raise PipelineError(f"{where}: no pipeline {name!r}; {hint + ' ' if hint else ''}valid choices: "
                                f"{', '.join(self.pipelines) or 'none'}")
        return self.pipelines[name]


def merge_files(shipped: PipelineFile, user: PipelineFile | None) -> PipelineFile:
    """The shipped recipes plus the user's pipelines; a user's pipeline of the same name replaces
    (shadows) the shipped one, so a recipe is changed by copying it under its own name."""
    if user is None:
        return PipelineFile(shipped.path, dict(shipped.pipelines), shipped.path)
    pipelines = {**shipped.pipelines, **user.pipelines}
    return PipelineFile(user.path, pipelines, shipped.path, set(shipped.pipelines) & set(user.pipelines))


def variables_of(pipeline: PipelineSpec) -> set[str]:
    """Every ``${NAME}`` a pipeline declares (``variables:``) or uses (stages, defaults, variables)."""
    names = set(pipeline.variables)

    def walk(loc: Any) -> None:
        v = loc.value if isinstance(loc, Located) else loc
        if isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, str):
            for m in _VAR.finditer(v):
                names.add(m.group(1))
                if m.group(2):
                    walk(m.group(2))

    for loc in (*pipeline.variables.values(), *pipeline.defaults.values()):
        walk(loc)
    for stage in pipeline.stages:
        for loc in stage.values.values():
            walk(loc)
    return names


_TOP_KEYS = {"variables", "defaults", "pipelines", "version", "cluster"}
_PIPELINE_KEYS = {"description", "variables", "defaults", "stages", "cluster"}
META_KEYS = {"stage", "id"}


def _expect_mapping(loc: Located, what: str, file: str) -> dict[str, Located]:
    if loc.value is None:
        return {}
    if not isinstance(loc.value, dict):
        raise PipelineError(f"{file}, line {loc.line}: {what} must be a mapping, not {type(loc.value).__name__}")
    return loc.value


def load_file(path: str | os.PathLike) -> PipelineFile:
    """Read and structurally check a pipelines file (stage commands and options are checked later)."""
    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"{path}: no such pipelines file (pass --file PATH)")
    file = str(path)
    loader = yaml.SafeLoader(path.read_text())
    try:
        node = loader.get_single_node()
        if node is None:
            raise PipelineError(f"{file}: the file is empty")
        doc = _convert(loader, node, file)
    except yaml.YAMLError as exc:
        raise PipelineError(f"{file}: not valid YAML: {exc}") from None
    finally:
        loader.dispose()
    top = _expect_mapping(doc, "the file", file)
    for key in top:
        if key not in _TOP_KEYS and not key.startswith("x-"):
            raise PipelineError(f"{file}, line {doc.key_lines[key]}: unknown top-level key {key!r}; "
                                f"valid: {', '.join(sorted(_TOP_KEYS))} (and x-NAME for anchors)")
    if "pipelines" not in top:
        raise PipelineError(f"{file}: no `pipelines:` mapping")
    file_vars = _expect_mapping(top.get("variables", Located(None, 1)), "variables", file)
    file_defaults = _expect_mapping(top.get("defaults", Located(None, 1)), "defaults", file)
    pipelines: dict[str, PipelineSpec] = {}
    for name, ploc in _expect_mapping(top["pipelines"], "pipelines", file).items():
        body = _expect_mapping(ploc, f"pipeline {name!r}", file)
        for key in body:
            if key not in _PIPELINE_KEYS:
                raise PipelineError(f"{file}, line {ploc.key_lines[key]}: pipeline {name!r}: unknown key "
                                    f"{key!r}; valid: {', '.join(sorted(_PIPELINE_KEYS))}")
        variables = {**file_vars, **_expect_mapping(body.get("variables", Located(None, 1)),
                                                    f"pipeline {name!r} variables", file)}
        defaults = {**file_defaults, **_expect_mapping(body.get("defaults", Located(None, 1)),
                                                       f"pipeline {name!r} defaults", file)}
        stages_loc = body.get("stages")
        if stages_loc is None or not isinstance(stages_loc.value, list) or not stages_loc.value:
            line = stages_loc.line if stages_loc else ploc.line
            raise PipelineError(f"{file}, line {line}: pipeline {name!r} needs a non-empty `stages:` list")
        stages = [_stage(name, i, s, file) for i, s in enumerate(stages_loc.value, start=1)]
        _number_ids(name, stages, file)
        desc = body.get("description")
        cluster = {**_cluster(top, file), **_cluster(body, file)}
        pipelines[str(name)] = PipelineSpec(str(name), ploc.line, str(desc.value) if desc else "",
                                            variables, defaults, stages, file, cluster)
    return PipelineFile(file, pipelines)


def _cluster(body: dict[str, Located], file: str) -> dict[str, Any]:
    """A `cluster:` section (SLURM settings of --cluster slurm:N), checked against vsekit.clusters.CLUSTER_KEYS."""
    from ..clusters import CLUSTER_KEYS

    loc = body.get("cluster")
    if loc is None:
        return {}
    section = _expect_mapping(loc, "cluster", file)
    for key, value in section.items():
        if key.replace("-", "_") not in CLUSTER_KEYS:
            raise PipelineError(f"{file}, line {loc.key_lines.get(key, value.line)}: cluster: unknown key "
                                f"{key!r}; valid: {', '.join(CLUSTER_KEYS)}")
    return {k.replace("-", "_"): plain(v) for k, v in section.items()}


def _stage(pipeline: str, index: int, loc: Located, file: str) -> StageSpec:
    where = f"{file}, line {loc.line}: pipeline {pipeline!r}, stage {index}"
    if not isinstance(loc.value, dict):
        raise PipelineError(f"{where}: a stage is a mapping with a `stage:` key (the command), "
                            f"not {type(loc.value).__name__}")
    body = loc.value
    if "stage" not in body or not isinstance(body["stage"].value, str) or not body["stage"].value.strip():
        raise PipelineError(f"{where}: missing `stage: COMMAND` (e.g. `stage: extract`)")
    command = " ".join(body["stage"].value.split())
    sid = body.get("id")
    values = {k: v for k, v in body.items() if k not in META_KEYS}
    return StageSpec(index, command, str(sid.value) if sid else "", loc.line, values,
                     {k: loc.key_lines[k] for k in body})


def _number_ids(pipeline: str, stages: list[StageSpec], file: str) -> None:
    """Give unlabelled stages their command's name, numbered when a command repeats; ids are unique."""
    counts: dict[str, int] = {}
    for s in stages:
        if not s.id:
            base = s.command.replace(" ", "-")
            counts[base] = counts.get(base, 0) + 1
            s.id = base if counts[base] == 1 else f"{base}-{counts[base]}"
    seen: dict[str, int] = {}
    for s in stages:
        if s.id in seen:
            raise PipelineError(f"{file}, line {s.key_lines.get('id', s.line)}: pipeline {pipeline!r}, stage {s.index}: id "
                                f"{s.id!r} is already used by stage {seen[s.id]}")
        seen[s.id] = s.index


# ${VAR} substitution -----------------------------------------------------------------------------
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class MissingVariable(Exception):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class Variables:
    """Resolves ``${NAME}`` / ``${NAME:-default}``: --set, then the environment, then the file."""

    def __init__(self, file_values: Mapping[str, Located], sets: Mapping[str, str],
                 env: Mapping[str, str] | None = None):
        self.file_values = dict(file_values)
        self.sets = dict(sets)
        self.env = dict(os.environ if env is None else env)

    def lookup(self, name: str, depth: int = 0) -> str | None:
        if name in self.sets:
            return str(self.sets[name])
        if name in self.env:
            return self.env[name]
        if name in self.file_values and self.file_values[name].value is not None:
            raw = self.file_values[name].value
            return self.substitute(str(raw), depth + 1) if isinstance(raw, str) else str(raw)
        return None

    def substitute(self, text: str, depth: int = 0) -> str:
        if depth > 20:
            raise PipelineError(f"variables refer to each other in a cycle while expanding {text!r}")

        def repl(m: re.Match) -> str:
            value = self.lookup(m.group(1), depth)
            if value is None:
                if m.group(2) is not None:
                    return self.substitute(m.group(2), depth + 1)
                raise MissingVariable(m.group(1))
            return value

        return _VAR.sub(repl, text)
