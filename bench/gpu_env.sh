# Sourced on a GPU machine at the start of a command: `source bench/gpu_env.sh [STAGE] [WHEELS]`
# (defaults .stage and .whl, what bench/stage_gpu.sh made and the call carried). Installs the
# wheels into /tmp/site and points Python, the loader and strata at the staged files.
_stage=${1:-.stage} _wheels=${2:-.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$_wheels"/*.whl || return 3
export PYTHONPATH=$PWD/bindings/python:/tmp/site PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH=$PWD/$_stage/lib:${LD_LIBRARY_PATH:-}
export STRATA_LIBRARY=$PWD/$_stage/lib/libstrata.so
