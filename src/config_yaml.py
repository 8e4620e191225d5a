"""Reading YAML run configs strictly: a duplicate key is an error (not the last one silently
kept), and malformed YAML is a one-line ConfigError naming file:line:column."""
from operator import attrgetter
from pathlib import Path

import yaml

from .errors import ConfigError


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of keeping the last one."""


def _construct_mapping(loader, node, deep=False):
    loader.flatten_mapping(node)
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, (str, int, float, bool)) and key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key) if isinstance(key, (str, int, float, bool)) else None
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml(path: str | Path) -> dict:
    """Parse a YAML mapping; malformed YAML raises ConfigError naming file:line:column."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=StrictLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: malformed YAML: {problem}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: malformed YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(data).__name__}")
    return data


PATH_KEYS = ("model", "data.train", "data.valid", "data.chat_template", "lora.start_from",
             "resume")  # the settings that name files to read


def check_relative_paths(cfg, config_path: str | Path) -> None:
    """A relative path of the config `cfg` (a RunConfig) that is missing from the current folder
    but lies beside the config file is a ConfigError saying so: paths are taken from the current
    folder, as the commands' own are, and the run would fail later (or take a model name for it)."""
    folder = Path(config_path).parent
    for key in PATH_KEYS:
        value = attrgetter(key)(cfg)
        if not isinstance(value, str) or value == "auto" or "{" in value \
                or Path(value).is_absolute():
            continue  # unset, resume: auto, an inline chat template
        if not Path(value).exists() and (folder / value).exists():
            raise ConfigError(f"{config_path}: {key}: {value} is not in the current folder "
                              f"({Path.cwd()}) but is beside the config ({folder / value}); "
                              "paths are taken from the current folder: run from the config's, "
                              "or give the path from here")
