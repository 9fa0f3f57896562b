# Sourced by the set-up scripts: quietly CMD... runs CMD and shows its output only if it fails.
quietly() {
  local log; log=$(mktemp)
  "$@" >"$log" 2>&1 || { grep -v "is ignored" "$log"; rm -f "$log"; return 1; }
  rm -f "$log"
}
