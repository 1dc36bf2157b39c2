#!/usr/bin/env bash
# Fills an ignored folder with what the GPU machine lacks for hvd_rl (it has no network): the
# wheels of gymnasium, ale-py (ROMs inside) and mujoco with every dependency its image does not
# hold, and the Horovod 0.28.1 sdist (the C++17 patch travels with the
# repo). Versions are the ones this project's CPU suite runs. Refuses a bundle over the limit.
#
#   benchmarks/gpu/make_bundle.sh [--out .whl] [--python-version 3.12] [--limit-mib 60]
#
# The image's own packages (Python 3.12, torch 2.11 + CUDA 13, numpy, mpi4py, cloudpickle,
# typing-extensions, tensorboard, matplotlib, opencv, psutil, pyyaml, setuptools, ...) are
# listed in /work/.library/device/KINDS.md and are not carried: IMAGE_HAS below is that subset
# the bundle's wheels need, and the script fails if a wheel needs something in neither list.
# --python-version 3.11 (this machine's Python) builds the bundle the CPU dry run installs.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="$REPO_ROOT/.whl"
PYV=3.12
LIMIT_MIB=60
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --python-version) PYV="$2"; shift 2 ;;
    --limit-mib) LIMIT_MIB="$2"; shift 2 ;;
    -h|--help) sed -n '2,14p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "make_bundle.sh: unknown option '$1' (try --help)" >&2; exit 2 ;;
  esac
done
PY="${HVD_RL_BUNDLE_PIP_PYTHON:-$REPO_ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python3

WHEELS=(gymnasium==1.4.0 farama-notifications==0.0.6 ale-py==0.12.1
        mujoco==4.0.1 mujoco-core==4.0.1 mujoco-studio==4.0.1 mujoco-studio-wasm==4.0.1
        websockets==15.0.1 glfw==2.11.0 pyopengl==3.1.10)
IMAGE_HAS="numpy cloudpickle typing-extensions packaging psutil pyyaml setuptools wheel absl-py etils"
HOROVOD_SDIST=horovod==0.28.1

mkdir -p "$OUT"
PLATFORMS=()
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
           manylinux_2_17 manylinux2014 manylinux1; do PLATFORMS+=(--platform "${tag}_x86_64"); done
quiet_pip() { grep -v "is ignored: it is neither a file nor a directory" >&2 || true; }
echo "[bundle] cp${PYV/./} wheels into $OUT"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$PYV" \
  --implementation cp "${PLATFORMS[@]}" -d "$OUT" "${WHEELS[@]}" 2> >(quiet_pip)
[ -f "$OUT/horovod-0.28.1.tar.gz" ] || "$PY" -m pip download -q --disable-pip-version-check --no-deps \
  --no-binary :all: -d "$OUT" "$HOROVOD_SDIST" 2> >(quiet_pip)

# Every dependency of every wheel is in the bundle or in the image (markers for this Python).
"$PY" - "$OUT" "$PYV" "$IMAGE_HAS" <<'PYEOF'
import re, sys, zipfile
from pathlib import Path
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
out, pyv, image = Path(sys.argv[1]), sys.argv[2], {canonicalize_name(n) for n in sys.argv[3].split()}
env = {"python_version": pyv, "python_full_version": pyv + ".0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
wheels = sorted(out.glob("*.whl"))
have = {canonicalize_name(parse_wheel_filename(w.name)[0]) for w in wheels} | image | {"horovod"}
missing = []
for w in wheels:
    with zipfile.ZipFile(w) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if (req.marker is None or req.marker.evaluate(env)) and canonicalize_name(req.name) not in have:
                missing.append(f"{w.name} needs {req}")
if missing:
    sys.exit("make_bundle.sh: the bundle is incomplete: " + "; ".join(missing))
PYEOF

SIZE_KIB="$(du -sk "$OUT" | cut -f1)"
echo "[bundle] $(ls "$OUT" | wc -l) files, $((SIZE_KIB / 1024)) MiB in $OUT (limit $LIMIT_MIB MiB)"
if [ "$SIZE_KIB" -gt $((LIMIT_MIB * 1024)) ]; then
  echo "make_bundle.sh: the bundle is $((SIZE_KIB / 1024)) MiB, over the $LIMIT_MIB MiB limit" >&2
  exit 1
fi
