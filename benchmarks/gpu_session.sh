#!/usr/bin/env bash
# A first GPU session in one script: install from wheels carried with the tree, run the CUDA
# tests, benchmarks/gpu.py (ours vs TRL, bf16, LoRA), benchmarks/profile_step.py (where a step of
# each goes), every GPU preset for 2 steps, benchmarks/levers.py (each lever on and off) and
# FSDP2, each under a timeout (the figures first: a session cut short loses smoke runs, not the
# benchmark), writing every log and result under $OUT as it goes (a run cut short still leaves
# its figures).
#
#   bash benchmarks/gpu_session.sh prep         # here, with PyPI: wheels into .cache/gpu_wheels
#   OUT=/some/folder bash benchmarks/gpu_session.sh      # on the GPU machine, repository root
#
# prep downloads, without dependencies, the packages the recipe needs beyond torch (the GPU machine
# has it, and no network), transformers included, into .cache/gpu_wheels, git-ignored:
# carry that folder with the tree. PYTHON_VERSION (e.g. 3.12) picks the GPU machine's Python for
# the compiled wheels; SKIP_WHEELS="pyarrow pandas" leaves out packages it already has.
# On the GPU machine, SESSION_SECONDS, TESTS_TIMEOUT, BENCH_TIMEOUT, PROFILE_TIMEOUT,
# SMOKE_TIMEOUT, LEVERS_TIMEOUT and PRESETS override the defaults; SKIP leaves out the steps it
# names, as patterns; SMOKE_ARGS adds arguments to every smoke run. 15 minutes of GPU time fit
# two calls: SKIP="profile levers sharded-* smoke-* benchmark-*" SESSION_SECONDS=480 (the tests
# and ours against TRL), then SKIP="cuda-tests benchmark" SESSION_SECONDS=330 (the rest, as time
# allows: ours against TRL with a static cache first).
# DRY_RUN=1 writes each step's command to $OUT/commands.sh instead of running it
# (tests/test_gpu_presets.py parses them). docs/benchmarks.md, "A GPU session".
set -u
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.cache/gpu_wheels}
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
# Carried wheels install here, ahead of the machine's own packages on the path.
SITE=${SITE:-/tmp/gpu_session_site}

# Beyond torch; --no-deps, so each package's own dependencies are listed too.
# datasets 4.7 (the oldest supported) takes pyarrow 21, whose wheel is 6-13 MB smaller than newer
# ones: with it everything fits in the 64 MiB that travel with the tree. It needs
# huggingface_hub < 2 (and its httpx); for a machine with huggingface_hub 2, prep with
# DATASETS_WHEELS="datasets>=5.1 pyarrow==24.* dill<0.4.2 multiprocess<0.70.20" and leave out
# what the machine has (SKIP_WHEELS), since that set is about 3 MB larger.
DATASETS_WHEELS=${DATASETS_WHEELS:-"datasets==4.7.* pyarrow==21.* dill<0.4.1 multiprocess<0.70.19 fsspec<=2026.2.0"}
# The GPU image has transformers 5.17 (below our 5.19) with huggingface_hub 1.33: 5.24 is the
# newest transformers that takes a huggingface_hub below 2.
TRANSFORMERS_WHEEL=${TRANSFORMERS_WHEEL:-"transformers==5.24.*"}
# liger-kernel (pure Python, under 1 MB; Triton comes with CUDA torch): tests/test_cuda.py trains
# with `use_liger_kernel=True`.
PACKAGES="$TRANSFORMERS_WHEEL trl accelerate peft math-verify latex2sympy2_extended
antlr4-python3-runtime==4.13.2 xxhash pandas liger-kernel $DATASETS_WHEELS"

if [ "${1:-}" = prep ]; then
    mkdir -p "$WHEELS"
    version=${PYTHON_VERSION:-$($PYTHON -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
    for package in $PACKAGES; do
        case " ${SKIP_WHEELS:-} " in *" ${package%%[=<]*} "*) continue ;; esac
        $PYTHON -m pip download -q --no-deps --only-binary=:all: --python-version "$version" \
            --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
            --platform manylinux_2_17_x86_64 -d "$WHEELS" "$package" || exit 1
    done
    du -sh "$WHEELS"
    size=$(du -sm "$WHEELS" | cut -f1)
    if [ "$size" -gt 60 ]; then
        echo "$WHEELS holds ${size} MiB: over what travels with the tree; set SKIP_WHEELS" >&2
        exit 1
    fi
    exit 0
fi

OUT=${OUT:-runs/gpu_session}
mkdir -p "$OUT"
# What the steps leave in the temp folder (torchrun's torchelastic_* of the FSDP step) stays
# with the session's results.
export TMPDIR=$(cd "$OUT" && pwd)/tmp
mkdir -p "$TMPDIR"
# The whole session fits one 10-minute command; each step gets its own limit, cut to what is left.
SESSION_SECONDS=${SESSION_SECONDS:-570}
SMOKE_TIMEOUT=${SMOKE_TIMEOUT:-70}
TESTS_TIMEOUT=${TESTS_TIMEOUT:-200}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-240}
PROFILE_TIMEOUT=${PROFILE_TIMEOUT:-150}
LEVERS_TIMEOUT=${LEVERS_TIMEOUT:-200}
PRESETS=${PRESETS:-$(ls recipes/configs/*.yaml | grep -v _cpu.yaml)}
# The GPU machine reaches no network: the presets run on the embedded tiny model and synthetic
# problems, everything else (bf16, LoRA, gradient checkpointing, batch shapes) as they have it.
SWAPS="--model_name_or_path tiny --tiny_warmup_max_steps 20 --dataset_name synthetic
--eval_dataset_name synthetic --num_train_samples 256 --num_eval_samples 8"
# The vision-language presets (recipes/vlm_math.py): the tiny VLM and its color task.
VLM_SWAPS="--model_name_or_path tiny_vlm --tiny_warmup_steps 20 --dataset_name tiny_colors
--dataset_test_split test --num_train_samples 256 --num_eval_samples 8"
# Unbuffered: a step stopped at its limit leaves in its log what it had printed.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
started=$(date +%s)
echo "step,exit_code,seconds" > "$OUT/summary.csv"

# The lines of a step's log copied into session.log: losses, accuracies, errors, table rows.
FIGURES="^\{'loss'|held-out accuracy|Error|Total|the merge moves|FAILED|[0-9]+ passed|Recompiling"
FIGURES+="|\| (median|peak|ours|adapters|every|packed|unpacked|by blocks)"
log() { echo "[$(( $(date +%s) - started )) s] $*" | tee -a "$OUT/session.log"; }

# step NAME SECONDS COMMAND...: COMMAND under a timeout (at most what the session has left),
# its output in $OUT/NAME.log, one line in $OUT/summary.csv.
step() {
    local name=$1 limit=$2
    shift 2
    local pattern patterns
    read -ra patterns <<< "${SKIP:-}"  # no pathname expansion of the patterns
    for pattern in "${patterns[@]}"; do
        # shellcheck disable=SC2053  # a pattern, unquoted on purpose
        if [[ $name == $pattern ]]; then
            log "skip $name (SKIP)"
            echo "$name,skipped,0" >> "$OUT/summary.csv"
            return 0
        fi
    done
    local left=$(( SESSION_SECONDS - ($(date +%s) - started) ))
    if [ "$left" -lt 20 ]; then
        log "skip $name: the session's time is spent"
        echo "$name,skipped,0" >> "$OUT/summary.csv"
        return 1
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    if [ -n "${DRY_RUN:-}" ]; then
        printf '%q ' "$@" >> "$OUT/commands.sh" && echo >> "$OUT/commands.sh"
        echo "$name,dry-run,0" >> "$OUT/summary.csv"
        return 0
    fi
    log "start $name (at most $limit s)"
    local begin=$(date +%s)
    echo "$*" > "$OUT/$name.log"
    timeout --kill-after=10 "$limit" "$@" >> "$OUT/$name.log" 2>&1
    local code=$?
    echo "$name,$code,$(( $(date +%s) - begin ))" >> "$OUT/summary.csv"
    log "end $name: exit code $code$([ $code = 124 ] && echo ' (timed out)')"
    grep -E "$FIGURES" "$OUT/$name.log" | tail -12 >> "$OUT/session.log"
    return $code
}

# 1. Install the carried wheels of what is missing or older (no network, no dependencies) into
# $SITE, first on the path; this package is imported from the tree.
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
{
    nvidia-smi 2>&1 | head -15
    $PYTHON -c 'import sys, torch, transformers, huggingface_hub as hub; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available()); print("transformers", transformers.__version__, "huggingface_hub", hub.__version__)'
} > "$OUT/environment.txt" 2>&1
install() {
    # One pip call for the wheels of distributions that are missing or older than carried.
    missing=$($PYTHON - "$WHEELS" <<'PY'
import glob, importlib.metadata, os, sys
from packaging.version import Version
for wheel in sorted(glob.glob(os.path.join(sys.argv[1], "*.whl"))):
    name, version = os.path.basename(wheel).split("-")[:2]
    try:
        installed = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed is not None and Version(installed) >= Version(version):
        print(f"kept the installed {name} {installed} (carried: {version})", file=sys.stderr)
    else:
        print(wheel)
PY
)
    [ -z "$missing" ] || $PYTHON -m pip install -q --no-index --no-deps --no-compile \
        --upgrade --target "$SITE" $missing || return 1
    $PYTHON -c 'import trl, datasets, peft, accelerate, math_verify, transformers, trl_grpo_ext; print("imports ok, transformers", transformers.__version__)'
}
step install 150 bash -c "$(declare -f install); WHEELS=$WHEELS PYTHON=$PYTHON SITE=$SITE install" || {
    log "the install failed; see $OUT/install.log"
    exit 1
}
$PYTHON -m pip list > "$OUT/pip_list.txt" 2>&1
has() { $PYTHON -c "import $1" 2>/dev/null; }

# 2. The CUDA tests (tests/test_cuda.py: LoRA training in bf16 on the GPU) and the settings
# matrix (every generation path, each cell two steps and a resume), which trains on the GPU where
# there is one. Each test's result is printed as it ends (-v): a step cut at its limit still
# names the cells that failed (on an H200, 12 workers took over 200 s for the tests), and each
# failure's traceback is written to cuda-tests-failures.log as it happens (tests/conftest.py).
step cuda-tests "$TESTS_TIMEOUT" env PYTEST_FAILURES_LOG="$OUT/cuda-tests-failures.log" \
    $PYTHON -m pytest -v --tb=short -p no:cacheprovider \
    -p no:benchmark -m "gpu or not slow" $(has xdist && echo "-n 12") tests/test_cuda.py \
    tests/test_transformers_matrix.py

# 3. Ours against TRL on one GPU: a Qwen2.5-0.5B-shaped model, bf16, LoRA, 1 round of 2 steps,
# each with its default settings: ours decodes compiled (a static cache sized to the batch, CUDA
# graphs; compiled in the warm-up step), TRL with the dynamic cache.
step benchmark "$BENCH_TIMEOUT" $PYTHON benchmarks/gpu.py --rounds 1 --steps 2 \
    --output-dir "$OUT/benchmark" --json "$OUT/benchmark.json"

# 3b. The same with cache_implementation static for both, used as given: ours' decoding steps
# compiled by `generate` (a cache of generate's own length), TRL's uncompiled (disable_compile).
step benchmark-static "$BENCH_TIMEOUT" $PYTHON benchmarks/gpu.py --rounds 1 --steps 2 \
    --cache-implementation static --output-dir "$OUT/benchmark-static" \
    --json "$OUT/benchmark-static.json"

# 4. Where one step of each trainer goes at that shape (benchmarks/profile_step.py): sampling,
# log-probs, forward, backward, optimizer, the GPU waited for around each phase.
step profile "$PROFILE_TIMEOUT" $PYTHON benchmarks/profile_step.py --shape qwen2.5-0.5b \
    --device cuda --steps 1 --trl

# 5. Each GPU preset for 2 steps on one GPU, with the recipe its first line launches; held-out
# evaluation of 8 problems before and after, and once in between. Compiled decoding is on (CUDA's
# default) with prompts of several lengths (the synthetic problems) and evaluation's batches of
# other sizes: TORCH_LOGS=recompiles writes each graph compiled after the first to the log (and
# why), so the log shows how many graphs a run compiles (docs/benchmarks.md, "On a GPU").
# smoke NAME PRESET [ARGS...]: PRESET for 2 steps on one GPU as step smoke-NAME, with ARGS.
smoke() {
    local name=$1 preset=$2 recipe
    shift 2
    if head -1 "$preset" | grep -q "recipes/vlm_math.py"; then
        recipe="recipes/vlm_math.py $VLM_SWAPS --eval_strategy steps --eval_steps 1"
    else
        recipe="recipes/math.py $SWAPS --eval_num_samples 0 --eval_every_steps 1"
        grep -q "^use_vllm: true" "$preset" && ! has vllm && recipe+=" --use_vllm false"
    fi
    step "smoke-$name" "$SMOKE_TIMEOUT" env TORCH_LOGS=recompiles \
        $PYTHON -m accelerate.commands.launch --num_processes 1 \
        $recipe --config "$preset" "$@" --max_steps 2 --logging_steps 1 --save_strategy no \
        --output_dir "$OUT/runs/$name" ${SMOKE_ARGS:-}
}
for preset in $PRESETS; do
    smoke "$(basename "$preset" .yaml)" "$preset"
done

# 5b. The 0.5B preset again with compiled decoding off (the dynamic cache, TRL's behaviour): its
# steps' times beside the compiled ones of step 5, and the opt-out's path on a GPU.
smoke dynamic-cache recipes/configs/qwen2.5-0.5b-instruct_gsm8k_lora.yaml \
    --cache_implementation dynamic

# 6. Each lever on and off in one process, at the same shape (benchmarks/levers.py): merged
# adapters (merged in bf16 here, with how far that moves the sampled tokens' log-probs),
# finished rows leaving the batch (lengths spread by an end-of-sequence bias), attention by
# blocks in the packed rows, the head's backward pass from kept probabilities, blocks that end
# at their completion's end.
step levers "$LEVERS_TIMEOUT" $PYTHON benchmarks/levers.py --model qwen2.5-0.5b --device cuda \
    --dtype bfloat16 --num-prompts 8 --max-tokens 256 --repeats 1

# 7. With time left: FSDP2 and (when the machine has DeepSpeed) ZeRO-3 in one process on the GPU:
# sharding code paths, bf16 mixed precision, the periodic evaluation and saving.
preset=recipes/configs/qwen2.5-0.5b-instruct_gsm8k_lora.yaml
for config in fsdp deepspeed_zero3; do
    [ "$config" = deepspeed_zero3 ] && ! has deepspeed && { log "skip $config: no deepspeed"; continue; }
    step "sharded-$config" "$SMOKE_TIMEOUT" $PYTHON -m accelerate.commands.launch \
        --config_file "recipes/accelerate/$config.yaml" --num_processes 1 recipes/math.py \
        --config "$preset" $SWAPS --max_steps 2 --logging_steps 1 --eval_num_samples 0 \
        --eval_every_steps 1 --keep_best true --output_dir "$OUT/runs/$config"
done
log "done; summary in $OUT/summary.csv"
