#!/usr/bin/env bash
# Prints the torch 2.x virtual environment the side-by-side scripts use, or nothing when there is none:
# $FRUGAL_TORCH_VENV, else .venv-torch2 in this checkout, else in the main worktree of its repository
# (scripts/setup_torch2.sh makes it):  venv=$(bash scripts/torch_venv.sh)
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${FRUGAL_TORCH_VENV:-}
if [[ -z $venv ]]; then
  common=$(git -C "$repo" rev-parse --path-format=absolute --git-common-dir 2>/dev/null || true)
  for candidate in "$repo/.venv-torch2" ${common:+"$(dirname "$common")/.venv-torch2"}; do
    if [[ -x $candidate/bin/python ]]; then venv=$candidate; break; fi
  done
fi
[[ -n $venv && -x $venv/bin/python ]] && echo "$venv"
exit 0
