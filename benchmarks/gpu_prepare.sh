#!/bin/bash
# What a lent GPU machine lacks for benchmarks/gpu_all.sh, gathered here, where PyPI is reachable (that machine reaches
# nothing). Run from the repository root before a session's first device call; then name both folders in the call's
# carry ([".whl", ".gpu-data"]). Both are git-ignored; they hold, together, about 7 MB:
#     bash benchmarks/gpu_prepare.sh
#   .whl/       wheels for the machine's Python (CPython 3.12, x86-64) of the server's packages its image lacks
#               (duolm[serve]: fastapi, uvicorn and what they need), at the versions this venv runs
#   .gpu-data/  GPT-2's vocabulary and WikiText-2's test split (benchmarks/serve.py's prompts), from ../shared/data
# gpu_all.sh installs the wheels into /tmp/site and copies .gpu-data to ../shared/data where none is there.
set -eu
PY=${PY:-.venv/bin/python}
# the packages the machine's image lacks (anyio, h11, click are there; typing-extensions travels as pydantic needs a
# recent one)
NEED="typing-extensions fastapi starlette pydantic pydantic-core annotated-types typing-inspection annotated-doc opentelemetry-api uvicorn"
pins=$("$PY" -m pip freeze 2>/dev/null | awk -F== -v need=" $NEED " '{n = tolower($1); gsub("_", "-", n)} index(need, " " n " ") {print}')
[ "$(echo "$pins" | wc -l)" -eq "$(echo $NEED | wc -w)" ] || { echo "this venv lacks some of: $NEED (make install)"; exit 1; }
rm -rf .whl && mkdir .whl
# shellcheck disable=SC2086  # one pin a word
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $pins
rm -rf .gpu-data && mkdir -p .gpu-data/wikitext-2
cp -r ../shared/data/gpt2 .gpu-data/ && cp ../shared/data/wikitext-2/test.txt .gpu-data/wikitext-2/
ls .whl && du -sh .whl .gpu-data
