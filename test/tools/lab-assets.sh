#!/usr/bin/env bash
# lab-assets.sh prepares what the qemu lab (package test/lab) boots: Debian's
# kernel and its modules, plus the host tools the lab's initramfs is built from
# (qemu, a static busybox, kmod, iproute2, iptables).
#
# Output directory: ${KST_ASSETS_DIR:-$HOME/.cache/kube-service-tunnel/assets}/lab
#   vmlinuz           the kernel
#   kernel-version    its version (KVER), one line
#   root/lib/modules/KVER/...   its modules, with depmod's indexes, so that
#                     `modprobe -d LAB/root -S KVER --show-depends MOD` works
#   ready             written last; its presence means the rest is complete
# The kernel is downloaded only when "ready" is missing. The last line of
# stdout is the lab directory.
#
# It downloads exactly one package, the linux-image-X.Y.Z-N-amd64 that
# `apt-cache depends linux-image-amd64` names (never a glob: that would match
# dozens of 70 MB kernels). Installing missing tools needs root.
set -euo pipefail

ASSETS_DIR="${KST_ASSETS_DIR:-$HOME/.cache/kube-service-tunnel/assets}"
LAB_DIR="$ASSETS_DIR/lab"
APT_PACKAGES=(qemu-system-x86 busybox-static kmod cpio iptables iproute2 bird2)

WORK_DIR=""
cleanup() { if [[ -n "$WORK_DIR" ]]; then rm -rf "$WORK_DIR"; fi; }
trap cleanup EXIT

log() { echo "lab-assets: $*" >&2; }
die() { log "$*"; exit 1; }

APT_UPDATED=0
apt_update() {
	if [[ $APT_UPDATED == 0 ]]; then
		apt-get update -qq >&2
		APT_UPDATED=1
	fi
}

# tools_present: true when every host tool the lab uses is installed.
tools_present() {
	command -v qemu-system-x86_64 && command -v modprobe && command -v depmod &&
		command -v cpio && command -v iptables && command -v ip &&
		command -v bird && command -v birdc && dpkg -s busybox-static
} >/dev/null 2>&1

install_tools() {
	if tools_present; then return; fi
	[[ $(id -u) == 0 ]] || die "missing tools and not root: apt-get install -y ${APT_PACKAGES[*]}"
	log "installing ${APT_PACKAGES[*]}"
	apt_update
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${APT_PACKAGES[@]}" >&2
	tools_present || die "tools still missing after apt-get install"
}

# kernel_package: the linux-image-* package linux-image-amd64 depends on.
kernel_package() {
	local pkg
	pkg="$(apt-cache depends linux-image-amd64 2>/dev/null | awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ { print $2; exit }')"
	if [[ -z "$pkg" ]]; then
		apt_update
		pkg="$(apt-cache depends linux-image-amd64 | awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ { print $2; exit }')"
	fi
	[[ -n "$pkg" ]] || die "apt-cache depends linux-image-amd64 names no linux-image package"
	echo "$pkg"
}

# decompress_modules DIR: turns .ko.xz/.ko.zst/.ko.gz into plain .ko, which
# busybox's insmod loads as they are.
decompress_modules() {
	local dir="$1" f
	while IFS= read -r -d '' f; do
		case "$f" in
		*.xz) xz -dq "$f" ;;
		*.zst) zstd -dq --rm "$f" ;;
		*.gz) gzip -dq "$f" ;;
		esac
	done < <(find "$dir" -type f \( -name '*.ko.xz' -o -name '*.ko.zst' -o -name '*.ko.gz' \) -print0)
}

fetch_kernel() {
	local pkg start=$SECONDS
	pkg="$(kernel_package)"
	WORK_DIR="$(mktemp -d "$ASSETS_DIR/lab.tmp.XXXXXX")"
	log "downloading $pkg into $WORK_DIR"
	(cd "$WORK_DIR" && apt-get download -q -o APT::Sandbox::User=root "$pkg" >&2) || die "apt-get download $pkg failed"
	local deb
	deb="$(find "$WORK_DIR" -maxdepth 1 -name "${pkg}_*.deb" -print -quit)"
	[[ -n "$deb" ]] || die "apt-get download $pkg left no .deb in $WORK_DIR"
	dpkg-deb -x "$deb" "$WORK_DIR/extract"

	local stage="$WORK_DIR/lab" kver moddir
	mkdir -p "$stage/root/lib/modules"
	for moddir in "$WORK_DIR/extract/lib/modules" "$WORK_DIR/extract/usr/lib/modules"; do
		if [[ -d "$moddir" ]]; then
			kver="$(ls "$moddir" | head -n1)"
			mv "$moddir/$kver" "$stage/root/lib/modules/$kver"
			break
		fi
	done
	[[ -n "${kver:-}" ]] || die "$pkg holds no lib/modules/KVER"
	local vmlinuz
	vmlinuz="$(find "$WORK_DIR/extract/boot" -maxdepth 1 -name "vmlinuz-$kver" -print -quit)"
	[[ -n "$vmlinuz" ]] || die "$pkg holds no boot/vmlinuz-$kver"
	mv "$vmlinuz" "$stage/vmlinuz"
	echo "$kver" >"$stage/kernel-version"
	decompress_modules "$stage/root/lib/modules/$kver"
	depmod -b "$stage/root" "$kver"
	echo "$pkg" >"$stage/ready"

	rm -rf "$LAB_DIR"
	mv "$stage" "$LAB_DIR"
	log "kernel $kver ready in $LAB_DIR in $((SECONDS - start))s"
}

main() {
	install_tools
	mkdir -p "$ASSETS_DIR"
	ASSETS_DIR="$(cd "$ASSETS_DIR" && pwd)"
	LAB_DIR="$ASSETS_DIR/lab"
	if [[ -f "$LAB_DIR/ready" ]]; then
		log "kernel present: $(cat "$LAB_DIR/kernel-version") ($(cat "$LAB_DIR/ready"))"
	else
		fetch_kernel
	fi
	echo "$LAB_DIR"
}

main "$@"
