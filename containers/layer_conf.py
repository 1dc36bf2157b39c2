"""Writes one containers.conf that is the given files merged in order, later keys winning, as
Podman merges its own configuration files: containers/podman.sh's settings laid over the host's.

    python3 containers/layer_conf.py OUT FILE...     (files that do not exist are skipped)

Podman reads CONTAINERS_CONF_OVERRIDE last (4.4 and later), but only one such file, and before
4.4 has nothing but CONTAINERS_CONF, which replaces every other file: either way the files it
would read are merged here into the one it is given. Standard library only (tomllib, 3.11)."""
from __future__ import annotations

import json
import re
import sys
import tomllib
from pathlib import Path

BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def merge(into: dict, update: dict) -> dict:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value
    return into


def _key(key: str) -> str:
    return key if BARE_KEY.match(key) else json.dumps(key)


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # TOML basic strings take JSON's escapes
    if isinstance(value, list):
        return "[" + ", ".join(map(_value, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} values")


def dumps(table: dict, path: tuple[str, ...] = ()) -> str:
    plain = [f"{_key(k)} = {_value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    text = ("[" + ".".join(map(_key, path)) + "]\n" if path and (plain or not table) else "") + \
        "".join(line + "\n" for line in plain)
    for key, value in table.items():
        if isinstance(value, dict):
            text += dumps(value, (*path, key))
    return text


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    merged: dict = {}
    for name in argv[1:]:
        path = Path(name)
        if not path.is_file():
            continue
        try:
            merge(merged, tomllib.loads(path.read_text()))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            print(f"containers/layer_conf.py: {path}: {exc}", file=sys.stderr)
            return 2
    Path(argv[0]).write_text(dumps(merged))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
