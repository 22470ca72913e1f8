# Install, on the GPU machine of the device tool, the wheels benchmarks/fetch_device_wheels.sh put
# in .whl/ here, and put them and Tidal on PYTHONPATH. Source it at the start of every device call
# that carries .whl, from the repository root:
#
#   . benchmarks/device_setup.sh || exit 1; <command>        # with carry [".whl"]
#
# That machine: python3 3.12, torch 2.11 + CUDA 13, pytest, nvcc, no network; no ray, deepspeed,
# mlflow, pydantic or hjson. Run `bash benchmarks/fetch_device_wheels.sh` here first: .whl/ then
# holds deepspeed, pydantic (+ pydantic-core, annotated-types, typing-inspection,
# typing-extensions), hjson, py-cpuinfo, msgpack, ninja, einops, ray (repacked without its Java
# jar: 47 MB instead of 79) and ray's small needs, about 51 MiB: one call carries them all, so
# every call is independent of the one before. Installing takes about 20 s; on a machine still
# warm from an earlier call (30 s), the wheels already installed are skipped.
#
# Plan (each call: carry [".whl"]; about 3 + 5 minutes of device time, plus the start):
#   1. `pytest -m gpu tests/test_gpu.py`: DeepSpeed ZeRO 1-3 on NCCL, exact resume, NVML, the
#      peak table, and Tidal's worker loop in Ray Train on the GPU.
#   2. `python -m benchmarks.gpu`: MFU, tokens/s, peak memory, checkpoint stall -> $OUT.
# Not carried: mlflow (its server stack would not fit beside ray; the gpu tests and the
# benchmark replace the MLflow tracker) and torch (the machine's CUDA build must stay).

_tidal_device_setup() {
    local site=${TIDAL_DEVICE_SITE:-/tmp/site} root f
    root=$(pwd)
    [ -d platform/tidal ] || { echo "device_setup: run from the repository root" >&2; return 1; }
    ls .whl/*.whl >/dev/null 2>&1 || {
        echo "device_setup: no wheels in .whl/: run benchmarks/fetch_device_wheels.sh here and carry [\".whl\"]" >&2
        return 1
    }
    mkdir -p "$site"
    local stamp="$site/.tidal-installed" new=()
    touch "$stamp"
    for f in .whl/*.whl; do # the wheels not yet installed on this machine
        grep -qxF "$(basename "$f")" "$stamp" || new+=("$f")
    done
    if [ ${#new[@]} -gt 0 ]; then
        echo "device_setup: installing ${#new[@]} wheel(s) into $site"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            "${new[@]}" || return 1
        for f in "${new[@]}"; do basename "$f" >>"$stamp"; done
    fi
    # Absolute paths: Ray's worker processes start elsewhere and inherit this environment.
    export PYTHONPATH="$site:$root/platform:$root${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONUNBUFFERED=1
    python3 - <<'EOF' || return 1
import importlib
import sys

missing, versions = [], {}
for name in ["torch", "deepspeed", "ray", "pydantic", "hjson", "cpuinfo", "msgpack", "einops", "numpy", "psutil",
             "pyarrow", "pandas", "yaml", "pytest", "tidal.spec.job"]:
    try:
        versions[name] = getattr(importlib.import_module(name), "__version__", "")
    except Exception as e:  # noqa: BLE001 - report every missing piece at once
        missing.append(f"{name} ({type(e).__name__}: {e})")
if missing:
    sys.exit("device_setup: cannot import: " + "; ".join(missing))
import torch

cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA DEVICE"
print(f"device_setup: python {sys.version.split()[0]}, {cuda}, "
      + ", ".join(f"{k} {v}" for k, v in versions.items() if k in ("torch", "deepspeed", "ray", "pydantic")))
EOF
}
_tidal_device_setup
