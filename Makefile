# kube-service-tunnel. `make help` lists the targets.
SHELL := /bin/bash
GO ?= go
BIN := bin
PKGS := ./...
# Where slow-to-build test assets (kube-apiserver, etcd) are cached.
export KST_ASSETS_DIR ?= $(HOME)/.cache/kube-service-tunnel/assets

.PHONY: help build image manifest test unit integration e2e cluster bench lint demo demo-cluster docs deps assets clean

help: ## show this help
	@grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

# The project's version: the images' tag and what --version prints.
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo devel)
LDFLAGS := -s -w -X github.com/cmdnu/kube-service-tunnel/internal/version.Version=$(VERSION)

build: ## build static binaries into bin/
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "$(LDFLAGS)" -o $(BIN)/ ./cmd/...

# Image name prefix: a registry and path of yours (make manifest REGISTRY=...).
REGISTRY ?= kube-service-tunnel

image: build ## both daemons' container images, offline from Debian's packages, into bin/images/*.tar (tag: VERSION)
	$(GO) run ./internal/image/mkimage build -version $(VERSION) -registry $(REGISTRY)

manifest: ## bin/tunnel-router.yaml and bin/tunnel-uninstall.yaml naming the images of this VERSION under REGISTRY
	$(GO) run ./internal/image/mkimage manifest -version $(VERSION) -registry $(REGISTRY)

# Debian packages the tests need: iptables and iproute2 for the datapath; a
# real Docker engine and containerd (with runc, the CNI loopback plugin and a
# static busybox for the images) for the endpoint agent's runtime lookups;
# skopeo to check that the built images copy; nftables' nft for the lab
# cluster's kube-proxy (its nftables mode); conntrackd, which the router runs
# to share its conntrack entries (router/ctsync).
APT_PACKAGES := iptables iproute2 util-linux docker.io containerd runc containernetworking-plugins busybox-static bird2 skopeo nftables ipset conntrackd

deps: ## install the Debian packages the tests need (iptables, iproute2, docker.io, containerd, ...)
	@if ! { command -v iptables && command -v ip && command -v nsenter && command -v dockerd && command -v containerd \
		&& command -v runc && command -v skopeo && test -x /usr/lib/cni/loopback && dpkg -s busybox-static && command -v bird && command -v birdc \
		&& test -x /usr/sbin/nft && test -x /usr/sbin/ipset && test -x /usr/sbin/conntrackd; } >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(APT_PACKAGES); fi

assets: ## build and cache a real etcd, kube-apiserver, kubelet, kube-controller-manager, kube-scheduler, kube-proxy, kube-network-policies, Flannel and Calico, and the VM lab's kernel
	./test/tools/kube-assets.sh
	./test/tools/lab-assets.sh

# The end-to-end lab and the two-node cluster run alone, one after the other,
# after the other packages: their qemu VMs (TCG) need both cores, and
# timing-sensitive steps in them (TCP handshakes, BFD, probes) failed when the
# integration tests' churn ran beside them.
SERIAL_PKGS := ./test/lab/ipv6probe ./test/e2e ./test/cluster
# Each phase of make test is timed (test/tools/phase.sh): the log starts with
# what the machine is and ends with every phase's duration, and the lab runs
# leave their slowest scenarios in it. The go test bounds are about twice
# the slowest machine's durations (docs/testing.md, "Time budget").
PHASE := ./test/tools/phase.sh
test: ## everything: the images and manifest, unit, privileged (root) and integration tests, the end-to-end lab, the two-node cluster, the demo and a smoke run of the benchmark
	@$(PHASE) --start
	@rm -f /tmp/kst-e2e-console.durations.txt /tmp/kst-cluster-lab-router.durations.txt
	@$(GO) run ./test/tools/machine -vm=false
	@$(PHASE) deps $(MAKE) --no-print-directory deps
	@$(PHASE) assets $(MAKE) --no-print-directory assets
	@$(GO) run ./test/tools/machine -host=false
	@$(PHASE) lint+build+image+manifest $(MAKE) --no-print-directory lint build image manifest
	@KST_REQUIRE_INTEGRATION=1 $(PHASE) unit+integration $(GO) test -count=1 -timeout 30m $$($(GO) list $(PKGS) | grep -v -e '/test/lab/ipv6probe$$' -e '/test/e2e$$' -e '/test/cluster$$')
	@KST_REQUIRE_INTEGRATION=1 $(PHASE) ipv6probe $(GO) test -count=1 -timeout 10m ./test/lab/ipv6probe
	@KST_REQUIRE_INTEGRATION=1 KST_PHASE_SHOW=/tmp/kst-e2e-console.durations.txt $(PHASE) e2e $(GO) test -count=1 -timeout 50m ./test/e2e
	@KST_REQUIRE_INTEGRATION=1 KST_CLUSTER_CNI=flannel KST_CLUSTER_MODES=gre KST_PHASE_SHOW=/tmp/kst-cluster-lab-router.durations.txt $(PHASE) cluster $(GO) test -count=1 -timeout 45m ./test/cluster
	@$(PHASE) demo bash -c '$(GO) run ./test/demo > /tmp/kst-demo.log 2>&1 || { cat /tmp/kst-demo.log; exit 1; }'
	@$(PHASE) bench-smoke bash -c '$(GO) run ./test/bench $(BENCH_SMOKE) > /tmp/kst-bench.log 2>&1 || { cat /tmp/kst-bench.log; exit 1; }'
	@echo "demo: ok; bench (smoke run, 100 tunnel IPs): ok"
	@$(PHASE) --summary

unit: ## unit tests only (no root, no API server)
	KST_SKIP_PRIVILEGED=1 $(GO) test -count=1 -short $(PKGS)

e2e: deps assets ## the end-to-end lab: 17 dual-stack scenarios in gre and mpls mode in the VM, 6 of them in one mode (KST_E2E_RUN=gre/3_ for one)
	KST_REQUIRE_INTEGRATION=1 $(GO) test -count=1 -timeout 50m -run TestE2E -v ./test/e2e

# The lab cluster's network plugin: bridge or flannel (make cluster CNI=flannel).
# make test runs the Flannel pairing (gre) alone: on the slowest machine of
# CI's kind the two pairings took 45-50 min of make test's 55 (docs/testing.md).
# make cluster runs both: gre mode on Flannel, mpls mode on Calico.
CNI ?=
cluster: deps assets ## the two-node lab cluster run by real kubelets and kube-proxy: install, example, client traffic, kube-proxy and the replies, network policy, rollout restart, router pod deletion, uninstall, gre mode on Flannel and mpls mode on Calico, each cluster of its own (CNI=bridge|flannel|calico: both modes on that one)
	KST_REQUIRE_INTEGRATION=1 KST_CLUSTER_CNI=$(CNI) $(GO) test -count=1 -timeout 45m -run TestCluster -v ./test/cluster

# A smoke run of every part of the benchmark, counts scaled down (about 40 s).
BENCH_SMOKE = -tunnels 100 -forward-tunnels 1,100 -forward-duration 500ms -forward-warmup 200ms -forward-rounds 1 \
	-many-pods-tunnels 100 -many-pods 50 -process-tunnels 100 -updates 20

bench: deps assets build ## route programming and forwarding vs baselines, programming with many pods, event to datapath, router RSS (root)
	$(GO) run ./test/bench

lint: ## go vet and gofmt
	$(GO) vet $(PKGS)
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

demo: deps assets ## boot the lab VM, deploy examples/echo.yaml and show a client reaching its pods through the tunnel IP
	$(GO) run ./test/demo

demo-cluster: deps assets ## the user's own path on two lab nodes run by real kubelets: apply the manifest, label a node, apply the example, reach it from outside (gre; ~2.5 min warm)
	KST_REQUIRE_INTEGRATION=1 KST_CLUSTER_DEMO=1 $(GO) test -count=1 -timeout 20m -run TestCluster -v ./test/cluster

docs: ## regenerate docs/flags.md from the daemons' -h (go test ./test/docsgen fails when it is stale)
	$(GO) run ./test/docsgen

clean: ## remove build output
	rm -rf $(BIN)
