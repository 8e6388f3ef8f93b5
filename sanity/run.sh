#!/usr/bin/env bash
# Runs the upstream conformance tool, csi-sanity, against a throwaway loopvol: once with mount volumes
# and once with block volumes. Writes JUnit reports, tears everything down, and exits non-zero on any
# failure. Exit status 3 means csi-sanity was not found (see sanity/README.md for how to get it).
#
#   sanity/run.sh [mount|block ...]         (default: mount block)
#   CSI_SANITY=/path/to/csi-sanity  SANITY_OUT=dir  SANITY_FOCUS=regex  sanity/run.sh
#
# Against plugins someone else runs (test/container/run.sh: the built image in containers), instead of
# a throwaway driver:
#   SANITY_ENDPOINT=/node.sock  SANITY_CONTROLLER_ENDPOINT=/controller.sock  (when not the same)
#   SANITY_DIR=dir    where the staging and target directories go: one the node plugin sees at the
#                     same path (its kubelet directory)
#   SANITY_POOL=dir   the plugins' pool, so that loop devices left attached to its images count as leaks
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
modes=("$@")
[ ${#modes[@]} -eq 0 ] && modes=(mount block)

sanity=${CSI_SANITY:-$(command -v csi-sanity || true)}
if [ -z "$sanity" ] || [ ! -x "$sanity" ]; then
  cat >&2 <<'MSG'
csi-sanity was not found: set $CSI_SANITY to its path or put it on PATH.
It is the Go program cmd/csi-sanity of github.com/kubernetes-csi/csi-test (this runner is checked
against release v5.3.1), built outside this repository; see sanity/README.md.
MSG
  exit 3
fi

external=${SANITY_ENDPOINT:-}
if [ -z "$external" ] &&
  { [ ! -f "$repo/dist/main.js" ] || [ -n "$(find "$repo/src" -newer "$repo/dist/main.js" -name '*.ts' -print -quit)" ]; }; then
  (cd "$repo" && npm run -s build) || exit 1
fi

out=${SANITY_OUT:-$here/out}
mkdir -p "$out"
tmp=$(mktemp -d "${SANITY_DIR:-/tmp}/loopvol-sanity.XXXXXX")
pool=${SANITY_POOL:-$tmp}
driver_pid=""

teardown() {
  if [ -n "$driver_pid" ] && kill -0 "$driver_pid" 2>/dev/null; then
    kill -TERM "$driver_pid"
    wait "$driver_pid" 2>/dev/null
  fi
  # Anything still mounted under the throwaway directory, or attached from it, is a leak: report it,
  # then remove exactly that.
  leaks=0
  while read -r mp; do
    [ -z "$mp" ] && continue
    echo "LEAK: mount $mp" >&2; leaks=1
    umount "$mp" 2>/dev/null || umount -l "$mp"
  done < <(awk -v t="$tmp" '$5 == t || index($5, t "/") == 1 { print $5 }' /proc/self/mountinfo | sort -r)
  while read -r dev file; do
    [ -z "$dev" ] && continue
    echo "LEAK: loop device $dev ($file)" >&2; leaks=1
    losetup -d "$dev"
  done < <(losetup -nO NAME,BACK-FILE 2>/dev/null | awk -v t="$pool" 'index($2, t "/") == 1 { print $1, $2 }')
  [ -f "$tmp/driver.log" ] && cp "$tmp/driver.log" "$out/driver.log"
  rm -rf "$tmp"
  return $leaks
}
trap 'teardown; exit 130' INT TERM

if [ -n "$external" ]; then
  endpoint=${external#unix://}
  controller_endpoint=${SANITY_CONTROLLER_ENDPOINT:-$endpoint}
  controller_endpoint=${controller_endpoint#unix://}
else
  node "$repo/dist/main.js" \
    --endpoint="unix://$tmp/csi.sock" \
    --nodeid=sanity-node \
    --pool-dir="$tmp/pool" \
    --pool-name=sanity \
    --max-volumes-per-node=8 \
    --log-level=info >"$tmp/driver.log" 2>&1 &
  driver_pid=$!
  for _ in $(seq 1 100); do
    [ -S "$tmp/csi.sock" ] && break
    sleep 0.1
  done
  endpoint=$tmp/csi.sock
  controller_endpoint=$endpoint
fi

# loopvol advertises SNAPSHOT_METADATA_SERVICE (the CSI SnapshotMetadata service). csi-sanity releases
# before v5.4.0 (csi-test commit 4c47228c) fail their "GetPluginCapabilities should return appropriate
# capabilities" spec on any capability they do not know. Ask this binary that one spec first; when it
# fails for exactly that reason, skip that spec (and say so) and run everything else.
skip=""
probe_log="$out/sanity-capabilities.log"
"$sanity" --csi.endpoint="$endpoint" --csi.controllerendpoint="$controller_endpoint" \
  --csi.mountdir="$tmp/target-probe" --csi.stagingdir="$tmp/staging-probe" \
  --ginkgo.focus='GetPluginCapabilities' --ginkgo.no-color >"$probe_log" 2>&1
if [ $? -ne 0 ]; then
  if grep -q 'Unknown service: SNAPSHOT_METADATA_SERVICE' "$probe_log"; then
    skip='GetPluginCapabilities should return appropriate capabilities'
    echo "=== this csi-sanity predates SNAPSHOT_METADATA_SERVICE (before v5.4.0): skipping \"$skip\" (see sanity/README.md)"
  else
    echo "=== csi-sanity's GetPluginCapabilities spec failed:" >&2
    cat "$probe_log" >&2
    status=1
  fi
fi

# csi-sanity's own connect (utils.Connect in csi-test) reads the connection's state once, then waits for
# it to change: a connection that became ready before that first look is never seen, and the spec's
# [BeforeEach] fails after a minute with "Connection timed out" while the driver sits idle (seen on a
# loaded machine). A run whose every failure is exactly that is run once more, and says so.
only_connect_race() {
  local log=$1 failed setup
  failed=$(grep -oE 'Summarizing [0-9]+ Failures?' "$log" | grep -oE '[0-9]+' || true)
  setup=$(grep -cE 'In \[BeforeEach\] at: .*/pkg/sanity/sanity\.go:' "$log" || true)
  [ -n "$failed" ] && [ "$failed" -gt 0 ] && [ "$setup" -eq "$failed" ] && grep -q 'Connection timed out' "$log"
}

status=${status:-0}
for mode in "${modes[@]}"; do
  echo "=== csi-sanity, $mode volumes"
  args=(
    --csi.endpoint="$endpoint"
    --csi.controllerendpoint="$controller_endpoint"
    --csi.mountdir="$tmp/target-$mode"
    --csi.stagingdir="$tmp/staging-$mode"
    --csi.testvolumeaccesstype="$mode"
    --csi.testvolumesize=$((100 * 1024 * 1024))
    --csi.testvolumeexpandsize=$((200 * 1024 * 1024))
    --csi.testvolumeparameters="$here/volume-parameters.yaml"
    --csi.testvolumemutableparameters="$here/mutable-parameters.yaml"
    --csi.testsnapshotparameters="$here/snapshot-parameters.yaml"
    --csi.testnodevolumeattachlimit
    --ginkgo.junit-report="$out/junit-$mode.xml"
    --ginkgo.no-color
  )
  [ -n "${SANITY_FOCUS:-}" ] && args+=(--ginkgo.focus="$SANITY_FOCUS")
  [ -n "$skip" ] && args+=(--ginkgo.skip="$skip")
  for attempt in 1 2; do
    "$sanity" "${args[@]}" 2>&1 | tee "$out/sanity-$mode.log" | grep -E '^(Ran |FAIL|SUCCESS|PASS|\[FAIL\]|  \[FAIL\])|Passed|Failed|Skipped|Pending'
    rc=${PIPESTATUS[0]}
    [ "$rc" -ne 0 ] && [ "$attempt" -eq 1 ] && only_connect_race "$out/sanity-$mode.log" || break
    mv "$out/sanity-$mode.log" "$out/sanity-$mode.connect-race.log"
    echo "(csi-sanity's connect missed a ready connection, its own race: see run.sh)"
    echo "=== csi-sanity, $mode volumes, once more"
  done
  [ "$rc" -ne 0 ] && status=1
done

teardown || status=1
exit $status
