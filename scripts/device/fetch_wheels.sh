#!/usr/bin/env bash
# Run HERE (not on the GPU machine): download the server's dependencies that the GPU image lacks
# (fastapi, uvicorn, pydantic, starlette and their needs) as Python 3.12 manylinux wheels into
# .whl/ (git-ignored), to be carried with `carry: [".whl"]` and installed there with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d .whl \
  fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection annotated-doc h11 \
  sniffio anyio typing-extensions openai distro jiter httpx httpcore
ls .whl
