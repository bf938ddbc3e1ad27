#!/usr/bin/env bash
# The image's entrypoint, after tini: torchrun "$@", with the exit status a
# scheduler can act on. Installed as /usr/local/bin/dist-trainer-entrypoint.
#
#   ENTRYPOINT ["tini", "--", "dist-trainer-entrypoint"]   arguments are torchrun's
#
# A stop signal (docker stop, a Kubernetes eviction or node drain: SIGTERM)
# goes to torchrun, which passes it to the workers; each finishes its step,
# writes a checkpoint and exits with EXIT_REQUEUE (75, dist_trainer/signals.py).
# torchrun itself, ended by the signal, exits with 1 whatever its workers did,
# which would make a stop on request look like a crash. So: if a stop signal
# came and torchrun exited non-zero, exit 75 ("stopped; run again in the same
# run directory to resume"); otherwise torchrun's own status (0 when training
# finished before the signal took effect).
#
# Forwarded: SIGTERM and SIGUSR1 (the workers checkpoint and stop) and SIGINT
# (the workers stop at once, without a new checkpoint: a resume starts from the
# newest one there is). SIGUSR1 needs torchrun to handle it, see
# PET_SIGNALS_TO_HANDLE below.

set -euo pipefail

readonly EXIT_REQUEUE=75

# A signal that is ignored when bash starts cannot be trapped: bash keeps it
# ignored and says nothing, so it would never reach torchrun. A shell's
# background job starts so (SIGINT, SIGQUIT), and so does every process started
# by one that ignores a signal. tini starts us with the defaults; anything else
# gets them here, by starting again through env (coreutils 8.31 or newer).
ignored=$(trap -p INT TERM USR1)
if [[ -n "$ignored" && -z "${DIST_TRAINER_ENTRYPOINT_RESET:-}" ]] && env --default-signal=INT true 2>/dev/null; then
    DIST_TRAINER_ENTRYPOINT_RESET=1 exec env --default-signal=INT,TERM,USR1 "$BASH" "$0" "$@"
elif [[ -n "$ignored" ]]; then
    echo "dist-trainer-entrypoint: started with stop signals ignored ($ignored): they cannot reach torchrun" >&2
fi
unset DIST_TRAINER_ENTRYPOINT_RESET

# torchrun passes on only the signals it handles (--signals-to-handle, default
# SIGTERM,SIGINT,SIGHUP,SIGQUIT); any other ends torchrun at once and leaves its
# workers to be killed without a checkpoint. Add SIGUSR1 to that default (torchrun
# reads a flag it is not given from PET_<FLAG>); a --signals-to-handle among the
# arguments, or a PET_SIGNALS_TO_HANDLE already set, still wins.
export PET_SIGNALS_TO_HANDLE="${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}"

stop_signal=""    # the last stop signal received
torchrun_pid=""
# Called by the traps below, which shellcheck does not count as calls (SC2329).
# shellcheck disable=SC2329
forward() {
    stop_signal=$1
    echo "dist-trainer-entrypoint: got SIG$1, passing it to torchrun" >&2
    if [[ -n "$torchrun_pid" ]]; then
        kill -s "$1" "$torchrun_pid" 2>/dev/null || true
    fi
}
trap 'forward TERM' TERM
trap 'forward INT' INT
trap 'forward USR1' USR1

# In the background: bash runs a trap only between commands, and `wait` is
# interruptible where a foreground torchrun is not. A background command of a
# non-interactive shell starts with SIGINT and SIGQUIT ignored; `trap -` gives
# torchrun their defaults back, as it would have in the foreground.
(
    trap - INT QUIT
    exec torchrun "$@"
) &
torchrun_pid=$!
if [[ -n "$stop_signal" ]]; then  # the signal came before torchrun_pid was known
    kill -s "$stop_signal" "$torchrun_pid" 2>/dev/null || true
fi

# wait returns early (status > 128) each time a trapped signal arrives: wait
# again while torchrun runs. Once it has exited, wait gives its exit status
# (bash keeps it), also when the exit raced a signal's interruption.
while kill -0 "$torchrun_pid" 2>/dev/null; do
    wait "$torchrun_pid" || true
done
status=0
wait "$torchrun_pid" || status=$?

if [[ -n "$stop_signal" && $status -ne 0 ]]; then
    echo "dist-trainer-entrypoint: torchrun exited with status $status after SIG$stop_signal:" \
        "stopped on request, exiting with $EXIT_REQUEUE (run again to resume)" >&2
    exit "$EXIT_REQUEUE"
fi
exit "$status"
