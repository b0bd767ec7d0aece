#!/usr/bin/env bash
# Build .gpu-wheels/: the Python packages that benchmarks/gpu_check.sh installs on a bare GPU machine with no network.
#
# That machine (NVIDIA H100/H200, Python 3.12, torch built for CUDA 13.0) already has PyTorch, transformers, peft,
# accelerate, pandas, pyarrow and matplotlib; it lacks bitsandbytes, datasets (and its dill and multiprocess), trl and
# fastcore. This script downloads those as wheels for the target Python (no dependencies: the machine has the rest),
# then trims bitsandbytes, whose wheel ships one native library per CUDA/ROCm/XPU version (43 MB), to the CUDA
# version(s) of the target's torch. Run it where a package index is reachable, from the repository root:
#
#   bash benchmarks/gpu_wheels.sh                 # Python 3.12, CUDA 13.0 libraries (torch's cu130 build)
#   GPU_WHEELS_CUDA="128 130" bash benchmarks/gpu_wheels.sh   # keep more than one CUDA build
#   GPU_WHEELS_PYARROW=1 bash benchmarks/gpu_wheels.sh        # add pyarrow (~45 MB) for a machine without it
#
# Versions: the ones this checkout is tested with (settings.ini pins trl; the others are this venv's, below).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${GPU_WHEELS_DIR:-$ROOT/.gpu-wheels}"
PYVER="${GPU_WHEELS_PYTHON:-3.12}"
CUDA_KEEP="${GPU_WHEELS_CUDA:-130}"
PY="${PYTHON:-python3}"
PACKAGES=(bitsandbytes==0.50.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 trl==1.16.0 fastcore==1.7.28)
if [[ "${GPU_WHEELS_PYARROW:-0}" == 1 ]]; then PACKAGES+=(pyarrow==26.0.1); fi

rm -rf "$DEST"
mkdir -p "$DEST"
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do platforms+=(--platform "$tag"); done
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${platforms[@]}" -d "$DEST" "${PACKAGES[@]}"

# bitsandbytes loads libbitsandbytes_cuda<torch.version.cuda without the dot>.so: keep those and the CPU library,
# drop the rest (and their RECORD lines, so that the wheel stays consistent), and write it back under the same name.
"$PY" - "$DEST" "$CUDA_KEEP" <<'EOF'
import sys, zipfile
from pathlib import Path
dest, keep = Path(sys.argv[1]), {f"libbitsandbytes_cuda{v}.so" for v in sys.argv[2].split()} | {"libbitsandbytes_cpu.so"}
for wheel in dest.glob("bitsandbytes-*.whl"):
    trimmed, dropped = wheel.with_suffix(".trim"), []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as out:
        names = src.namelist()
        for name in names:
            base = name.rsplit("/", 1)[-1]
            if base.startswith("libbitsandbytes_") and base not in keep:
                dropped.append(name)
        present = [n for n in names if n.rsplit("/", 1)[-1] in keep]
        if not any("cuda" in n for n in present):
            sys.exit(f"{wheel.name} has none of {sorted(keep)}: pick GPU_WHEELS_CUDA from its libraries "
                     f"({sorted(n.rsplit('/', 1)[-1] for n in names if 'libbitsandbytes_cuda' in n)}).")
        for name in names:
            if name in dropped:
                continue
            data = src.read(name)
            if name.endswith(".dist-info/RECORD"):
                data = "".join(line for line in data.decode().splitlines(True)
                               if line.split(",", 1)[0] not in dropped).encode()
            out.writestr(src.getinfo(name), data, compress_type=zipfile.ZIP_DEFLATED)
    trimmed.replace(wheel)
    print(f"{wheel.name}: kept {', '.join(sorted(keep))}; dropped {len(dropped)} other native libraries")
EOF

ls -l "$DEST"
total=$(du -sb "$DEST" | cut -f1)
echo "$DEST: $(( (total + 1048575) / 1048576 )) MiB in $(ls "$DEST" | wc -l) wheels (limit ~40 MiB)"
if (( total > 40 * 1048576 )); then echo "warning: over 40 MiB: the working tree sent to a GPU machine is capped at 64 MiB" >&2; fi
