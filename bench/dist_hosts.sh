#!/usr/bin/env bash
# Issue 39 item 4 on a 2-GPU machine: 2 processes standing in for 2 hosts of 1 GPU, HSDP against
# the optimizer state sharded across the hosts (strata.torch.DataParallel(state_across_hosts=
# True)), with 1 GPU at twice the rows as the losses' reference (bench/dist_hosts.py). First
# over NCCL's fastest path between the GPUs (NVLink), then with NCCL's socket transport
# (NCCL_P2P_DISABLE=1, NCCL_SHM_DISABLE=1), as hosts without NVLink between them talk. Hugging
# Face Llama 3.6B (vocab 128256; HSDP holds its whole state on each "host": ~52 GB a process),
# 16 x 1024 tokens per GPU, clip 1.0. About 6 minutes.
#
#   bash bench/dist_hosts.sh [--model NAME] [--gpus N] [--transports "nvlink socket"]
#                            [-- more dist_hosts.py options]
#
# Writes under $OUT (default ./dist_hosts_out): dist_hosts.log (everything printed), and per
# transport a folder with results.json, summary.md and each run's log.
set -u -o pipefail

MODEL=3.6b GPUS=2 TRANSPORTS="nvlink socket"
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --model) MODEL=$2; shift 2 ;;
        --gpus) GPUS=$2; shift 2 ;;
        --transports) TRANSPORTS=$2; shift 2 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) echo "dist_hosts.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$PWD/dist_hosts_out}
mkdir -p "$OUT"
# NVLink multicast stays off in every process (the machines' rule).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
{
    echo "dist_hosts.sh: $(date -u +%FT%TZ), $(nproc) cores, $(python3 -c 'import torch; print(torch.__version__, torch.cuda.device_count(), "GPUs:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")' 2>&1)"
    echo "host memory: $(grep -E 'MemTotal|MemAvailable' /proc/meminfo | tr -s ' ' | tr '\n' ';')"
    runs="one,hsdp,pieces"
    for transport in $TRANSPORTS; do
        echo "=== transport $transport"
        python3 "$HERE/dist_hosts.py" --model "$MODEL" --gpus "$GPUS" --transport "$transport" \
            --runs "$runs" --out "$OUT/$transport" "${EXTRA[@]}"
        runs="hsdp,pieces"  # the 1-GPU reference once
    done
} 2>&1 | tee "$OUT/dist_hosts.log"
