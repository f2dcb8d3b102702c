#!/usr/bin/env bash
# Set up the HIP 5.2 runtime from Debian so hiprtc can compile kernels for AMD
# targets (gfx90a, gfx1030) on a machine without an AMD GPU. Idempotent.
#
# What it does:
#   1. installs libamdhip64-5 libhiprtc-builtins5 rocm-device-libs libamd-comgr2
#      with apt-get (running `apt-get update` first only if one is missing);
#   2. makes <repo>/.rocm/lib/{libamdhip64.so,libhiprtc.so}, both symlinks to the
#      system libamdhip64.so.5 (HIP 5.2 keeps hiprtc inside libamdhip64), which
#      is the layout hip-python expects under ROCM_PATH.
# Nothing else is needed: comgr finds the device libraries (ocml, ockl) that
# rocm-device-libs installs under /usr/lib/<multiarch>/amdgcn/bitcode by itself.
#
# Environment it expects:
#   - Debian 12 (bookworm) or newer with apt-get; root when a package must be
#     installed (not needed once they are).
#   - Nothing else: no variable is read.
#
# Output: the ROCM_PATH to use, alone on stdout (progress goes to stderr), e.g.
#   export ROCM_PATH="$(scripts/install_hip_sdk.sh)"
# Exporting it is optional for rocforge_rt: rocforge_rt.backends.gpu.hip uses
# <repo>/.rocm by itself when ROCM_PATH is unset.
set -euo pipefail

packages=(libamdhip64-5 libhiprtc-builtins5 rocm-device-libs libamd-comgr2)
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rocm_dir="$repo_root/.rocm"

missing=()
for pkg in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done

if ((${#missing[@]})); then
    if ! command -v apt-get >/dev/null; then
        echo "install_hip_sdk.sh: apt-get not found; install ${missing[*]} by hand" >&2
        exit 1
    fi
    if ((EUID != 0)); then
        echo "install_hip_sdk.sh: missing ${missing[*]}; run as root to install them" >&2
        exit 1
    fi
    echo "install_hip_sdk.sh: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update >&2
    apt-get install -y --no-install-recommends "${packages[@]}" >&2
fi

libamdhip="$(dpkg -L libamdhip64-5 | grep '/libamdhip64\.so\.5$' | head -n 1)"
if [[ -z "$libamdhip" || ! -e "$libamdhip" ]]; then
    echo "install_hip_sdk.sh: libamdhip64.so.5 not found in package libamdhip64-5" >&2
    exit 1
fi

mkdir -p "$rocm_dir/lib"
ln -sfn "$libamdhip" "$rocm_dir/lib/libamdhip64.so"
ln -sfn "$libamdhip" "$rocm_dir/lib/libhiprtc.so"
echo "install_hip_sdk.sh: ROCM_PATH=$rocm_dir (lib/ -> $libamdhip)" >&2
echo "$rocm_dir"
