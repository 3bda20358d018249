#!/bin/bash
# session 10, GPU batch 2: row-amax kernel + deferred x numerics, bf16 MLP after the host changes
export TE_SEQ_CACHE_DIR=/tmp/te_seq_cache
date -u > $OUT/gpu.txt
P="python -m pytest -q -p no:cacheprovider -m gpu"
(timeout 420 $P tests/kernels/test_cute_row_amax.py > $OUT/t_row_amax.txt 2>&1) &
(timeout 420 $P tests/test_fp8_cute_gpu.py tests/test_fp8_cute_block_gpu.py > $OUT/t_fp8_gpu.txt 2>&1) &
(timeout 420 $P tests/kernels/test_cute_quant.py > $OUT/t_quant.txt 2>&1) &
(timeout 420 $P tests/test_gpu_grouped.py > $OUT/t_gpu_grouped.txt 2>&1) &
wait
date -u >> $OUT/gpu.txt
timeout 150 python benchmarks/bench_quant.py --shapes Q,B --json $OUT/quant_qb.json > $OUT/quant_qb.txt 2>&1
timeout 100 python benchmarks/fp8_memory.py --shapes Q,B --backend cute > $OUT/fp8_memory.txt 2>&1
date -u >> $OUT/gpu.txt
