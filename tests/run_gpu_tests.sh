#!/usr/bin/env bash
# Run every GPU test file in its own pytest process, on the GPU host (../shared/GPU.md):
#   source .gpu_b/env.sh && bash tests/run_gpu_tests.sh [FILE ...]   (default: every test file)
# One process per file: a device-side assert poisons the CUDA context of the process it fires in.
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(tests/kernels/test_*.py tests/test_*.py)
for f in "${files[@]}"; do
  grep -q "gpu" "$f" || continue
  echo "=== $f"
  timeout 300 python -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider "$f" 2>&1 | tail -25
  [ "${PIPESTATUS[0]}" -eq 0 ] || [ "${PIPESTATUS[0]}" -eq 5 ] || status=1
done
exit $status
