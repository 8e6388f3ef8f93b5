# loopvol: build with the dev dependencies, run with the production ones only, on the current
# Node.js LTS (26) slim image plus the host tools the driver runs.
#
# No `# syntax=` line: it would make BuildKit fetch a Dockerfile frontend image from a registry at
# every build; the frontend built into the engine reads this file, so it builds where no registry is
# reachable too (with BASE_IMAGE already loaded, e.g. test/container/standin-base.sh).
#
# BASE_IMAGE: any image laid out like the official Node.js one (node and npm on PATH, Debian apt).
# A TLS-intercepting proxy's CA for `npm ci`: pass it as a build secret, which is mounted for that one
# step and is in no layer of any stage:
#   docker build --secret id=npm_ca,src=/path/to/ca.pem .     (BuildKit)
ARG BASE_IMAGE=node:26-trixie-slim

FROM ${BASE_IMAGE} AS build
WORKDIR /src
COPY package.json package-lock.json ./
RUN --mount=type=secret,id=npm_ca \
    if [ -s /run/secrets/npm_ca ]; then export NODE_EXTRA_CA_CERTS=/run/secrets/npm_ca; fi \
 && npm ci --ignore-scripts
COPY tsconfig.json tsconfig.build.json ./
COPY proto ./proto
COPY src ./src
RUN npm run build && npm prune --omit=dev --ignore-scripts

FROM ${BASE_IMAGE}
# util-linux: losetup, blkid, blockdev, fsfreeze, fallocate, setpriv; mount: mount, umount;
# e2fsprogs: mkfs.ext4, e2fsck, resize2fs; xfsprogs: mkfs.xfs, xfs_growfs; btrfs-progs: mkfs.btrfs, btrfs.
RUN apt-get update \
 && apt-get install -y --no-install-recommends util-linux mount e2fsprogs xfsprogs btrfs-progs \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/loopvol
COPY --from=build /src/package.json ./
COPY --from=build /src/node_modules ./node_modules
COPY --from=build /src/dist ./dist
COPY --from=build /src/proto ./proto
# One malloc arena: glibc gives each thread that allocates (V8's compiler and GC helpers, libuv's
# file-system threads) an arena of its own, and what a burst of calls left in them stays. With one,
# 1,000 volumes on Node 26 left 5–10 MiB (median 7) less 35 s after the burst; the same idle; no cost in
# calls per second seen on a 2-CPU host (bench/README.md, "One malloc arena").
ENV NODE_ENV=production MALLOC_ARENA_MAX=1
# A 1 MiB young generation: the driver's per-call garbage is short-lived, and V8's default lets it grow
# to 16 MiB per semi-space and stay (bench/README.md, resources: ~9 MiB idle, ~23 MiB after 1,000 volumes).
ENTRYPOINT ["node", "--max-semi-space-size=1", "/opt/loopvol/dist/main.js"]
