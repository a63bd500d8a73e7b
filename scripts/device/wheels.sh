#!/usr/bin/env bash
# Here (a machine with pip and a package index): the wheels scripts/device/run.sh installs on the GPU machine,
# whose image lacks them (KINDS.md lists what it has), for its Python 3.12 on x86-64, into .carry/wheels.
# The versions are those of this checkout's environment (pip show), so both machines run the same ones.
#   bash scripts/device/wheels.sh            # then carry .carry (run.sh installs them into /tmp/site)
set -euo pipefail
cd "$(dirname "$0")/../.."
names="gguf fastapi starlette uvicorn pydantic pydantic_core typing-inspection annotated-types typing_extensions
openai anthropic jiter sniffio docstring_parser opentelemetry-api httpx2 httpcore2 truststore"
reqs=$(mktemp)
for n in $names; do
  v=$(python3 -m pip show "$n" 2>/dev/null | awk '/^Version/{print $2}')
  [[ -n $v ]] || { echo "$n is not installed here: pip install -e '.[test]' first" >&2; exit 1; }
  echo "$n==$v" >> "$reqs"
done
mkdir -p .carry/wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .carry/wheels -r "$reqs"
rm -f "$reqs"
du -sh .carry/wheels
