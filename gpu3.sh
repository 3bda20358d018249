#!/bin/bash
# session 10, GPU batch 3: timings
export TE_SEQ_CACHE_DIR=/tmp/te_seq_cache
date -u > $OUT/gpu.txt
timeout 120 python benchmarks/profile_host.py --shape Q --backend cute --top 30 > $OUT/host_q.txt 2>&1
timeout 150 python benchmarks/profile_host.py --shape Q --backend cute --top 40 --step --fp8 Float8RowwiseScaling --iters 50 > $OUT/host_q_fp8.txt 2>&1
timeout 330 python benchmarks/bench_grouped_mlp.py --shapes Q,B --fp8 --backends cute --peers "" --iters 20 --json $OUT/fp8_mlp_qb.json --png "" > $OUT/fp8_mlp_qb.txt 2>&1
date -u >> $OUT/gpu.txt
