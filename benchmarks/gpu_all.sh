#!/bin/bash
# Every GPU measurement of the project in one bounded run, most wanted first, for a lent machine with little time:
# decoding (eager, compiled, transformers), the CUDA tests, serving (eager and --compile, and the host's ceiling),
# training, decoding GPT-2 1.5B's shapes. Each part has its own time limit (DECODE_S, TESTS_S, SERVE_S, SERVE_HOST_S,
# TRAIN_S, DECODE_XL_S; PARTS picks some: all of them take more than a lent machine's 15 minutes); logs and JSON
# results go to $OUT (default /tmp/gpu-run). Run from the repository root:
#     bash benchmarks/gpu_all.sh
# Python packages the machine lacks (the server's) may sit as wheels in .whl/; the data the serving benchmark reads
# (GPT-2's vocabulary, WikiText-2's test split) in .gpu-data/ when ../shared/data is not beside the checkout: both
# made beforehand, where PyPI is reachable, by benchmarks/gpu_prepare.sh.
set -u
OUT=${OUT:-/tmp/gpu-run}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:src
fi
if [ ! -d ../shared/data ] && [ -d .gpu-data ]; then mkdir -p ../shared && cp -r .gpu-data ../shared/data; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "import aiohttp" 2>/dev/null || echo "aiohttp (serve.py's clients) missing: the serve parts will fail"
PARTS=",${PARTS:-decode,cuda-tests,serve,serve-host,train,decode-xl},"  # the parts to run (PARTS=train: that alone)
part() {   # part NAME SECONDS COMMAND...: run, bounded, its output to $OUT/NAME.log
    local name=$1 limit=$2; shift 2
    [[ $PARTS == *",$name,"* ]] || return 0
    echo "== $name (at most $limit s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - t0)) s"; tail -n 25 "$OUT/$name.log"
}
part decode "${DECODE_S:-170}" python3 benchmarks/gpu.py --cases decode --rounds 3 --json "$OUT/decode.json"
part cuda-tests "${TESTS_S:-200}" python3 -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider
# serve: one round, after serve.py's untimed warm-up (the compiled graphs built before it; a lent GPU is not shared)
part serve "${SERVE_S:-220}" python3 benchmarks/serve.py --device cuda --clients 1,16,64 --max-concurrency 64 \
    --requests 128 --new-tokens 64 --rounds 1 --no-transformers --compile --json "$OUT/serve.json"
# the host's ceiling on this machine's CPU: a device of 1 ms a forward emulated (PARTS=serve-host; read beside serve's)
part serve-host "${SERVE_HOST_S:-60}" python3 benchmarks/serve.py --device-ms 1 --clients 16,64 --max-concurrency 64 \
    --requests 128 --rounds 1 --json "$OUT/serve-host.json"
part train "${TRAIN_S:-240}" python3 benchmarks/gpu.py --cases gpt2-train,bert-train --rounds 3 --json "$OUT/train.json"
# the bound's share where a token's kernels outweigh their launches: GPT-2 1.5B's shapes, bf16, batch 1 (PARTS=decode-xl)
part decode-xl "${DECODE_XL_S:-200}" python3 benchmarks/gpu.py --cases decode --decode-model gpt2-xl --decode-dtypes bf16 \
    --decode-batches 1 --rounds 2 --json "$OUT/decode-xl.json"
