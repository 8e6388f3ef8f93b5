# Sourced by the scripts that build a root filesystem (test/container/standin-base.sh,
# test/kernels/run.sh): `make_work PREFIX` sets $work to a new directory under /var/tmp, removed at
# exit with whatever is still mounted under it (debootstrap and chroot steps mount proc and sys in
# the target; never leave them behind).
make_work() {
  work=$(mktemp -d "/var/tmp/$1.XXXXXX")
  trap remove_work EXIT
}

remove_work() {
  for m in $(awk -v t="$work/" 'index($5, t) == 1 { print $5 }' /proc/self/mountinfo | sort -r); do
    umount "$m" 2>/dev/null || umount -l "$m"
  done
  rm -rf "$work"
}
