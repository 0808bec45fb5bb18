#!/usr/bin/env bash
# Issue 39's fair-peer series on one multi-GPU host (the whole series takes more than one
# 10-minute device call: run it in two, `-- --runs strata:1,strata:4,strata:1:4,megatrain:4`
# and `-- --runs deepspeed:4,fsdp2:4,deepspeed-nvme:4`; each call at most ~9 minutes):
# Strata on 1 GPU, on N GPUs and on 1 GPU with N times the rows (the losses strata:N must
# equal), then MegaTrain's data-parallel mode, DeepSpeed ZeRO-3 offloading to the CPU, FSDP2 with
# CPUOffloadPolicy and ZeRO-Infinity (NVMe), each on N GPUs, slowest last (bench/dist_bench.py:
# each run gets what is left of --budget as its time limit, and is killed with all its processes
# when it runs out). Hugging Face Llama 8B (vocab 128256), 16 x 1024 tokens per GPU, clip 1.0.
#
#   bash bench/dist_peers.sh [--wheels DIR] [--megatrain-dir DIR] [--gpus N] [--model NAME]
#                            [--budget SECONDS] [--host-memory GB] [-- more dist_bench options]
#
# --wheels DIR: wheels to install first (DeepSpeed and what it imports that the machine lacks),
#   into a directory of their own put on PYTHONPATH (nothing of the machine's Python changes);
#   libaio's Debian packages in DIR (libaio1*.deb, libaio-dev*.deb) are unpacked beside them
#   and put on the compiler's and loader's paths where the machine has no libaio.h, so that
#   DeepSpeed's async I/O op (ZeRO-Infinity) can build. Without DeepSpeed or libaio the runs
#   that need them are reported as skipped.
# Writes under $OUT (default ./dist_peers_out): dist_peers.log (everything printed),
# summary.json, summary.md, runs.tar.gz (each run's own output).
set -u -o pipefail

WHEELS="" MEGATRAIN="" GPUS=4 MODEL=8b BUDGET=510 HOST_MEMORY=150
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) WHEELS=$2; shift 2 ;;
        --megatrain-dir) MEGATRAIN=$2; shift 2 ;;
        --gpus) GPUS=$2; shift 2 ;;
        --model) MODEL=$2; shift 2 ;;
        --budget) BUDGET=$2; shift 2 ;;
        --host-memory) HOST_MEMORY=$2; shift 2 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) echo "dist_peers.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/dist_peers_out}
mkdir -p "$OUT"
RUNLOGS=$(mktemp -d /tmp/dist_peers_logs.XXXXXX)
# NVLink multicast stays off in every process (the machines' rule: it can take the host's GPUs
# out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# DeepSpeed 0.19.8's op builder reads each TORCH_CUDA_ARCH_LIST entry's minor version with int():
# an arch-specific entry ("9.0a") fails there with "invalid literal for int() with base 10: '0a'",
# the error that skipped ZeRO-Infinity in the first series (2026-11-27; most likely this cause:
# the machine's list was not printed then, it is now). The entries without the suffix build
# kernels its ops run with.
echo "TORCH_CUDA_ARCH_LIST: ${TORCH_CUDA_ARCH_LIST:-unset}"
if [[ "${TORCH_CUDA_ARCH_LIST:-}" =~ [0-9]a ]]; then
    TORCH_CUDA_ARCH_LIST=$(sed -E 's/([0-9])a/\1/g' <<< "$TORCH_CUDA_ARCH_LIST")
    export TORCH_CUDA_ARCH_LIST
    echo "TORCH_CUDA_ARCH_LIST for DeepSpeed's op builder: $TORCH_CUDA_ARCH_LIST"
fi
export PYTHONUNBUFFERED=1

{
    echo "dist_peers.sh: $(date -u +%FT%TZ), $(nproc) cores, $(python3 -c 'import torch; print(torch.__version__, torch.cuda.device_count(), "GPUs:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")' 2>&1)"
    if [ -n "$WHEELS" ]; then
        t0=$(date +%s)
        SITE=/tmp/dist_peers_site
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "$WHEELS"/*.whl || { echo "wheels did not install"; exit 1; }
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
        if [ ! -e /usr/include/libaio.h ] && ls "$WHEELS"/libaio*.deb >/dev/null 2>&1; then
            # Unpacked in /tmp, not over /: gcc finds the header and the library through CPATH
            # and LIBRARY_PATH (DeepSpeed's check and its JIT build both compile with it), the
            # loader through LD_LIBRARY_PATH.
            AIO=/tmp/dist_peers_libaio
            for deb in "$WHEELS"/libaio*.deb; do dpkg -x "$deb" "$AIO"; done
            LIB=$(dirname "$(find "$AIO" -name 'libaio.so*' | head -1)")
            export CPATH="$AIO/usr/include${CPATH:+:$CPATH}"
            export LIBRARY_PATH="$LIB${LIBRARY_PATH:+:$LIBRARY_PATH}"
            export LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
            echo "libaio: unpacked from $WHEELS into $AIO ($LIB)"
        fi
        echo "wheels installed in $(( $(date +%s) - t0 )) s: $(cd "$WHEELS" && echo *)"
    fi
    [ -e /usr/include/libaio.h ] && echo "libaio: the machine's own"
    df -h "$PWD" | tail -1 | awk '{print "disk for the NVMe runs: " $4 " free of " $2 " (" $6 ")"}'
    # CPU threads a rank: the host's cores over all its GPUs, not over the GPUs a run uses.
    HOST_GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    ARGS=(--models "$MODEL" --gpus "$GPUS" --host-gpus "${HOST_GPUS:-0}" --batch 16 --seq 1024 --steps 4 --warmup 2
          --clip 1.0 --budget "$BUDGET" --host-memory "$HOST_MEMORY" --logs "$RUNLOGS"
          --json "$OUT/summary.json" --markdown "$OUT/summary.md")
    [ -n "$MEGATRAIN" ] && ARGS+=(--megatrain-dir "$MEGATRAIN")
    python3 "$HERE/dist_bench.py" "${ARGS[@]}" "${EXTRA[@]}"
    echo "dist_bench exit $?"
} 2>&1 | tee "$OUT/dist_peers.log"
status=$?
tar czf "$OUT/runs.tar.gz" -C "$RUNLOGS" . 2>/dev/null
rm -rf "$RUNLOGS"
exit $status
