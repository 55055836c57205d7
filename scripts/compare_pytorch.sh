#!/usr/bin/env bash
# frugal side by side with PyTorch 2.x on this machine (scripts/compare_pytorch.py does the work).
#   bash scripts/compare_pytorch.sh                  # full size; writes out/compare-pytorch/summary.json
#   bash scripts/compare_pytorch.sh --quick --check  # tiny shapes, checks the JSON (the CTest entry)
# Finds the torch 2.x virtual environment ($FRUGAL_TORCH_VENV, else .venv-torch2 in this checkout or in
# the main worktree of its repository) and frugal built against the LibTorch in it (--frugal PATH, else
# build-torch2/frugal, configured and built when missing). --skip-if-unavailable: exit 77 (CTest's skip)
# instead of 2 when there is no such environment or the binary's LibTorch is another version.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
skip=0 frugal="" pass=()
while (($#)); do
  case "$1" in
    --skip-if-unavailable) skip=1 ;;
    --frugal) frugal=${2:?--frugal needs a path}; shift ;;
    *) pass+=("$1") ;;
  esac
  shift
done
unavailable() {
  echo "compare_pytorch: $1" >&2
  if ((skip)); then echo "compare_pytorch: skipped" >&2; exit 77; fi
  exit 2
}

venv=$(bash "$repo/scripts/torch_venv.sh")  # $FRUGAL_TORCH_VENV, or .venv-torch2 here or in the main worktree
[[ -n $venv && -x $venv/bin/python ]] ||
  unavailable "no torch 2.x virtual environment (set FRUGAL_TORCH_VENV, or make .venv-torch2 as the README says)"
python=$venv/bin/python
torch_dir=$("$python" -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null) ||
  unavailable "$python cannot import torch"

if [[ -z $frugal ]]; then
  frugal=$repo/build-torch2/frugal
  if [[ ! -x $frugal ]]; then
    echo "+ building $frugal against $torch_dir" >&2
    cmake -S "$repo" -B "$repo/build-torch2" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$torch_dir;$torch_dir/share/cmake" >/dev/null
    cmake --build "$repo/build-torch2" --target frugal_cli -j "$(nproc)"
  fi
fi
[[ -x $frugal ]] || unavailable "--frugal $frugal: not an executable file"
built=$("$frugal" --version | sed -n 's/.*LibTorch //p')
have=$("$python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)
[[ $built == "$have" ]] ||
  unavailable "$frugal is built against LibTorch $built, $python has torch $have: both sides need the same version"

cd "$repo"
exec "$python" "$repo/scripts/compare_pytorch.py" --frugal "$frugal" "${pass[@]}"
