#!/usr/bin/env bash
# Run on the GPU machine from the repo root: installs xfer (and any carried wheels in .whl/),
# runs the GPU tests and the GPU benchmarks, and writes everything under $OUT (default ./gpu-out).
# Usage: bash ci/gpu.sh [tests|kernels|ipc|probe|nvshmem|ucx|xferbench|engine|copycal|repeat|multigpu|ab|native|all]...
# (default: all; ab, ipc_bench of a base tree (XFER_AB_BASE) and this one alternated (see the step);
# native, issue 32's C launch on and off alternated (see the step);
# copycal, the kernel vs copy-engine calibration that writes the auto table, repeat,
# which runs the GPU tests named by XFER_GPU_REPEAT_TESTS XFER_GPU_REPEAT times (default: the TP
# engine test, 8) to count intermittent failures, and multigpu, run only when named)
# multigpu (issue 33; docs/multigpu.md): every measurement across GPUs of this machine, GPU 0 -> GPU 1
# (ipc push/pull lone and back to back, NVSHMEM one PE per GPU, UCX on device memory, the engine
# with decode on GPU 1, xfer-bench, the multi-GPU tests) beside the cudaMemcpyPeerAsync ceiling and
# NCCL send/recv of the same bytes, all in this one call, into $OUT/multigpu.json (+ .md, and the
# parts' logs under $OUT/multigpu/). With one GPU it says what it skips and runs the two-process
# variants on GPU 0. XFER_MG_ARGS adds flags (--quick: the ~3-minute smoke run; --parts, --pairs,
# --budget-s, default 540 s; the step's limit XFER_GPU_S_MULTIGPU defaults to 570 s).
# Each step runs under its own time limit (XFER_GPU_S_TESTS, _KERNELS, _IPC, _PROBE, _NVSHMEM, _UCX, _XFERBENCH,
# _ENGINE, else XFER_GPU_STEP_S, default 300 s; tests: XFER_GPU_TEST_S per
# test, default 120 s; XFER_GPU_TESTS picks test files), so one hang cannot eat the whole lease. Every file written
# is packed into $OUT/gpu-out.tgz, beside the test log, env.txt and multigpu.json/.md (the device tool
# returns at most 8 files a call: stop 46 lost five of a call's logs); XFER_GPU_BUNDLE=0 keeps them loose.
# Carry the wheels (.whl/: nvshmem4py-cu13, ucxx-cu13 and its libs; see the device notes) for the
# nvshmem and ucx parts; without them those tests skip with the reason.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
# multi-GPU hosts here share NVLink: never use multicast (see the device notes)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 1
fi
if ! python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1; then
  # no usable setuptools there: lay the one import tree out by hand (xfer.kernels <- kernels/, ...)
  site=/tmp/xfer-site; rm -rf "$site"; mkdir -p "$site"; cp -r xfer "$site/xfer"
  for sub in kernels engine bench; do ln -s "$PWD/$sub" "$site/xfer/$sub"; done
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  echo "editable install failed (see install.log); using $site" | tee -a "$OUT/install.log"
fi
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "gpus", torch.cuda.device_count())'
  python3 -c 'import xfer.native as n; print("xfer._native built:", n.available())'
} | tee "$OUT/env.txt"

what=${*:-all}
step_s=${XFER_GPU_STEP_S:-300}
rc=0
run_step() {  # run_step NAME CMD...: NAME's limit is XFER_GPU_S_NAME, else XFER_GPU_STEP_S
  local var="XFER_GPU_S_$1"; shift
  # its own process group, killed afterwards: a PE process a hung test left spinning on the GPU
  # would otherwise slow every later step's figures down (seen: a 10x slower "ceiling")
  setsid timeout -k 10 "${!var:-$step_s}" "$@" &
  local pid=$! code
  wait $pid; code=$?
  kill -9 -- -$pid 2>/dev/null
  local left; left=$(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader 2>/dev/null)
  if [ -n "$left" ]; then
    echo "gpu.sh: processes still on the GPU after the step, killed: $left" >&2
    for p in $(echo "$left" | cut -d, -f1); do kill -9 "$p" 2>/dev/null; done
  fi
  return $code
}
for step in $what; do
  case $step in
    tests|all)
      run_step TESTS python3 -m pytest -m gpu -v -p no:cacheprovider --timeout-method=thread --timeout "${XFER_GPU_TEST_S:-120}" -rs ${XFER_GPU_TESTS:-tests} 2>&1 | tee "$OUT/pytest-gpu.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;&
    kernels|all)
      run_step KERNELS python3 -m xfer.bench.kernels_table --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;&
    ipc|all)
      # back to back with no window: one initiator's overlapping writes are granted and launch in
      # posting order (issue 29's owner rule; tests/test_agent.py checks 24 of them over 3 block sets)
      run_step IPC python3 -m xfer.bench.ipc_bench --out "$OUT/ipc.json" ${XFER_IPC_ARGS:-} 2>&1 | tee "$OUT/ipc.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;&
    probe|all)
      # each NVSHMEM on-stream primitive alone, with deadlines: one PE (self), then two PEs on the GPU(s)
      for n in 1 2; do
        run_step PROBE python3 -m xfer.bench.nvshmem_probe --pes $n --devices "0,$(( $(nvidia-smi -L | wc -l) > 1 ? 1 : 0 ))" \
          2>&1 | tee -a "$OUT/nvshmem-probe.log"
      done ;;&
    nvshmem|all)
      # one PE (both agents on it: self puts), then two PEs (on one GPU when there is only one)
      # --burst-window 2: back to back over two disjoint sets of decode blocks (see the ipc step)
      run_step NVSHMEM python3 -m xfer.bench.nvshmem_bench --pes 1 --burst-window 2 --out "$OUT/nvshmem-1pe.json" 2>&1 \
        | tee "$OUT/nvshmem-1pe.log"; rc=$((rc | ${PIPESTATUS[0]}))
      run_step NVSHMEM python3 -m xfer.bench.nvshmem_bench --pes 2 --burst-window 2 --out "$OUT/nvshmem-2pe.json" 2>&1 \
        | tee "$OUT/nvshmem-2pe.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;&
    ucx|all)
      # the UCX transport on device memory between two processes, beside a device copy and a ucxx send
      run_step UCX python3 -m xfer.bench.ucx_bench --device cuda --iters 5 --json "$OUT/ucx-cuda.json" 2>&1 \
        | tee "$OUT/ucx-cuda.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;&
    xferbench|all)
      # the main job on device memory, every transport pinned in turn (ucx: device memory between processes)
      run_step XFERBENCH python3 -m xfer.bench.cli --device cuda --transport auto,ipc,nvshmem,ucx --baselines copy,nccl \
        --out "$OUT/xfer-bench" --no-plots --quiet --json >"$OUT/xfer-bench.json" 2>"$OUT/xfer-bench.log"
      rc=$((rc | $?)); tail -40 "$OUT/xfer-bench.log" ;;&
    repeat)
      # an intermittent failure needs counting, not one pass: each run's verdict, then the tally
      tests=${XFER_GPU_REPEAT_TESTS:-tests/test_engine_gpu.py::test_tensor_parallel_prefill_processes_on_one_gpu_equal_hf}
      n=${XFER_GPU_REPEAT:-8}
      for i in $(seq 1 "$n"); do
        run_step REPEAT python3 -m pytest -m gpu -q -p no:cacheprovider --timeout-method=thread \
          --timeout "${XFER_GPU_TEST_S:-120}" $tests >"$OUT/repeat-$i.log" 2>&1
        echo "repeat $i: $(grep -E 'passed|failed|error|skipped' "$OUT/repeat-$i.log" | tail -1)"
      done | tee "$OUT/repeat.log"
      failed=$(grep -cE "failed|error" "$OUT/repeat.log")
      echo "repeat: $tests, $n runs, $failed with a failure" | tee -a "$OUT/repeat.log"
      [ "$failed" -eq 0 ] || rc=1 ;;
    ab)
      # a same-run A/B of ipc_bench (issue 32): a base tree (XFER_AB_BASE: a folder holding xfer/, kernels/
      # and engine/, e.g. `git archive <commit> xfer kernels engine | tar -x -C .gpujob/base`, carried) and
      # this tree, alternated XFER_AB_RUNS times (default 3), one process pair per run, both with this
      # tree's bench/; XFER_IPC_ARGS as for the ipc step (e.g. --no-copy-paths --pull-burst --lone-iters 300)
      if [ -z "${XFER_AB_BASE:-}" ] || [ ! -d "${XFER_AB_BASE}/xfer" ]; then
        echo "gpu.sh ab: set XFER_AB_BASE to a base tree holding xfer/, kernels/, engine/" >&2; rc=1; continue
      fi
      for v in base head; do
        d=/tmp/ab-$v; rm -rf "$d"; mkdir -p "$d"; from=$([ $v = base ] && echo "$XFER_AB_BASE" || echo "$PWD")
        cp -r "$from/xfer" "$d/xfer"; for sub in kernels engine; do cp -r "$from/$sub" "$d/xfer/$sub"; done
        cp -r bench "$d/xfer/bench"
      done
      for i in $(seq 1 "${XFER_AB_RUNS:-3}"); do for v in base head; do
        (cd /tmp && export PYTHONPATH=/tmp/ab-$v${PYTHONPATH:+:$PYTHONPATH} && run_step AB python3 -m xfer.bench.ipc_bench \
          --out "$OUT/ab-$i-$v.json" ${XFER_IPC_ARGS:-} > "$OUT/ab-$i-$v.log" 2>&1); code=$?; rc=$((rc | code))
        { echo "ab run $i $v (rc $code):"; grep -E "ceiling\)|one request|back to back|read" "$OUT/ab-$i-$v.log" \
          | grep -v "^  "; } | tee -a "$OUT/ab.log"
      done; done ;;
    native)
      # issue 32's C launch (XFER_NATIVE_LAUNCH) on and off on one host: its GPU tests with it on (the
      # kernels', the ipc transport's), the host time of the checks and of the CUDA half piece by piece with a
      # cProfile of whole calls (host_checks --cuda), then kernels_table --no-sweep
      # and ipc_bench (XFER_IPC_ARGS) alternated on/off, XFER_NATIVE_RUNS times each (default 1: one pair fits a 10-minute call)
      XFER_NATIVE_LAUNCH=1 run_step TESTS python3 -m pytest -m gpu -q -p no:cacheprovider --timeout-method=thread \
        --timeout "${XFER_GPU_TEST_S:-120}" tests/test_native.py tests/test_kernels.py tests/test_ipc.py \
        > "$OUT/native-tests.log" 2>&1; rc=$((rc | $?)); tail -5 "$OUT/native-tests.log"
      run_step HC python3 -m xfer.bench.host_checks --cuda --out "$OUT/native-host-checks.json" 2>&1 | tee "$OUT/native-hc.log"
      for i in $(seq 1 "${XFER_NATIVE_RUNS:-1}"); do for v in 1 0; do
        XFER_NATIVE_LAUNCH=$v run_step KERNELS python3 -m xfer.bench.kernels_table --no-sweep \
          --out "$OUT/native-kt-$i-$v.json" > "$OUT/native-kt-$i-$v.log" 2>&1; rc=$((rc | $?))
        XFER_NATIVE_LAUNCH=$v run_step IPC python3 -m xfer.bench.ipc_bench --out "$OUT/native-ipc-$i-$v.json" \
          ${XFER_IPC_ARGS:-} > "$OUT/native-ipc-$i-$v.log" 2>&1; rc=$((rc | $?))
        { echo "native run $i, XFER_NATIVE_LAUNCH=$v:"; grep -E "queued|host|ceiling\)|one request|back to back" \
          "$OUT/native-kt-$i-$v.log" "$OUT/native-ipc-$i-$v.log" | grep -v "^  " | head -30; } | tee -a "$OUT/native.log"
      done; done ;;
    copycal)
      run_step COPYCAL python3 -m xfer.bench.copy_calibrate --out "$OUT/copy_table.json" 2>&1 | tee "$OUT/copycal.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;
    multigpu)
      XFER_GPU_S_MULTIGPU=${XFER_GPU_S_MULTIGPU:-570} run_step MULTIGPU python3 -m xfer.bench.multigpu \
        --out "$OUT/multigpu" ${XFER_MG_ARGS:-} 2>&1 | tee "$OUT/multigpu.log"; rc=$((rc | ${PIPESTATUS[0]}))
      for f in multigpu.json multigpu.md; do [ -f "$OUT/multigpu/$f" ] && cp "$OUT/multigpu/$f" "$OUT/$f"; done ;;
    engine|all)
      run_step ENGINE python3 -m xfer.bench.engine_bench --model 8b --prompt 4096 --device cuda --out "$OUT/engine.json" 2>&1 \
        | tee "$OUT/engine.log"; rc=$((rc | ${PIPESTATUS[0]}))
      run_step SWAP python3 -m xfer.bench.engine_bench --mode swap --device cuda --out "$OUT/engine-swap.json" 2>&1 \
        | tee "$OUT/engine-swap.log"; rc=$((rc | ${PIPESTATUS[0]})) ;;
  esac
done
if [ "${XFER_GPU_BUNDLE:-1}" != 0 ]; then
  tar czf /tmp/gpu-out.tgz -C "$OUT" . && mv /tmp/gpu-out.tgz "$OUT/gpu-out.tgz"
  find "$OUT" -mindepth 1 ! -name gpu-out.tgz ! -name pytest-gpu.log ! -name env.txt ! -path "$OUT/multigpu.json" \
    ! -path "$OUT/multigpu.md" -delete
fi
exit $rc
