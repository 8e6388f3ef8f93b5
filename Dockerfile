# syntax=docker/dockerfile:1
# loopvol: build with the dev dependencies, run with the production ones only, on the current
# Node.js LTS (26) slim image plus the host tools the driver runs.

FROM node:26-trixie-slim AS build
WORKDIR /src
COPY package.json package-lock.json ./
RUN npm ci --ignore-scripts
COPY tsconfig.json tsconfig.build.json ./
COPY proto ./proto
COPY src ./src
RUN npm run build && npm prune --omit=dev --ignore-scripts

FROM node:26-trixie-slim
# util-linux: losetup, blkid, blockdev, fsfreeze, fallocate; mount: mount, umount;
# e2fsprogs: mkfs.ext4, e2fsck, resize2fs; xfsprogs: mkfs.xfs, xfs_growfs; btrfs-progs: mkfs.btrfs, btrfs.
RUN apt-get update \
 && apt-get install -y --no-install-recommends util-linux mount e2fsprogs xfsprogs btrfs-progs \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/loopvol
COPY --from=build /src/package.json ./
COPY --from=build /src/node_modules ./node_modules
COPY --from=build /src/dist ./dist
COPY --from=build /src/proto ./proto
ENV NODE_ENV=production
ENTRYPOINT ["node", "/opt/loopvol/dist/main.js"]
