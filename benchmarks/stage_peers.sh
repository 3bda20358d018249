#!/usr/bin/env bash
# Download the benchmark peers' wheels (the `bench` extra of pyproject.toml) for the GPU host into
# the git-ignored .gpu_peers/ of this checkout, for hosts that reach no package registry.
# The host runs CPython 3.12 on x86_64 (manylinux); one transfer takes at most 64 MiB, so this
# fails if the wheels are larger. Then, on the host (benchmarks/README.md):
#   source .gpu_b/env.sh && source .gpu_peers/env.sh     # DSL first, then the peers after it
# Usage (in the checkout's root): bash benchmarks/stage_peers.sh [--hf]
#   --hf  also the `hf` extra (transformers, pinned, and the packages it imports that the GPU
#         host lacks) for tests/test_hf_moe_gpu.py
set -euo pipefail
cd "$(dirname "$0")/.."

PEERS=("quack-kernels==0.6.5" "torchao==0.18.0")  # keep in step with pyproject.toml's `bench`
if [ "${1:-}" = "--hf" ]; then  # keep in step with pyproject.toml's `hf` (and its own pins)
    PEERS+=("transformers==4.57.1" "huggingface_hub==0.36.2" "tokenizers==0.22.2"
            "safetensors==0.8.0" "regex==2026.11.19" "pyyaml==6.0.4" "tqdm==4.70.1"
            "requests==2.34.2" "urllib3==2.8.0" "idna==3.20" "certifi==2026.10.19.post1"
            "charset_normalizer==3.5.2" "hf-xet==1.8.0")
fi
DEST=.gpu_peers
LIMIT=$((64 * 1024 * 1024))

rm -rf "$DEST"
mkdir -p "$DEST"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$DEST" "${PEERS[@]}"

# Installs once per host into /tmp/peers (outside the work tree) and puts it on PYTHONPATH after
# whatever is there (the DSL from .gpu_b/env.sh), so the peers never shadow the DSL te_seq uses.
cat > "$DEST/env.sh" <<'EOF'
_peers_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ ! -f /tmp/peers/.installed ]; then
    # torchao's wheel ships a top-level `test/` package that would shadow the standard library's
    python3 -m pip install -q --no-deps --target /tmp/peers "$_peers_dir"/*.whl \
        && rm -rf /tmp/peers/test && touch /tmp/peers/.installed
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/peers"
EOF

total=$(du -cb "$DEST"/* | tail -1 | cut -f1)
ls -l "$DEST"
echo "total: $total bytes (limit $LIMIT)"
if [ "$total" -ge "$LIMIT" ]; then
    echo "error: $DEST is over 64 MiB: one transfer to the GPU host cannot carry it" >&2
    exit 1
fi
