#!/usr/bin/env bash
# tools/peer_wheels.sh: puts exactly the wheels that `python -m offload.bench gpu` needs on a GPU machine
# without network (CPython 3.12, x86-64 Linux, torch and the rest already there) into a git-ignored folder
# (default .whl/): DeepSpeed 0.19.8 as a pure-Python wheel (its CPU Adam is JIT-built there at first use),
# torchao 0.17.0, DeepSpeed's pydantic and hjson, and a setuptools new enough to build offload itself.
#
#   bash tools/peer_wheels.sh [FOLDER]
#
# Then, on the GPU machine, in the project's root (the one command; about 8 minutes in all, docs/benchmarks.md):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD && python3 setup.py -q build_ext --inplace \
#     && python3 -m offload.bench gpu --budget-s 400 --out "${OUT:-bench-results}" --keep-logs
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
mkdir -p "$dest"
plat=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)
python3 -m pip download -q -d "$dest" "${plat[@]}" torchao==0.17.0 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 hjson==3.1.0 setuptools==84.2.1
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps -w "$dest" deepspeed==0.19.8
ls -1 "$dest"
du -sh "$dest"
