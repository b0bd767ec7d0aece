#!/usr/bin/env bash
# grpo-lab's GPU check in one call, on a bare GPU machine with no network (under 6 minutes):
#
#   bash benchmarks/gpu_check.sh [--out DIR]          # DIR defaults to $OUT if set, else runs/gpu-check
#   bash benchmarks/gpu_check.sh --dry-run            # the same stages at tiny shapes on a CPU (or GPU_CHECK_DRY=1)
#
# 1. Installs what the machine lacks (bitsandbytes, datasets + dill + multiprocess, trl, fastcore) from the wheels
#    in .gpu-wheels/ beside the checkout (built by benchmarks/gpu_wheels.sh where a package index is reachable) into a
#    scratch folder put on PYTHONPATH; packages that already import are left alone.
# 2. Runs benchmarks/gpu_check.py, most valuable stage first: the T4 rehearsal (capped at a T4's memory), the static
#    engine against generate and TRL at the 0.5B shape, 1.5B QLoRA against TRL, the CUDA tests; each under a time
#    budget, a stage out of time reporting what it measured so far; writes report.json, report.md and
#    gpu-check-logs.tar.gz.
# Any other arguments go to gpu_check.py (--only STAGE,..., --budget SECONDS, --keep-work).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
WHEELS="${GPU_CHECK_WHEELS:-$ROOT/.gpu-wheels}"
SITE="${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/grpo-lab-gpu-site}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
       PYTHONUNBUFFERED=1 MPLBACKEND=Agg GPU_CHECK_INSTALL_JSON="$SITE/install.json"
mkdir -p "$SITE"
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"

# Which carried packages are missing here (wheel file prefix = import name for all of them). One process asks the
# import system where each would come from, without importing it (importing trl alone takes seconds; six imports,
# twice, were most of the dry run's time); a package that is found but fails to import shows in the environment stage.
absent() {
    "$PY" -c 'import importlib.util, sys; print(" ".join(n for n in sys.argv[1:] if importlib.util.find_spec(n) is None))' "$@"
}
read -r -a missing <<< "$(absent bitsandbytes datasets dill multiprocess trl fastcore)"
installed=()
status="nothing missing"
if (( ${#missing[@]} )); then
    wheels=()
    for name in "${missing[@]}"; do
        found=$(ls "$WHEELS"/"$name"-*.whl 2>/dev/null | head -1)
        if [[ -n "$found" ]]; then wheels+=("$found"); installed+=("$(basename "$found")"); fi
    done
    if (( ${#wheels[@]} )); then
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
                "${wheels[@]}" > "$SITE/pip.log" 2>&1; then
            status="installed"
        else
            status="pip failed: $(tail -c 600 "$SITE/pip.log" | tr '\n"' ' _')"
        fi
    else
        status="missing and no wheels in $WHEELS (run benchmarks/gpu_wheels.sh where a package index is reachable)"
    fi
fi
# bench records each trainer's version: grpo-lab runs from this checkout, so give importlib.metadata its name and version.
if ! "$PY" -c "import importlib.metadata as m; m.version('grpo-lab')" >/dev/null 2>&1; then
    version=$(sed -n 's/^version *= *//p' settings.ini)
    mkdir -p "$SITE/grpo_lab-$version.dist-info"
    printf 'Metadata-Version: 2.1\nName: grpo-lab\nVersion: %s\n' "$version" > "$SITE/grpo_lab-$version.dist-info/METADATA"
fi
still=()
(( ${#missing[@]} )) && read -r -a still <<< "$(absent "${missing[@]}")"
"$PY" - "$SITE/install.json" "$status" "${#installed[@]}" "${installed[@]}" "--" "${missing[@]}" "--" "${still[@]}" <<'EOF'
import json, sys
path, status, n, rest = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
wheels, rest = rest[:n], rest[n + 1:]
cut = rest.index("--")
json.dump({"status": status, "wheels": wheels, "missing_before": rest[:cut], "missing_after": rest[cut + 1:]},
          open(path, "w"), indent=1)
EOF
echo "[gpu-check] packages: $status${installed[*]:+ (${installed[*]})}${still[*]:+; still missing: ${still[*]}}"
exec "$PY" "$ROOT/benchmarks/gpu_check.py" "$@"
