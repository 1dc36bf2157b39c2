"""containers/host_pip.py DIR: prints the podman options that hand this host's pip configuration to a container build or run,
one per line: the effective settings (`pip config list`: files and PIP_* variables) as one
/etc/pip.conf, and every local path they name (find-links folders, file:// indexes with the tree around them, the CA
bundle, constraint files) mounted read-only where the settings expect it. Hosts that reach PyPI
through a mirror, a proxy's CA or a local wheel folder build the image as they install anything
else; the image keeps none of it (build-time mounts are not layers)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

PATH_KEYS = {"find-links", "cert", "client-cert", "constraint", "requirement"}
URL_KEYS = {"index-url", "extra-index-url"}


def effective_settings() -> dict[str, str]:
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    settings: dict[str, str] = {}
    for line in listed.stdout.splitlines():  # scope.key='value'; :env: (PIP_*) last, so it wins
        match = re.fullmatch(r"([^.]*)\.([\w-]+)='(.*)'", line.strip())
        if match and match.group(1) in ("global", "install", ":env:", "download"):
            settings[match.group(2)] = match.group(3)
    return settings


def local_paths(settings: dict[str, str]) -> list[Path]:
    paths = []
    for key, value in settings.items():
        for item in value.split():
            if key in URL_KEYS and item.startswith("file://"):
                item = urlparse(item).path.rstrip("/")
                if item.endswith("/simple"):  # a PEP 503 tree links its files beside simple/
                    item = item[:-len("/simple")]
            elif key not in PATH_KEYS or "://" in item:
                continue
            path = Path(item)
            if path.is_absolute() and path.exists():
                paths.append(path)
    return sorted(set(paths))


def main() -> int:
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        print("usage: containers/host_pip.py DIR   (DIR: where the merged pip.conf is written)", file=sys.stderr)
        return 2
    settings = effective_settings()
    if not settings:
        return 0
    conf = Path(sys.argv[1]) / "pip.conf"
    conf.write_text("[global]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
    print(f"--volume={conf}:/etc/pip.conf:ro")
    for path in local_paths(settings):
        print(f"--volume={path}:{path}:ro")
    return 0


if __name__ == "__main__":
    sys.exit(main())
