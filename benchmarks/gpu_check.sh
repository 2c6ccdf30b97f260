#!/usr/bin/env bash
# The one prepared run on a GPU machine (issue 21): the CUDA tests, then the GPU staging and
# training benchmark. From the repo root there:
#   bash benchmarks/gpu_check.sh
# Results go to $OUT (the device tool's folder) or ./gpu-out: gpu-tests.log/.xml,
# gpu_staging.log/.json, env.txt. Wheels the machine lacks (zstandard) travel in .whl/
# (`make gpu-wheels` here); the package runs from the tree, not installed.
# Times: tests at most TESTS_S (150 s), the benchmark at most BENCH_S (400 s; its training
# part stops starting new intervals after BUDGET_S, 180 s): under the device tool's 600 s.
# Device tool call: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=600).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/dcpp-site .whl/*.whl \
        && export PYTHONPATH="/tmp/dcpp-site:$PWD" \
        || echo "gpu_check: the wheels in .whl/ did not install here; going on without them"
fi
{
    date -u; nvidia-smi || true; df -h /dev/shm /tmp || true; free -g || true; nproc
    "$PY" -c "import torch, sys; print(sys.version); print('torch', torch.__version__, \
'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())"
} >"$OUT/env.txt" 2>&1

rc=0
# the tree on this torch at all (torch 2.11 there), before anything long
"$PY" -c "import torch, dcp_plus; from dcp_plus.stagers import ArenaStager
sd = {'w': torch.arange(8.0, device='cuda')}
with ArenaStager() as s:
    assert torch.equal(s.stage(sd).result()['w'], sd['w'].cpu())
print('smoke: ok on torch', torch.__version__)" 2>&1 | tee "$OUT/smoke.log" || rc=1
timeout "${TESTS_S:-150}" "$PY" -m pytest -m gpu -q -p no:cacheprovider -o addopts="" \
    tests/unit/test_arena_stager_gpu.py tests/unit/test_roundtrip_gpu.py \
    tests/unit/test_cached_planner.py --junitxml="$OUT/gpu-tests.xml" 2>&1 \
    | tee "$OUT/gpu-tests.log" || rc=1
timeout "${BENCH_S:-400}" "$PY" -m benchmarks.gpu_staging --out "$OUT/gpu_staging.json" \
    --dir "${BENCH_DIR:-/tmp}" --budget-s "${BUDGET_S:-180}" ${BENCH_ARGS:-} 2>&1 \
    | grep -v " - root - INFO - " | tee "$OUT/gpu_staging.log" || rc=1
exit $rc
