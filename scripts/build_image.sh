#!/usr/bin/env bash
# Build the videotrain image from ./Dockerfile and run five checks inside it, as uid 1000 with a
# host folder mounted at /outputs. See docs/cluster.md ("Docker").
#
#   scripts/build_image.sh                 # build, check, print one line per check + image size
#   scripts/build_image.sh --print-mirror  # the Debian mirror a stand-in base would use
#
# Builder: Docker when a daemon answers, otherwise buildah (`--isolation chroot`, no daemon;
# installed with apt-get when missing and we are root). If BASE_IMAGE (the Dockerfile's default,
# python:3.11-slim-bookworm) cannot be pulled (no registry), a stand-in with the same layout is
# built with debootstrap: Debian bookworm with its python 3.11 as `python`/`python3`, venv,
# ca-certificates (plus the host's own CA certificates, for a site's TLS proxy) and apt.
#
# Environment (all optional):
#   IMAGE=videotrain          tag of the image built
#   BASE_IMAGE=...            the base to build on (default: the Dockerfile's)
#   MIRROR=URL                Debian mirror for the stand-in; default: the first bookworm mirror
#                             in /etc/apt/sources.list or /etc/apt/sources.list.d/*.{list,sources}
#   OUT_DIR=DIR               host folder mounted at /outputs (default: a new temporary folder)
#   STORAGE_DRIVER=vfs        buildah's storage driver (default: buildah's own, overlay where the
#                             kernel allows it; vfs works everywhere but copies every layer)
#   BUILDER=docker|buildah    force one
#   APT_ETC=/etc/apt          where the host's apt sources are read for MIRROR
#   SKIP_BUILD=1              run the checks on the image already built as IMAGE
# Exit status: 0 when the build and every check pass, 1 when a check fails, 2 on a build error.
# shellcheck disable=SC2317  # the check functions are called through check()
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-videotrain}
SUITE=bookworm
STANDIN=localhost/videotrain-base:python3.11-${SUITE}
DEFAULT_BASE=$(sed -n 's/^ARG BASE_IMAGE=//p' Dockerfile)
BASE_IMAGE=${BASE_IMAGE:-$DEFAULT_BASE}
STORAGE_DRIVER=${STORAGE_DRIVER:-}
COMMIT=$(git describe --always --dirty 2>/dev/null || echo '?')  # what the image is built from

log() { echo "build_image: $*" >&2; }
die() { echo "error: build_image: $*" >&2; exit 2; }

# The first mirror URL for $SUITE (not -security, -updates) in the host's apt sources: deb822
# stanzas (URIs:/Suites:) in *.sources, one-line `deb [opts] URI SUITE ...` in *.list.
host_mirror() {
    local f etc=${APT_ETC:-/etc/apt}
    for f in "$etc/sources.list" "$etc"/sources.list.d/*.list "$etc"/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        case "$f" in
        *.sources)
            awk -v suite="$SUITE" 'BEGIN { RS = "" } {
                uri = ""; ok = 0; on = 1; n = split($0, line, "\n")
                for (i = 1; i <= n; i++) {
                    if (line[i] ~ /^[ \t]*#/) continue
                    m = split(line[i], w, /[ \t]+/)
                    if (w[1] == "URIs:") uri = w[2]
                    if (w[1] == "Suites:") for (j = 2; j <= m; j++) if (w[j] == suite) ok = 1
                    if (w[1] == "Enabled:" && w[2] == "no") on = 0
                }
                if (uri != "" && ok && on) { print uri; exit }
            }' "$f" ;;
        *)
            awk -v suite="$SUITE" '$1 == "deb" {
                i = 2
                if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                if ($(i + 1) == suite) { print $i; exit }
            }' "$f" ;;
        esac
    done | head -n 1
}

if [ "${1:-}" = --print-mirror ]; then
    echo "${MIRROR:-$(host_mirror)}"
    exit 0
fi

bh() { buildah ${STORAGE_DRIVER:+--storage-driver "$STORAGE_DRIVER"} "$@"; }
have_docker() { command -v docker >/dev/null && timeout 20 docker info >/dev/null 2>&1; }

echo "build_image.sh: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $COMMIT, on $(uname -m) with $(nproc) CPUs"

# ---------------------------------------------------------------- builder
BUILDER=${BUILDER:-}
if [ -z "$BUILDER" ]; then
    if have_docker; then BUILDER=docker; else BUILDER=buildah; fi
fi
if [ "$BUILDER" = buildah ] && ! command -v buildah >/dev/null; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        die "no Docker daemon and no buildah: install buildah"
    fi
    log "installing buildah (apt-get)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah >/dev/null
fi
if [ "$BUILDER" = buildah ]; then
    log "builder: buildah $(bh --version | awk '{ print $3 }'), storage driver $(bh info --format '{{.store.GraphDriverName}}')"
else
    log "builder: docker"
fi

image_id() {
    if [ "$BUILDER" = docker ]; then docker image inspect -f '{{.Id}}' "$1" 2>/dev/null
    else bh inspect --type image -f '{{.FromImageID}}' "$1" 2>/dev/null; fi
}
image_exists() {
    if [ "$BUILDER" = docker ]; then docker image inspect "$1" >/dev/null 2>&1
    else bh inspect --type image "$1" >/dev/null 2>&1; fi
}
pull() {
    if [ "$BUILDER" = docker ]; then timeout 300 docker pull -q "$1" >/dev/null 2>&1
    else timeout 300 bh pull -q "$1" >/dev/null 2>&1; fi
}

# ---------------------------------------------------------------- base (or a stand-in), build
build_standin() {
    local mirror=${MIRROR:-$(host_mirror)} rootfs ctr mnt
    [ -n "$mirror" ] || die "no Debian $SUITE mirror in /etc/apt/sources*; set MIRROR=URL"
    if ! command -v debootstrap >/dev/null; then
        [ "$(id -u)" = 0 ] || die "debootstrap is needed to build a stand-in base (run as root)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
    fi
    rootfs=$(mktemp -d /var/tmp/videotrain-base.XXXXXX)
    log "stand-in base $STANDIN: debootstrap $SUITE from $mirror"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        "$SUITE" "$rootfs" "$mirror" >/dev/null
    # the official python image's names: python and python3 on PATH (/usr/local/bin first)
    ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python"
    ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python3"
    # the host's own CA certificates (a site's TLS proxy), trusted by apt, pip and python
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
        chroot "$rootfs" update-ca-certificates >/dev/null
        printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$rootfs/etc/pip.conf"
    fi
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
    if [ "$BUILDER" = docker ]; then
        tar -C "$rootfs" -c . | docker import --change 'CMD ["python3"]' - "$STANDIN" >/dev/null
    else
        ctr=$(bh from scratch)
        mnt=$(bh mount "$ctr")
        cp -a "$rootfs"/. "$mnt"/
        bh umount "$ctr" >/dev/null
        bh config --cmd python3 --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            --env LANG=C.UTF-8 "$ctr"
        bh commit -q --rm "$ctr" "$STANDIN" >/dev/null
    fi
    rm -rf "$rootfs"
}

if [ "${SKIP_BUILD:-}" = 1 ]; then
    image_exists "$IMAGE" || die "SKIP_BUILD=1 but there is no image $IMAGE"
else
    if ! image_exists "$BASE_IMAGE" && ! pull "$BASE_IMAGE"; then
        log "cannot pull $BASE_IMAGE: building a stand-in with the same layout"
        image_exists "$STANDIN" || build_standin
        BASE_IMAGE=$STANDIN
    fi
    log "building $IMAGE on $BASE_IMAGE"
    old=$(image_id "$IMAGE" || true)
    t0=$(date +%s)
    if [ "$BUILDER" = docker ]; then
        docker build --build-arg "BASE_IMAGE=$BASE_IMAGE" -t "$IMAGE" . || die "docker build failed"
    else
        bh bud --isolation chroot --network host --build-arg "BASE_IMAGE=$BASE_IMAGE" \
            -t "$IMAGE" . || die "buildah bud failed"
    fi
    echo "build: $(($(date +%s) - t0)) s on $BASE_IMAGE, commit $COMMIT"
    # the image this build replaced (now untagged) would hold its GBs until pruned: remove it
    if [ -n "$old" ] && [ "$old" != "$(image_id "$IMAGE")" ]; then
        if [ "$BUILDER" = docker ]; then docker rmi "$old" >/dev/null 2>&1 || true
        else bh rmi "$old" >/dev/null 2>&1 || true; fi
    fi
fi

# ---------------------------------------------------------------- checks, inside the image
OUT_DIR=${OUT_DIR:-$(mktemp -d /var/tmp/videotrain-outputs.XXXXXX)}
mkdir -p "$OUT_DIR"
chown 1000:1000 "$OUT_DIR" 2>/dev/null || chmod 777 "$OUT_DIR"
CTR=
cleanup() { if [ -n "$CTR" ]; then bh rm "$CTR" >/dev/null 2>&1 || true; fi; }
trap cleanup EXIT
if [ "$BUILDER" = buildah ]; then
    # a hostname that resolves, as in `docker run` (torchrun --standalone rendezvous on it)
    CTR=$(bh from -q --add-host videotrain:127.0.0.1 "$IMAGE")
    # buildah run mounts a fresh volume at the image's VOLUME /outputs over a -v at the same
    # path (docker run's -v replaces it): drop the VOLUME from this working container only
    bh config --volume /outputs- "$CTR"
fi

# in_image PROGRAM ARGS...: PROGRAM in the image as uid 1000, cwd /outputs = $OUT_DIR
in_image() {
    if [ "$BUILDER" = docker ]; then
        docker run --rm --user 1000:1000 --shm-size=2g -v "$OUT_DIR:/outputs" --entrypoint "$1" "$IMAGE" "${@:2}"
    else
        bh run --isolation chroot --network host --hostname videotrain --user 1000:1000 -v "$OUT_DIR:/outputs" "$CTR" -- "$@"
    fi
}
# the image's own ENTRYPOINT (python -m videotrain), so check (a) runs what `docker run` runs
if [ "$BUILDER" = docker ]; then
    mapfile -t ENTRY < <(docker image inspect -f '{{range .Config.Entrypoint}}{{println .}}{{end}}' "$IMAGE" | sed '/^$/d')
else
    mapfile -t ENTRY < <(bh inspect --type image -f '{{range .OCIv1.Config.Entrypoint}}{{println .}}{{end}}' "$IMAGE" | sed '/^$/d')
fi

FAILED=0
# check NAME COMMAND...: runs it, logs its output to $OUT_DIR/NAME.log, prints one line
check() {
    local name=$1 t0 rc=0
    shift
    t0=$(date +%s.%N)
    "$@" >"$OUT_DIR/$name.log" 2>&1 || rc=$?
    printf '%-26s %-4s %s s\n' "$name" "$([ $rc = 0 ] && echo ok || echo FAIL)" \
        "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%7.1f", b - a }')"
    if [ $rc != 0 ]; then FAILED=1; tail -n 20 "$OUT_DIR/$name.log" | sed 's/^/    /'; fi
}
results_at() {  # results_at RUN_DIR: the run finished (results.json written by rank 0)
    test -s "$OUT_DIR/$1/results.json"
}
default_job() { in_image "${ENTRY[@]}" hydra.run.dir=runs/default && results_at runs/default; }
torchrun_ddp() {
    in_image torchrun --standalone --nproc_per_node=2 -m videotrain device=cpu data.batch_size=2 \
        trainer.max_steps=4 hydra.run.dir=runs/torchrun && results_at runs/torchrun \
        && grep -q '"world_size": 2' "$OUT_DIR/runs/torchrun/results.json"
}
cfg_job() {
    in_image python -m videotrain +exp=kinetics_sbp --cfg job >"$OUT_DIR/cfg_job.yaml" \
        && grep -q '_target_: videotrain.memory.sbp.StochasticBackprop' "$OUT_DIR/cfg_job.yaml"
}
torchcodec_run() {
    in_image python -m videotrain data.decoder=torchcodec trainer.max_steps=4 \
        hydra.run.dir=runs/torchcodec && results_at runs/torchcodec
}
sbp_bf16_grads() { in_image python /opt/videotrain/scripts/check_sbp_autocast_grads.py; }

echo "checks in $IMAGE as uid 1000, /outputs = $OUT_DIR:"
check default_job default_job
check torchrun_ddp_2proc torchrun_ddp
check exp_kinetics_sbp_cfg_job cfg_job
check decoder_torchcodec torchcodec_run
check sbp_bf16_all_grads sbp_bf16_grads
sed -n '/^torch /,$p' "$OUT_DIR/sbp_bf16_all_grads.log"
in_image python -c "import torch, torchvision, torchcodec; print('in the image: torch', torch.__version__, 'torchvision', torchvision.__version__, 'torchcodec', torchcodec.__version__)" || FAILED=1

if [ "$BUILDER" = docker ]; then
    size=$(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{ printf "%.2f GB", $1 / 1e9 }')
else
    size=$(bh images --format '{{.Size}}' "$IMAGE" | head -n 1)
fi
echo "image $IMAGE: $size"
[ $FAILED = 0 ] && echo "all checks ok" || echo "some check FAILED (logs in $OUT_DIR)"
exit $FAILED
