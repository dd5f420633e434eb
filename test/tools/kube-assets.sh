#!/usr/bin/env bash
# kube-assets.sh builds the kube-apiserver and etcd binaries used by the
# integration tests (package test/kubeenv), the kubelet,
# kube-controller-manager and kube-scheduler of the lab's real node
# (test/lab), kube-network-policies (the SIG Network NetworkPolicy
# engine the lab cluster runs on its worker), Flannel and Calico (the lab
# cluster's network plugins), from the Go module proxy.
#
# Output directory: ${KST_ASSETS_DIR:-$HOME/.cache/kube-service-tunnel/assets}
# Each binary is skipped when it already exists there and answers --version.
# The last line of stdout is the assets directory.
#
# Overrides: KUBE_VERSION (default v1.34.4), ETCD_VERSION (default v3.6.16),
# KNP_VERSION (default v0.8.0).
set -euo pipefail

KUBE_VERSION="${KUBE_VERSION:-v1.34.4}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.16}"
KNP_VERSION="${KNP_VERSION:-v0.8.0}"
ASSETS_DIR="${KST_ASSETS_DIR:-$HOME/.cache/kube-service-tunnel/assets}"

WORK_DIRS=()
cleanup() {
	local d
	for d in "${WORK_DIRS[@]}"; do rm -rf "$d"; done
	rm -f "$ASSETS_DIR"/*.tmp
}
trap cleanup EXIT

log() { echo "kube-assets: $*" >&2; }

# have BINARY: true when the binary exists and runs --version.
have() {
	[[ -x "$ASSETS_DIR/$1" ]] && "$ASSETS_DIR/$1" --version >/dev/null 2>&1
}

# go_directives GOMOD: prints the go and godebug lines/blocks of a go.mod.
go_directives() {
	awk '
		/^go [0-9]/ { print; next }
		/^godebug \(/ { inblock = 1; print; next }
		inblock { print; if ($0 ~ /^\)/) inblock = 0; next }
		/^godebug / { print }
	' "$1"
}

# staging_replaces GOMOD VERSION: turns every "k8s.io/X => ./staging/..." replace
# of kubernetes' go.mod into "replace k8s.io/X => k8s.io/X VERSION".
staging_replaces() {
	local gomod="$1" version="$2"
	awk -v v="$version" '
		$0 ~ /=> \.\/staging\// {
			for (i = 1; i <= NF; i++) if ($i ~ /^k8s\.io\//) { print "replace " $i " => " $i " " v; break }
		}
	' "$gomod"
}

# build_module NAME MODULE VERSION PACKAGE [EXTRA_GOMOD [LDFLAGS]]: builds
# PACKAGE from a throwaway module requiring MODULE@VERSION and installs it as
# ASSETS_DIR/NAME. EXTRA_GOMOD is a function that prints more go.mod lines,
# given the path of MODULE's own go.mod.
build_module() {
	local name="$1" module="$2" version="$3" pkg="$4" extra="${5:-}" ldflags="${6:-}"
	local work start=$SECONDS
	work="$(mktemp -d)"
	WORK_DIRS+=("$work")
	log "building $name from $module@$version in $work"
	(
		cd "$work"
		local info gomod
		if ! info="$(go mod download -json "$module@$version")"; then
			log "cannot download $module@$version (a 403 means the proxy refuses this version; try a nearby one):"
			echo "$info" >&2
			exit 1
		fi
		gomod="$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p' <<<"$info")"
		[[ -f "$gomod" ]] || { log "no go.mod for $module@$version in: $info"; exit 1; }
		{
			echo "module kst.local/assets/$name"
			echo
			go_directives "$gomod"
			echo
			echo "require $module $version"
			echo
			if [[ -n "$extra" ]]; then "$extra" "$gomod"; fi
		} >go.mod
		# go mod tidy needs a Go file importing the package to build.
		printf '//go:build tools\n\npackage tools\n\nimport _ "%s"\n' "$pkg" >tools.go
		go mod tidy >&2
		if [[ -n "${BUILD_CGO_STATIC:-}" ]]; then
			# cgo, linked statically: the VM has no C library of its own.
			CGO_ENABLED=1 go build -trimpath -tags netgo,osusergo \
				-ldflags "-s -w -linkmode external -extldflags -static $ldflags" -o "$ASSETS_DIR/$name.tmp" "$pkg" >&2
		else
			CGO_ENABLED=0 go build -trimpath -ldflags "-s -w $ldflags" -o "$ASSETS_DIR/$name.tmp" "$pkg" >&2
		fi
	)
	mv "$ASSETS_DIR/$name.tmp" "$ASSETS_DIR/$name"
	rm -rf "$work"
	if [[ -n "${NO_VERSION_PROBE:-}" ]]; then
		log "built $name in $((SECONDS - start))s"
	else
		log "built $name in $((SECONDS - start))s: $("$ASSETS_DIR/$name" --version 2>&1 | head -n1)"
	fi
}

# kube_replaces GOMOD: the staging replaces for KUBE_VERSION (v1.Y.Z -> v0.Y.Z).
kube_replaces() {
	staging_replaces "$1" "v0.${KUBE_VERSION#v1.}"
}

# kube_ldflags: stamps the version that kube-apiserver --version and /version report.
kube_ldflags() {
	local v="${KUBE_VERSION#v}" pkg=k8s.io/component-base/version
	local major="${v%%.*}" rest="${v#*.}"
	echo "-X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=${rest%%.*}" \
		"-X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
}

# The rest of a cluster, for the lab's real node (test/lab: TestLabKubelet,
# TestLabInstall): a kubelet, a controller-manager and a scheduler.
CLUSTER_BINARIES=(kubelet kube-controller-manager kube-scheduler kube-proxy)

build_kube() {
	local b
	for b in "$@"; do
		if have "$b"; then
			log "$b present: $("$ASSETS_DIR/$b" --version 2>&1 | head -n1)"
		else
			build_module "$b" k8s.io/kubernetes "$KUBE_VERSION" "k8s.io/kubernetes/cmd/$b" \
				kube_replaces "$(kube_ldflags)"
		fi
	done
}

# Flannel (issue 32), the lab cluster's overlay in one mode: flanneld and
# its CNI plugin. The proxy refuses the tencentcloud vpc module version
# flanneld requires (its tencentvpc backend), so the one it serves
# replaces it; flanneld's udp backend needs cgo. The proxy refuses
# github.com/flannel-io/cni-plugin at every version tried; the plugin
# lived in containernetworking/plugins (plugins/meta/flannel, until v0.9.1) before it
# moved there, with the same configuration and subnet.env, and that is
# built.
FLANNEL_VERSION="${FLANNEL_VERSION:-v0.28.10}"
FLANNEL_CNI_VERSION="${FLANNEL_CNI_VERSION:-v0.9.1}"
flannel_replaces() {
	echo "replace github.com/tencentcloud/tencentcloud-sdk-go/tencentcloud/vpc => github.com/tencentcloud/tencentcloud-sdk-go/tencentcloud/vpc v1.0.1000"
}

build_flannel() {
	local flanneld="flanneld-$FLANNEL_VERSION" cni="flannel-cni-$FLANNEL_CNI_VERSION"
	if [[ -x "$ASSETS_DIR/$flanneld" ]]; then
		log "$flanneld present"
	else
		BUILD_CGO_STATIC=1 build_module "$flanneld" github.com/flannel-io/flannel "$FLANNEL_VERSION" github.com/flannel-io/flannel \
			flannel_replaces "-X github.com/flannel-io/flannel/pkg/version.Version=$FLANNEL_VERSION"
	fi
	if [[ -x "$ASSETS_DIR/$cni" ]]; then
		log "$cni present"
	else
		build_module "$cni" github.com/containernetworking/plugins "$FLANNEL_CNI_VERSION" \
			github.com/containernetworking/plugins/plugins/meta/flannel
	fi
}

# Calico (issue 32), the lab cluster's network plugin in one mode: calico-node
# (its startup, tunnel-address allocation and Felix with the iptables
# dataplane; CGO_ENABLED=0 is enough while BPF is off) and its CNI plugin
# (also calico-ipam, by the name it is run under). Calico is one module with
# no tag the proxy serves; CALICO_COMMIT is v3.31.0's commit, as the proxy's
# pseudo-version. Its go.mod replaces its own submodules by directory; they
# are pinned here to the same commit (the api module to its own).
CALICO_VERSION="${CALICO_VERSION:-v3.31.0}"
CALICO_MODULE_VERSION="${CALICO_MODULE_VERSION:-v0.0.0-20251021213802-b1f3c43f8437}"
CALICO_API_VERSION="${CALICO_API_VERSION:-v0.0.0-20251022175904-f2ab03771208}"
calico_replaces() {
	# Every replace of calico's go.mod that names a version, as is.
	awk '
		/^replace \(/ { inblock = 1; next }
		inblock && /^\)/ { inblock = 0; next }
		inblock && /=>/ && $0 !~ /=> \.\// { print "replace " $0 }
	' "$1"
	echo "replace github.com/projectcalico/api => github.com/projectcalico/api $CALICO_API_VERSION"
	echo "replace github.com/projectcalico/calico/lib/std => github.com/projectcalico/calico/lib/std $CALICO_MODULE_VERSION"
	echo "replace github.com/projectcalico/calico/lib/httpmachinery => github.com/projectcalico/calico/lib/httpmachinery $CALICO_MODULE_VERSION"
}

build_calico() {
	local node="calico-node-$CALICO_VERSION" cni="calico-cni-$CALICO_VERSION"
	local ldflags="-X github.com/projectcalico/calico/pkg/buildinfo.Version=$CALICO_VERSION"
	# The checksum database knows no pseudo-version of these modules.
	export GONOSUMDB="${GONOSUMDB:+$GONOSUMDB,}github.com/projectcalico"
	if [[ -x "$ASSETS_DIR/$node" ]]; then
		log "$node present"
	else
		NO_VERSION_PROBE=1 build_module "$node" github.com/projectcalico/calico "$CALICO_MODULE_VERSION" \
			github.com/projectcalico/calico/node/cmd/calico-node calico_replaces "$ldflags"
	fi
	if [[ -x "$ASSETS_DIR/$cni" ]]; then
		log "$cni present"
	else
		NO_VERSION_PROBE=1 build_module "$cni" github.com/projectcalico/calico "$CALICO_MODULE_VERSION" \
			github.com/projectcalico/calico/cni-plugin/cmd/calico calico_replaces "$ldflags"
	fi
	# Its CRDs (manifests/crds.yaml), which the lab cluster applies.
	local crds="calico-crds-$CALICO_VERSION.yaml" dir
	if [[ -f "$ASSETS_DIR/$crds" ]]; then
		log "$crds present"
	else
		dir="$(cd "$ASSETS_DIR" && go mod download -json "github.com/projectcalico/calico@$CALICO_MODULE_VERSION" |
			sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')"
		cp "$dir/manifests/crds.yaml" "$ASSETS_DIR/$crds.tmp"
		mv "$ASSETS_DIR/$crds.tmp" "$ASSETS_DIR/$crds"
	fi
}

main() {
	mkdir -p "$ASSETS_DIR"
	ASSETS_DIR="$(cd "$ASSETS_DIR" && pwd)"
	if have etcd; then
		log "etcd present: $("$ASSETS_DIR/etcd" --version 2>&1 | head -n1)"
	else
		build_module etcd go.etcd.io/etcd/server/v3 "$ETCD_VERSION" go.etcd.io/etcd/server/v3
	fi
	build_kube kube-apiserver "${CLUSTER_BINARIES[@]}"
	# It has no --version: the file named with its version is the check.
	local knp="kube-network-policies-$KNP_VERSION"
	if [[ -x "$ASSETS_DIR/$knp" ]]; then
		log "$knp present"
	else
		build_module "$knp" sigs.k8s.io/kube-network-policies "$KNP_VERSION" sigs.k8s.io/kube-network-policies/cmd
	fi
	build_flannel
	build_calico
	echo "$ASSETS_DIR"
}

main "$@"
