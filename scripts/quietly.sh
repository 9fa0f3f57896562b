# Sourced by the set-up scripts: quietly CMD... runs CMD and shows its output only if it fails.
quietly() {
  local log; log=$(mktemp)
  "$@" >"$log" 2>&1 || { grep -v "is ignored" "$log"; rm -f "$log"; return 1; }
  rm -f "$log"
}

# free_after VENV: with DROP_LANE_VENVS=1 (CI sets it: a fresh clone never reuses a lane's venv), the lane's
# virtual environment is removed when the lane's script exits, pass or fail, so the lanes never need their
# 13.5 GB of disk at once (the largest lane alone, about 5.7 GB, plus its downloads). Says the free disk first.
free_after() {
  [ "${DROP_LANE_VENVS:-}" = 1 ] || return 0
  echo "disk free before this lane: $(df -h . | awk 'NR==2 {print $4}'); $1 is removed when the lane ends"
  # shellcheck disable=SC2064  # the path is fixed now, on purpose
  trap "rm -rf '$1'" EXIT
}
