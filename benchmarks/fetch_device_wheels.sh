#!/usr/bin/env bash
# Fetch, HERE (where the package registry answers), the wheels the GPU machine lacks to run
# tests/test_gpu.py and benchmarks/gpu.py; benchmarks/device_setup.sh installs them THERE.
#
#   bash benchmarks/fetch_device_wheels.sh          # from the repository root; about a minute
#
# The GPU machine (device tool) has python3 3.12 with torch 2.11 + CUDA 13, numpy, pyarrow,
# pandas, fsspec, psutil, tqdm, pyyaml, packaging, protobuf, requests, click, filelock, attrs,
# pytest, nvcc and ninja, and no network. It lacks deepspeed, pydantic, hjson, ray and mlflow
# (which the gpu tests and the benchmark do not need). Everything goes into .whl/, which one
# device call carries (64 MiB at most, the working tree included; this script checks .whl/ is
# under 60 MiB):
#
#   deepspeed and what it imports that the machine lacks: pydantic, pydantic-core,
#     annotated-types, typing-inspection, typing-extensions, hjson (py-cpuinfo, msgpack, ninja
#     and einops are in the image but carried too, < 1 MB, so a changed image cannot cost a call)
#   ray and its needs the machine lacks: jsonschema (+ jsonschema-specifications, referencing,
#     rpds-py), tensorboardX (ray[train]), packaging >= 24.2
#
# The ray wheel is 79 MB, 32 MB of which is ray/jars/ray_dist.jar, the Java worker runtime; a
# Python-only Ray never reads it (Ray starts Java workers only when that folder exists), so the
# wheel is repacked without it (about 47 MB) and everything travels in one call. Without that,
# ray would need two calls, and the second would have to come within the 30 s the machine stays
# warm. Versions are the ones this repository's .venv was tested with. deepspeed is only an sdist
# on PyPI: it is built here into a pure-Python wheel (DS_BUILD_OPS=0: nothing is compiled at
# install time; DeepSpeed JIT-builds the ops it needs, e.g. FusedAdam, on the GPU machine with
# its nvcc). .whl/ is listed in .git/info/exclude, so it never reaches a commit; delete it when done.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PY=${PY:-.venv/bin/python}
LIMIT_MIB=60 # the repository itself (< 1 MiB) travels beside it, under the 64 MiB cap

WHEELS=(
    pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions==4.16.0 hjson==3.1.0 py-cpuinfo==9.0.0 msgpack==1.2.4 ninja==1.13.2 einops==0.8.2
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
    tensorboardX==2.6.5 packaging==26.3 ray==2.60.0
)
DEEPSPEED=deepspeed==0.19.8

exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
rm -rf .whl && mkdir -p .whl

quiet() { grep -v 'is ignored: it is neither a file nor a directory' >&2 || true; } # this pip's config noise

download() { # wheels for CPython 3.12 on x86-64 Linux, no dependencies (each is named above)
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$@" 2> >(quiet)
}

download "${WHEELS[@]}"

# deepspeed: no wheel on PyPI (`pip download --only-binary=:all: deepspeed==0.19.8` finds none),
# so build one from the sdist. --no-build-isolation uses this venv's torch and setuptools instead
# of downloading a torch into a build environment.
if download "$DEEPSPEED" 2>/dev/null; then
    echo "deepspeed: a wheel was found on the registry"
else
    DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "$DEEPSPEED" 2> >(quiet)
fi
ls .whl/deepspeed-*-py3-none-any.whl >/dev/null # pure Python, or it would not install there

# ray without its Java runtime: drop ray/jars/ and its lines in RECORD.
"$PY" - .whl/ray-*.whl <<'EOF'
import os
import sys
import zipfile

path = sys.argv[1]
slim = path + ".slim"
with zipfile.ZipFile(path) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
    for item in src.infolist():
        if item.filename.startswith("ray/jars/"):
            continue
        data = src.read(item)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(keepends=True) if not line.startswith(b"ray/jars/"))
        dst.writestr(item, data, compress_type=zipfile.ZIP_DEFLATED)
before, after = os.path.getsize(path), os.path.getsize(slim)
os.replace(slim, path)
print(f"ray wheel without ray/jars/: {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB")
EOF

# One version of each package, or pip refuses the whole install there.
dups=$(ls .whl/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z_' 'a-z-' | sort | uniq -d)
[ -z "$dups" ] || { echo "more than one version of: $dups" >&2; exit 1; }

ls -l .whl | awk 'NR > 1 {printf "  %10d  %s\n", $5, $9}'
bytes=$(du -cb .whl/*.whl | tail -1 | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1048576}')
if [ "$bytes" -le $((LIMIT_MIB * 1048576)) ]; then
    echo ".whl: $(ls .whl/*.whl | wc -l) wheels, $mib MiB (limit $LIMIT_MIB MiB): one device call carries them all"
else
    echo ".whl: $mib MiB: OVER the $LIMIT_MIB MiB limit" >&2
    exit 1
fi
