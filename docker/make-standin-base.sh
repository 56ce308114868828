#!/usr/bin/env bash
# Make a stand-in for python:3.11-slim-bookworm where base images cannot be pulled.
#
# Debian bookworm (minbase, with python3 and python3-venv: Python 3.11, as in the official image)
# is bootstrapped with debootstrap and committed as a buildah image (vfs storage, which works
# without overlay or user namespaces). The image is then given to the build as
#   buildah bud --build-arg BASE_IMAGE=localhost/tilewise-standin-base:bookworm ...
#
# Idempotent: exits at once when the image exists; keeps the root file system tarball in a cache
# folder so that a second image store can be filled without a second debootstrap. Safe to run
# concurrently (flock). Needs root, debootstrap and buildah.
#
# Environment:
#   STANDIN_IMAGE   image name (default localhost/tilewise-standin-base:bookworm)
#   STANDIN_CACHE   cache folder for the root file system tarball (default /var/cache/tilewise-standin)
#   DEBIAN_MIRROR   Debian mirror (default: the first URI of /etc/apt/sources.list.d/debian.sources,
#                   else http://deb.debian.org/debian)
#   BUILDAH_STORAGE_DRIVER  buildah storage driver (default vfs)
#
# Prints the image name on stdout.
set -euo pipefail

IMAGE="${STANDIN_IMAGE:-localhost/tilewise-standin-base:bookworm}"
CACHE="${STANDIN_CACHE:-/var/cache/tilewise-standin}"
DRIVER="${BUILDAH_STORAGE_DRIVER:-vfs}"
SUITE=bookworm
TARBALL="$CACHE/$SUITE-minbase-python3.tar"

buildah_() { buildah --storage-driver "$DRIVER" "$@"; }

default_mirror() {
    local uri=""
    if [[ -r /etc/apt/sources.list.d/debian.sources ]]; then
        uri="$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)"
    fi
    echo "${uri:-http://deb.debian.org/debian}"
}
MIRROR="${DEBIAN_MIRROR:-$(default_mirror)}"

if [[ "$(id -u)" -ne 0 ]]; then
    echo "make-standin-base.sh: must run as root (debootstrap, buildah vfs)" >&2
    exit 1
fi
for tool in buildah debootstrap; do
    command -v "$tool" >/dev/null || { echo "make-standin-base.sh: $tool not found" >&2; exit 1; }
done

mkdir -p "$CACHE"
exec 9>"$CACHE/lock"
flock 9

if buildah_ inspect --type image "$IMAGE" >/dev/null 2>&1; then
    echo "$IMAGE"
    exit 0
fi

if [[ ! -s "$TARBALL" ]]; then
    rootfs="$(mktemp -d "$CACHE/rootfs.XXXXXX")"
    trap 'rm -rf "$rootfs"' EXIT
    echo "debootstrap $SUITE (minbase, python3, python3-venv) from $MIRROR" >&2
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        "$SUITE" "$rootfs" "$MIRROR" >&2
    # What the official slim images drop too: apt lists and caches, docs, man pages.
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
        "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*
    # The official image puts python3.11 on PATH as python3; keep /usr/bin/python3 as it is.
    tar --numeric-owner --xattrs -C "$rootfs" -cf "$TARBALL.part" .
    mv "$TARBALL.part" "$TARBALL"
    rm -rf "$rootfs"
    trap - EXIT
fi

ctr="$(buildah_ from --quiet scratch)"
trap 'buildah_ rm "$ctr" >/dev/null 2>&1 || true' EXIT
buildah_ add --quiet "$ctr" "$TARBALL" / >/dev/null
buildah_ config \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 \
    --cmd python3 \
    --label org.opencontainers.image.description="tilewise stand-in for python:3.11-slim-bookworm" \
    "$ctr"
buildah_ commit --quiet --format docker "$ctr" "$IMAGE" >/dev/null
echo "$IMAGE"
