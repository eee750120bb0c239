#!/bin/sh
# Run a command while holding arbiterd's GPU token, with nothing but flock(1) from util-linux.
# Usage: gpu-job.sh CMD [ARG...]      (JOB_NAME=... names the holder; default: CMD's name)
# The protocol is specified in docs/arena-protocol.md; `arbiterd run -- CMD` does the same.
set -eu
arena="${ARBITERD_ARENA:-${XDG_RUNTIME_DIR:?XDG_RUNTIME_DIR is not set}/arbiterd/arena/gpu0}"
mkdir -p -m 700 "$arena"

# Files this script creates are the user's alone (0600): arbiterd refuses arena files that
# others could write. The job gets the caller's umask back.
job_umask=$(umask)
umask 077

# Open both lock files without truncating them (>> creates them if missing). Never delete them.
exec 8>>"$arena/want.lock" 9>>"$arena/token.lock"

flock -s 8   # 1. announce: from now on the holder's probe sees that the GPU is wanted
flock -x 9   # 2. wait for the token (the holder releases it because of step 1)

tmp="$arena/.holder.json.$$.tmp"
printf '{"pid": %d, "name": "%s", "model": null, "since": %s}\n' \
    "$$" "${JOB_NAME:-$(basename "$1")}" "$(date +%s)" >"$tmp"
mv -f "$tmp" "$arena/holder.json"   # 3. say who holds it, atomically (rename)

flock -u 8   # 4. stop wanting, only now that the token is ours
exec 8>&-

# The job inherits fd 9, the locked description: killed, this script cannot release, and the
# kernel then keeps the token until the job (and whatever inherited fd 9 from it) exits too.
status=0
(umask "$job_umask" && exec "$@") || status=$?

: >"$tmp"
mv -f "$tmp" "$arena/holder.json"   # 5. clear holder.json, then release the token
flock -u 9
exec 9>&-
exit "$status"
