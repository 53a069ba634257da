#!/usr/bin/env bash
# On the H200: run a long job in its own process session, so that it outlives the call that starts it
# (the machine keeps it running while it stays warm, i.e. while calls follow each other), and no
# call's time limit cuts a node in the middle.
#   bash scripts/airgap/detach.sh start NAME COMMAND...   # returns at once; the job runs from a snapshot
#                                                      # of this checkout (later calls re-copy the tree)
#   bash scripts/airgap/detach.sh wait NAME SECONDS       # until the job ends or SECONDS pass: its log's
#                                                      # tail, results packed into $OUT, its $OUT files
# The job's own $OUT is $QDFLASH_GPU_ROOT/jobs/NAME/out; `wait` copies it into the call's $OUT, and
# packs the results tree as it is (pack.sh), so a call returns what exists even if the job is not done.
set -uo pipefail
source "$(dirname "$0")/env.sh"
verb=${1:?usage: detach.sh start NAME COMMAND... | wait NAME SECONDS}; name=${2:?job name}; shift 2
job=$QDFLASH_GPU_ROOT/jobs/$name
case "$verb" in
  start)
    [ $# -gt 0 ] || { echo "detach: start $name needs a command"; exit 2; }
    [ ! -e "$job" ] || { echo "detach: job $name exists ($job); pick another name"; exit 2; }
    mkdir -p "$job/out" && cp -a "$PWD" "$job/code"
    printf '%q ' "$@" > "$job/command"
    # setsid: a new session, which the device machine does not end when this call returns
    (cd "$job/code" && OUT="$job/out" setsid bash -c "$(cat "$job/command"); echo \$? > '$job/status'" \
       > "$job/log" 2>&1 < /dev/null &)
    echo "detach: started $name: $(cat "$job/command")"
    ;;
  wait)
    seconds=${1:?usage: detach.sh wait NAME SECONDS}
    [ -d "$job" ] || { echo "detach: no job $name on this machine (given back in between?)"; exit 3; }
    end=$((SECONDS + seconds))
    while [ ! -f "$job/status" ] && [ $SECONDS -lt $end ]; do sleep 5; done
    tail -n 8 "$job/log"   # short: less to read before the next call, which must come within the 30 s a machine stays warm
    out=${OUT:-/tmp/out}; mkdir -p "$out"
    cp -r "$job/out/." "$out/" 2>/dev/null
    tail -n 400 "$job/log" > "$out/$name.log"
    bash "$(dirname "$0")/pack.sh" >/dev/null 2>&1 && echo "detach: results packed into results.tgz"
    if [ -f "$job/status" ]; then echo "detach: $name ended, exit status $(cat "$job/status")"; exit 0; fi
    echo "detach: $name still running"
    ;;
  *) echo "detach: unknown verb $verb (start | wait)"; exit 2 ;;
esac
