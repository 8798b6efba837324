# Source on the GPU machine (device tool), from the repo root:  . experiments/h200/device_env.sh
# The GPU image has torch/Triton/Lightning but not Hydra, MLflow, Optuna or fla: those travel as
# wheels in .whl/ (see docs/benchmarks.md) and are unpacked into $SITE (a wheel is a zip; the few
# with a .data/purelib part are flattened). Sets PYTHONPATH, FALCON_COMMIT and NVLink-multicast off.
SITE=${SITE:-/tmp/site}
mkdir -p "$SITE"
python3 -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" "$SITE" .whl/*.whl
for d in "$SITE"/*.data; do
  [ -d "$d/purelib" ] && cp -r "$d/purelib/." "$SITE/"
  [ -d "$d/platlib" ] && cp -r "$d/platlib/." "$SITE/"
done
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -f COMMIT ] && export FALCON_COMMIT=$(cat COMMIT)
python3 - <<'PY'
import importlib, sys
for m in ("hydra", "omegaconf", "mlflow", "sqlalchemy", "alembic", "optuna", "fla", "falcon_lab"):
    try:
        mod = importlib.import_module(m)
        print(f"[device_env] {m} {getattr(mod, '__version__', '')}", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"[device_env] {m} FAILED: {type(e).__name__}: {e}", flush=True)
import torch, triton
print(f"[device_env] torch {torch.__version__} triton {triton.__version__} "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no cuda'}", flush=True)
PY
