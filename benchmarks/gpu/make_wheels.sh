#!/usr/bin/env bash
# make gpu-wheels: fill .whl/ (git-ignored) with the wheels `make gpu-check` installs on a GPU machine that
# has PyTorch and transformers but no Ray, FastAPI, uvicorn or pydantic, and no network. Run it where pip
# reaches an index; bring .whl/ along with the checkout.
#
# The target: CPython $GPU_WHEELS_PYTHON (default 3.12), x86-64 manylinux; into $GPU_WHEELS_DIR (default
# .whl/). Versions are the ones this project is tested with (pyproject's pins and the dev environment's
# resolution). Ray's wheel is
# stripped of what etrain never imports (Java jars, rllib, serve, llm, data, tune, train: ~80 MB -> ~42 MB)
# so that the checkout plus .whl/ stays well under a device call's 64 MiB.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python3}
TARGET=${GPU_WHEELS_PYTHON:-3.12}
DEST=${GPU_WHEELS_DIR:-$REPO/.whl}
RAY_VERSION=2.60.0
mkdir -p "$DEST"
cd "$DEST"
rm -f ./*.whl ./*.whl.full
plat=(--only-binary=:all: --python-version "$TARGET" --implementation cp --platform manylinux2014_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
"$PY" -m pip download -q --no-deps "${plat[@]}" -d . "ray==$RAY_VERSION" fastapi==0.165.0 starlette==1.10.0 \
  uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection jsonschema==4.26.0 \
  jsonschema-specifications referencing rpds-py attrs==26.1.0 prometheus-client==0.26.0 opentelemetry-api==1.45.2
# torchao for `make bench-gpu`'s float8 rows (training.float8). Not pyproject's 0.18.0: each torchao release
# is built for one torch, and the GPU machines run torch 2.11, which 0.17.0 is built for (0.18.0 is torch
# 2.13's). GPU_WHEELS_TORCHAO picks another release for another torch ("" leaves it out).
TORCHAO=${GPU_WHEELS_TORCHAO-0.17.0}
if [ -n "$TORCHAO" ]; then
  "$PY" -m pip download -q --no-deps "${plat[@]}" -d . "torchao==$TORCHAO"
fi

ray=$(ls ray-"$RAY_VERSION"-*.whl)
mv "$ray" "$ray.full"
# Every entry but the stripped folders, each with its attributes (gcs_server's and raylet's executable
# bits), and a RECORD listing only what is left, so pip installs the smaller wheel without complaint.
"$PY" - "$ray.full" "$ray" <<'PYTHON'
import sys, zipfile
STRIP = tuple(f"ray/{name}/" for name in ("jars", "rllib", "serve", "llm", "data", "tune", "train"))
source, target = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(source) as full, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
    kept = [info for info in full.infolist() if not info.filename.startswith(STRIP)]
    names = {info.filename for info in kept}
    for info in kept:
        data = full.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(line for line in lines if line.split(",")[0] in names).encode()
        out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
PYTHON
rm "$ray.full"
echo "$(ls ./*.whl | wc -l) wheels in $DEST: $(du -sh . | cut -f1)"
