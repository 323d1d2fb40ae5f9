#!/usr/bin/env bash
# Runs the bf16 GEMM's tests, the bf16 ops' and bf16 FSDP training's (the numerics matrix's
# bf16 cases, 2 and 3 processes) on an emulated CPU with AVX512_BF16, for machines without
# one (the AVX512_BF16 kernel in crates/fsdp-nn/src/ops/bf16_gemm/ only runs where the
# CPU has the instruction). Everything comes from Debian's packages and crates.io:
#
# * Bochs 3.0, built from the next Debian release's source package (Debian 12 ships 2.7,
#   which has no AVX512_BF16), with its Skylake-X model given AVX512_BF16, i.e. a Cooper
#   Lake. Its Sapphire Rapids model does not boot Debian 12's kernel: a Bochs SMM bug with
#   5-level paging, and a hang further on.
# * Debian's kernel, booted from an ISOLINUX image whose initramfs holds busybox and the
#   test binaries, linked statically.
#
# The guest prints its CPU flags and the tests' output on the serial port; this script
# passes only if the guest reports avx512_bf16 and every test passed. About 12 minutes on
# 2 cores the first time (the emulated boot and tests: about a minute; later runs reuse the
# builds). Not part of CI: a tool to rerun when the kernel changes.
# Usage: tools/avx512bf16_emulated.sh [WORK_DIR]
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d)}
mkdir -p "$work"
cd "$work"
echo "avx512bf16_emulated: working in $work" >&2

apt-get update -qq
apt-get install -y -qq g++ make xorriso isolinux syslinux-common busybox-static cpio >/dev/null

# --- Bochs 3.0 from the next release's source package, through apt with private lists.
if [ ! -x bochs-src/bochs ]; then
    mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null ||
        true)
    mirror=${mirror:-$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list)}
    mkdir -p apt/lists/partial src
    echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" \
        > apt/sources.list
    apt_opts=(-o Dir::Etc::SourceList="$work/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o Dir::State::Lists="$work/apt/lists")
    apt-get "${apt_opts[@]}" update -qq
    # The .dsc may be missing on a mirror; the upstream tarball is what is built.
    (cd src && apt-get "${apt_opts[@]}" source --download-only bochs >/dev/null 2>&1 || true)
    tarball=$(ls src/bochs_3.*.orig.tar.* | head -n 1)
    rm -rf bochs-src && mkdir bochs-src
    tar xf "$tarball" -C bochs-src --strip-components=1
    python3 - bochs-src/cpu/cpudb/intel/corei7_skylake-x.cc <<'PY'
import sys
# Skylake-X plus AVX512_BF16 (a Cooper Lake): the instruction, and CPUID leaf 7 sub-leaf 1
# reporting it.
path = sys.argv[1]
s = open(path).read()
s = s.replace("  enable_cpu_extension(BX_ISA_AVX512_BW);\n",
              "  enable_cpu_extension(BX_ISA_AVX512_BW);\n"
              "  enable_cpu_extension(BX_ISA_AVX512_BF16);\n", 1)
at = s.index("void corei7_skylake_x_t::get_std_cpuid_leaf_7(")
old = "leaf->eax = 0; /* report max sub-leaf"
at = s.index(old, at)
s = s[:at] + "leaf->eax = 1; /* report max sub-leaf" + s[at + len(old):]
at = s.index("  default:\n", at)
s = (s[:at] + "  case 1:\n    leaf->eax = get_std_cpuid_leaf_7_subleaf_1_eax(0);\n"
     "    leaf->ebx = 0;\n    leaf->ecx = 0;\n    leaf->edx = 0;\n    break;\n" + s[at:])
open(path, "w").write(s)
PY
    (cd bochs-src && ./configure --with-nogui --disable-docbook --enable-x86-64 \
        --enable-cpu-level=6 --enable-all-optimizations --enable-avx --enable-evex \
        --enable-pci --enable-cdrom --enable-a20-pin --enable-fpu --enable-repeat-speedups \
        --enable-handlers-chaining --enable-trace-linking --enable-fast-function-calls \
        >configure.log 2>&1 && make -j"$(nproc)" >make.log 2>&1)
fi
bios=$(dpkg -L bochsbios 2>/dev/null | grep '/BIOS-bochs-latest$' || true)
if [ -z "$bios" ]; then
    apt-get install -y -qq bochsbios vgabios >/dev/null
    bios=$(dpkg -L bochsbios | grep '/BIOS-bochs-latest$')
fi

# --- Debian's kernel.
if [ ! -f iso/vmlinuz ]; then
    mkdir -p kernel iso/isolinux
    (cd kernel && apt-get download linux-image-amd64 >/dev/null 2>&1 &&
        image=$(dpkg-deb -f linux-image-amd64_*.deb Depends | grep -o 'linux-image-[0-9][^ ,]*') &&
        apt-get download "$image" >/dev/null 2>&1 &&
        dpkg-deb --fsys-tarfile "$image"_*.deb | tar x ./boot)
    cp kernel/boot/vmlinuz-* iso/vmlinuz
fi
cp /usr/lib/ISOLINUX/isolinux.bin /usr/lib/syslinux/modules/bios/ldlinux.c32 iso/isolinux/
cat > iso/isolinux/isolinux.cfg <<'CFG'
DEFAULT run
PROMPT 0
TIMEOUT 0
LABEL run
  KERNEL /vmlinuz
  APPEND initrd=/initrd.img console=ttyS0,115200 quiet panic=0 mitigations=off
CFG

# --- The tests, linked statically so the initramfs needs no libraries: the kernel's own and
# the bf16 <-> f32 conversions' (compiled for AVX-512 there), the bf16 ops against f32 and
# candle's bf16 element-wise kernels bit for bit, and bf16 FSDP training against f32
# single-process training on 2 and 3 processes (the numerics matrix's bf16 cases).
(cd "$repo" && RUSTFLAGS="-C target-feature=+crt-static" CARGO_TARGET_DIR="$work/target" \
    cargo test -p fsdp --release --no-run --lib --test integration \
    --target x86_64-unknown-linux-gnu --message-format=json 2>/dev/null) > build.json
rm -rf root && mkdir -p root/bin root/proc root/sys root/dev root/tmp root/tests
cp /bin/busybox root/bin/busybox
# The integration binary holds the kernels' and the matrix's tests (kernels::, fsdp_matrix::).
tests="fsdp:bf16 integration:bf16"
for test in $tests; do
    name=${test%%:*}
    exe=$(python3 -c '
import json, sys
for line in open("build.json"):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") \
            and m["target"]["name"] == sys.argv[1] and m["profile"]["test"]:
        print(m["executable"])' "$name" | tail -n 1)
    strip -o "root/tests/$name" "$exe"
    echo "${test#*:} --nocapture" > "root/tests/$name.args"
done
cat > root/init <<INIT
#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t devtmpfs dev /dev
/bin/busybox mkdir -p /dev/shm
/bin/busybox mount -t tmpfs shm /dev/shm
/bin/busybox mount -t tmpfs tmp /tmp
/bin/busybox ip link set lo up
echo "GUEST: cpu flags: \$(/bin/busybox grep -o -w 'avx512f\|avx512bw\|avx512_bf16' /proc/cpuinfo | /bin/busybox sort -u | /bin/busybox tr '\n' ' ')"
for name in $(for test in $tests; do echo -n "${test%%:*} "; done); do
  /tests/\$name --test-threads=1 \$(/bin/busybox cat /tests/\$name.args) 2>&1
  echo "GUEST: exit \$? from /tests/\$name"
done
echo "GUEST: done"
# Let the serial port drain before the power goes.
/bin/busybox sleep 2
/bin/busybox poweroff -f
INIT
chmod +x root/init
(cd root && find . | cpio -o -H newc --quiet) > iso/initrd.img
rm -f boot.iso
xorriso -as mkisofs -quiet -o boot.iso -b isolinux/isolinux.bin -c isolinux/boot.cat \
    -no-emul-boot -boot-load-size 4 -boot-info-table iso 2>/dev/null

# --- Boot it.
cat > bochsrc <<RC
memory: guest=1024, host=1024
cpu: model=corei7_skylake_x, count=1, ips=400000000
romimage: file=$bios
vgaromimage: file=/usr/share/vgabios/vgabios.bin
pci: enabled=1, chipset=i440fx
ata0: enabled=1, ioaddr1=0x1f0, ioaddr2=0x3f0, irq=14
ata0-master: type=cdrom, path=boot.iso, status=inserted
boot: cdrom
com1: enabled=1, mode=file, dev=serial.out
display_library: nogui
log: bochs.log
panic: action=fatal
error: action=report
info: action=ignore
clock: sync=none, time0=local
RC
rm -f serial.out
timeout 900 bochs-src/bochs -q -f bochsrc </dev/null >bochs.stdout 2>&1 || true
grep -a 'GUEST\|^test \|test result\|panicked\|skipped:\|ranks in' serial.out || true
grep -aq 'GUEST: cpu flags:.*avx512_bf16' serial.out || {
    echo "avx512bf16_emulated: the guest CPU has no avx512_bf16" >&2
    exit 1
}
passed=$(grep -ac 'GUEST: exit 0 from' serial.out || true)
if grep -aq 'skipped: this CPU' serial.out || [ "$passed" != "$(echo $tests | wc -w)" ]; then
    echo "avx512bf16_emulated: FAILED (serial log: $work/serial.out)" >&2
    exit 1
fi
echo "avx512bf16_emulated: passed on the emulated AVX512_BF16 CPU" >&2
