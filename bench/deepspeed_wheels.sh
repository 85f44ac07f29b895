#!/usr/bin/env bash
# Put the wheels bench/deepspeed_check.py needs on the GPU machine into .whl/ (git-ignored):
# DeepSpeed 0.19.8 (PyPI ships only an sdist: built here into a pure-Python wheel, no ops
# precompiled; DeepSpeed detects CUDA at run time and JIT-builds an op only when used, e.g.
# cpu_adam for ZeRO-Offload) plus those of its requirements the GPU image (Python 3.12) lacks:
# hjson, pydantic, pydantic-core, annotated-types, typing-inspection. The image already has einops,
# msgpack, ninja, numpy, packaging, psutil, py-cpuinfo, torch, tqdm and typing-extensions.
#
# Run here (where pip reaches PyPI), from anywhere:   bash bench/deepspeed_wheels.sh
# Then on the GPU machine, with carry [".whl"], start the command with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/deepspeed-*.whl .whl/hjson-*.whl .whl/pydantic*.whl .whl/annotated_types-*.whl .whl/typing_inspection-*.whl \
#     && export PYTHONPATH=/tmp/site || exit;
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
dest=.whl

exclude="$(git rev-parse --git-dir)/info/exclude"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
mkdir -p "$dest"
# one version of each of ours (other scripts keep their own wheels here)
rm -f "$dest"/deepspeed-* "$dest"/hjson-* "$dest"/pydantic-* "$dest"/pydantic_core-* "$dest"/annotated_types-* "$dest"/typing_inspection-*

"$python" -m pip wheel -q --no-deps -w "$dest" deepspeed==0.19.8
"$python" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" hjson pydantic
rm -f "$dest"/typing_extensions-*  # the image has it; a carried copy would shadow the image's

ls "$dest"/deepspeed-0.19.8-py3-none-any.whl "$dest"/pydantic_core-*cp312* >/dev/null
ls -l "$dest"
du -sh "$dest"
