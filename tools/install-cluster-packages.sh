#!/usr/bin/env bash
# Installs, once and quietly, the Debian packages the cluster tests and the `mpi` feature use:
# Open MPI (mpirun, and its headers and libraries for rsmpi), libclang (rsmpi's bindgen), and
# SLURM with munge (tools/slurm-cluster.sh starts a cluster of them for the tests), and a C++20
# compiler (g++) for the CPU emulator that tests fsdp-nn's CUDA kernels.
# Idempotent: does nothing when everything is there. Needs root (apt-get); without it, says
# what is missing, and the tests that need it skip (a build with --all-features needs MPI).
set -uo pipefail
need=()
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
[ -e /usr/include/x86_64-linux-gnu/openmpi/mpi.h ] || [ -e /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] \
  || need+=(libopenmpi-dev)
# libclang itself (libclang.so*, libclang-14.so.1), not libclang-cpp, which other packages bring
# and bindgen cannot use.
have_libclang() {
  local f
  for f in /usr/lib/llvm-*/lib/libclang.so* /usr/lib/x86_64-linux-gnu/libclang.so* \
    /usr/lib/x86_64-linux-gnu/libclang-[0-9]*.so*; do
    [ -e "$f" ] && return 0
  done
  return 1
}
have_libclang || need+=(libclang-dev)
command -v c++ >/dev/null 2>&1 || need+=(g++)
for b in slurmctld:slurmctld slurmd:slurmd srun:slurm-client munged:munge; do
  command -v "${b%%:*}" >/dev/null 2>&1 || need+=("${b#*:}")
done
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "note: not root; missing Debian packages: ${need[*]}" >&2
  exit 0
fi
(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}") >/dev/null 2>&1 \
  || echo "note: could not install ${need[*]}" >&2
exit 0
