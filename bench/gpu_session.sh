#!/usr/bin/env bash
# What the GPU issue asks of one lent H100 / H200, in two device calls of
# about 5 minutes each (a session has 15 minutes of device time, starts
# included; docs/accelerators.md, "The next GPU session"):
#   bash bench/gpu_session.sh 1   # ViT-B/16: the step, its profile, train.py
#                                 # end to end, timm eager / torch.compile
#   bash bench/gpu_session.sh 2   # XLA flag A/Bs, ViT-L/16, max-autotune
#   bash bench/gpu_session.sh 3   # bigger models: ViT-L/16, ViT-H/14 (remat)
#   BUDGET=540 bash bench/gpu_session.sh next   # one call: .ab/base
#       against the tree alternated, attention alone, part 1 on the tree,
#       the GPU tests, ViT-H/14;
#       each run skipped when the budget's seconds left are too few for it
# .whl holds ml_collections, the one package such a machine lacks:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     -d .whl ml_collections==1.1.0
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# A program compiled again (a tree's second round) is a cache hit: 3 s
# against ViT-B/16's 17 s on an H200.
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache \
  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: tar runs in /tmp/prof
A="python3 bench/accelerator.py --skip pipeline logits timm"
T0=$(date +%s); END=$((T0 + ${BUDGET:-540}))
fits() {  # fits SECONDS LABEL: whether that many seconds are left
  local left=$((END - $(date +%s)))
  [ "$left" -ge "$1" ] && { echo "== $2 ($(date -u +%T), ${left} s left)"; return; }
  echo "== $2: skipped, ${left} s left"; return 1
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  lscpu | grep -E "Model name|^CPU\(s\)"; date -u
  python3 -m pip list 2>/dev/null |
    grep -iE "^(jax|jaxlib|jax-cuda.*|flax|optax|orbax-checkpoint|torch|timm|triton) "
} > "$OUT/env.txt"
case "${1:-1}" in
  1) timeout 280 $A --batch 256 --attention cudnn --scan off --torch-compile \
       eager default --profile /tmp/prof --json "$OUT/b16.json" \
       2>&1 | tee "$OUT/b16.log"
     (cd /tmp/prof && tar czf "$OUT/jax_prof.tgz" jax/step.hlo.txt \
       $(find jax -name "*.xplane.pb"); tar czf "$OUT/torch_prof.tgz" \
       torch_*.json) ;;
  2) # train.py's own flags are added to each (vit_jax/train/xla_flags.py:
     # cuBLAS GEMMs); =true brings Triton's back. On 2026-11-27 the
     # scheduler and the cuDNN GEMM fusions changed nothing on an H200.
     for f in "" --xla_gpu_enable_triton_gemm=true \
         --xla_gpu_enable_command_buffer=; do
       echo "== XLA_FLAGS=$f"
       XLA_FLAGS="$f" timeout 45 $A --skip pipeline e2e logits timm torch \
         --batch 256 --attention cudnn --scan off --steps 20
     done 2>&1 | tee "$OUT/flags.log"
     timeout 100 $A --skip pipeline e2e logits timm --model vit_l_16 \
       --batch 128 --attention cudnn --scan off --torch-compile eager \
       2>&1 | tee "$OUT/large.log"
     timeout 150 $A --skip pipeline e2e logits timm --batch 256 \
       --attention cudnn --scan off --steps 20 --torch-compile max-autotune \
       2>&1 | tee "$OUT/autotune.log" ;;
  3) # The GPU issue's bigger models: ViT-L/16 and ViT-H/14 at the batch
     # that fits, and ViT-H/14 at twice that with the blocks' remat (dots
     # saved). About 60-150 s each (ViT-L/16's compile alone outlasted 75 s
     # on 2026-11-27).
     for run in "vit_l_16 --batch 128" "vit_h_14 --batch 64" \
         "vit_h_14 --batch 128 --remat dots"; do
       echo "== $run"
       timeout 150 $A --skip pipeline e2e logits timm torch --model $run \
         --attention cudnn --scan off --steps 20
     done 2>&1 | tee "$OUT/large.log" ;;
  ab) # The working tree ('new') against baselines, alternated, in one call:
      #   mkdir -p .ab/base && git archive BASE vit_jax bench configs \
      #     train.py | tar -x -C .ab/base   # .ab/ ignored, named in carry
      # TREES="base other new" compares .ab/base, .ab/other and the tree
      # (TREES2: round 2's, default the same); TESTS=0 skips
      # tests/models/test_gpu.py, TESTS=last runs it after the A/B; the
      # new tree's round-2 step also dumps XLA's HLO around layout
      # assignment (xla_layout.tgz).
     gpu_tests() { { timeout 150 python3 -m pytest -q -p no:cacheprovider \
       tests/models/test_gpu.py 2>&1; echo "pytest exit status $? (124: \
       the timeout)"; } | tail -16 | tee "$OUT/gpu_tests.log"; }
     [ "${TESTS:-1}" = 1 ] && gpu_tests
     B="--skip pipeline e2e logits timm torch --batch 256 --attention cudnn \
       --scan off --steps 30"
     for r in 1 2; do
       trees=${TREES:-base new}; [ $r = 2 ] && trees=${TREES2:-$trees}
       for t in $trees; do
         echo "== $t, round $r"
         d=.; [ $t = new ] || d=.ab/$t
         if [ $t$r = new2 ]; then
           (cd $d && XLA_FLAGS="--xla_dump_to=/tmp/xd \
             --xla_dump_hlo_pass_re=layout-assignment" timeout 70 python3 \
             bench/accelerator.py $B --profile /tmp/prof_new)
         else
           (cd $d && timeout 70 python3 bench/accelerator.py $B)
         fi
       done
     done 2>&1 | tee "$OUT/ab.log"
     (cd /tmp/xd && tar czf "$OUT/xla_layout.tgz" \
       $(ls | grep step_and_vote | grep layout-assignment))
     (cd /tmp/prof_new && tar czf "$OUT/jax_prof_new.tgz" jax/step.hlo.txt \
       $(find jax -name "*.xplane.pb"))
     [ "${TESTS:-1}" = last ] && gpu_tests ;;
  next) # What the next session needs first, measurements before tests:
     # .ab/base against the tree alternated, attention alone,
     # part 1 on the tree (timm under torch.compile in the same process,
     # train.py end to end, both profiles), tests/models/test_gpu.py, then
     # ViT-H/14; each only while the budget's seconds last. TESTS=first
     # runs the tests before the rest.
     gpu_tests() { fits 100 "tests/models/test_gpu.py" && { timeout 150 \
       python3 -m pytest -q -p no:cacheprovider tests/models/test_gpu.py \
       2>&1; echo "pytest exit status $?"; } | tail -16 | tee \
       "$OUT/gpu_tests.log"; }
     [ "${TESTS:-last}" = first ] && gpu_tests
     B="--skip pipeline e2e logits timm torch --batch 256 --attention cudnn \
       --scan off --steps 30"
     for r in $([ -d .ab/base ] && echo 1 2); do  # only with a baseline
       fits 50 "base, round $r" && (cd .ab/base && timeout 70 python3 \
         bench/accelerator.py $B)
       fits 50 "new, round $r" && timeout 70 python3 bench/accelerator.py $B
     done 2>&1 | tee "$OUT/ab.log"
     # Attention alone (cuDNN, XLA, Pallas's flash kernels at two block
     # sizes): the step's largest lever after the GEMMs.
     fits 60 "attention alone" && timeout 90 python3 bench/attention.py \
       2>&1 | tee -a "$OUT/ab.log"
     # XLA flags tried on 2026-11-28, none beyond the spread: cuDNN's
     # LayerNorm, the block-level normalisation fusions, cuBLASLt
     # (docs/accelerators.md); FLAGS="..." runs each named one again.
     for f in ${FLAGS:-}; do
       fits 40 "new, XLA_FLAGS=$f" && XLA_FLAGS="$f" timeout 60 python3 \
         bench/accelerator.py $B
     done 2>&1 | tee -a "$OUT/ab.log"  # one file: at most 8 come back
     fits 170 "part 1 on the tree" && { timeout $((END - $(date +%s) - 5)) \
       $A --batch 256 --attention cudnn --scan off --torch-compile \
       ${PART1_TORCH:-default} --profile /tmp/prof --json "$OUT/b16.json" \
       2>&1 | tee "$OUT/b16.log"
       (cd /tmp/prof && tar czf "$OUT/jax_prof.tgz" jax/step.hlo.txt \
         $(find jax -name "*.xplane.pb"); tar czf "$OUT/torch_prof.tgz" \
         torch_*.json); }
     [ "${TESTS:-last}" = last ] && gpu_tests
     # ViT-L/16 at twice the batch of 2026-11-27's 43.6 % (unrolled, as
     # then); ViT-H/14 scanned (unrolled, its compile outlasted 125 s).
     for run in "vit_l_16 --batch 256 --scan off" \
         "vit_h_14 --batch 64 --scan on" \
         "vit_h_14 --batch 128 --remat dots --scan on"; do
       fits 120 "$run" && timeout $((END - $(date +%s) - 5)) $A --skip \
         pipeline e2e logits timm torch --model $run --attention cudnn \
         --steps 20
     done 2>&1 | tee "$OUT/large.log" ;;
esac
ls -la "$OUT"; echo "$(( $(date +%s) - T0 )) s"
