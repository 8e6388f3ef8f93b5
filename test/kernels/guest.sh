#!/bin/sh
# Runs in the guest that test/kernels/run.sh boots, as PID 1 (from /sbin/loopvol-guest-init): the
# kernel modules the suites need, the loopback for sshd, then vitest with the arguments run.sh wrote.
# The last line it prints, "loopvol-guest: exit=N", is what run.sh reads; then the guest powers off.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
for m in loop ext4 xfs btrfs fuse; do modprobe "$m" 2>/dev/null; done
ip link set lo up
hostname loopvol-guest
echo "loopvol-guest: kernel $(uname -r); node $(node --version); $(mkfs.xfs -V); $(mke2fs -V 2>&1 | head -1); $(mkfs.btrfs --version | head -1); $(losetup --version)"
cd /opt/loopvol || exit 1
# An emulated CPU (run.sh's loopvol.slow=N) stretches the suites' waits and timeouts N times.
slow=$(sed -n 's/.*loopvol\.slow=\([0-9]*\).*/\1/p' /proc/cmdline)
export LOOPVOL_TEST_SLOW=${slow:-1}
# Its files one at a time: a guest's two CPUs (often emulated) have no time to spare for files side by side.
export LOOPVOL_TEST_WORKERS=1
# shellcheck disable=SC2046 # one argument per line, none with spaces
node node_modules/vitest/vitest.mjs run --testTimeout=$((180000 * LOOPVOL_TEST_SLOW)) \
  --hookTimeout=$((180000 * LOOPVOL_TEST_SLOW)) $(cat test/kernels/.vitest-args)
echo "loopvol-guest: exit=$?"
sync
echo o >/proc/sysrq-trigger
sleep 10
