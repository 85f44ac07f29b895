#!/usr/bin/env bash
# Download the wheels bench/e2e_grpo.py needs on the GPU machine for its TRL cases into .whl/
# (git-ignored): TRL 1.16 and datasets, plus those of their requirements the GPU image lacks.
#
# The GPU image (Python 3.12) already holds accelerate, transformers, torch, huggingface-hub, pandas,
# pyarrow, numpy, psutil, jinja2, pyyaml, packaging, filelock, tqdm, xxhash, fsspec, aiohttp,
# requests and httpx; of trl's and datasets' requirements it lacks only dill and multiprocess.
# Versions: datasets 5.2 wants dill<0.4.2, multiprocess<0.70.20, huggingface-hub>=1.31 (image: 1.33).
#
# Run here (where pip reaches PyPI), from anywhere:   bash bench/prepare_wheels.sh
# Then on the GPU machine, with carry [".whl"], start the command with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site || exit;
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
dest=.whl
wheels=(trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)

exclude="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
mkdir -p "$dest"
rm -f "$dest"/trl-* "$dest"/datasets-* "$dest"/dill-* "$dest"/multiprocess-*  # one version of each

"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "${wheels[@]}"

# multiprocess publishes one wheel per Python version; make sure the 3.12 one came.
ls "$dest"/multiprocess-*py312* >/dev/null
ls -l "$dest"
du -sh "$dest"
