#!/usr/bin/env bash
# Download what tandem needs and the GPU image lacks (FastAPI, Starlette, uvicorn, pydantic and
# pydantic-core, greenlet, typing-extensions >= 4.16, opentelemetry-api, annotated-doc, and the
# dependencies of those the image also lacks) as CPython 3.12 manylinux x86-64 wheels, into one
# folder that travels with the working tree to a GPU machine (the device tool's `carry`; its
# limit is 64 MiB, these are about 5 MiB). benchmarks/gpu_check.sh installs them offline.
#
#   bash benchmarks/gpu_wheels.sh            # into .whl/ (git-ignored)
#   bash benchmarks/gpu_wheels.sh DIR
#
# Versions are the ones the CPU test environment runs; one version of each (two stop the
# offline install).
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
mkdir -p "$dest"

# name==version: pure-Python wheels first, then the compiled ones (pydantic-core, greenlet).
PACKAGES=(
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.13.4 annotated-types==0.7.0
  typing-inspection==0.4.2 typing-extensions==4.16.0 opentelemetry-api==1.45.2
  annotated-doc==0.0.7
  pydantic-core==2.46.4 greenlet==3.5.6
)
# pip matches a manylinux tag exactly: offer every glibc level a wheel may be built for.
PLATFORMS=()
for tag in manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 \
           manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
  PLATFORMS+=(--platform "$tag")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$dest" "${PACKAGES[@]}"
count=$(ls "$dest"/*.whl | wc -l)
if [ "$count" -ne "${#PACKAGES[@]}" ]; then
  echo "gpu_wheels: expected ${#PACKAGES[@]} wheels in $dest, found $count (two versions of one package?)" >&2
  exit 1
fi
echo "gpu_wheels: $count wheels, $(du -sh "$dest" | cut -f1), in $dest; carry it (run's carry: [\"$dest\"])"
