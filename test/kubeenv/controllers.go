package kubeenv

import (
	"fmt"
	"os"
	"path/filepath"
)

// ControllerBinaries are the control plane's other programs, built by
// test/tools/kube-assets.sh (make assets).
var ControllerBinaries = []string{"kube-controller-manager", "kube-scheduler"}

// StartControllers starts a real kube-controller-manager (every default
// controller: DaemonSets, Deployments, EndpointSlices, ServiceAccount tokens
// and the kube-root-ca.crt ConfigMaps, ...; no node IPAM) and kube-scheduler
// beside the API server, as admin, without leader election. They stop with
// the Env. Missing binaries give an error wrapping ErrNoAssets.
func (e *Env) StartControllers() error {
	paths := map[string]string{}
	for _, b := range ControllerBinaries {
		p := filepath.Join(AssetsDir(), b)
		if _, err := os.Stat(p); err != nil {
			return fmt.Errorf("%w: %s (run make assets)", ErrNoAssets, p)
		}
		paths[b] = p
	}
	kubeconfig := filepath.Join(e.dir, "controllers.kubeconfig")
	if err := e.WriteKubeconfig(kubeconfig, nil); err != nil {
		return err
	}
	ca := filepath.Join(e.certDir(), "apiserver.crt")
	args := map[string][]string{
		"kube-controller-manager": {
			"--kubeconfig=" + kubeconfig,
			"--leader-elect=false",
			"--use-service-account-credentials=false",
			"--service-account-private-key-file=" + e.saKey,
			"--root-ca-file=" + ca,
			"--allocate-node-cidrs=false",
			"--secure-port=0",
			"--v=1",
		},
		"kube-scheduler": {
			"--kubeconfig=" + kubeconfig,
			"--leader-elect=false",
			"--secure-port=0",
			"--v=1",
		},
	}
	for _, b := range ControllerBinaries {
		p, err := startProcess(e.launcher, b, paths[b], e.logPath(b), args[b])
		if err != nil {
			return err
		}
		e.controllers = append(e.controllers, p)
	}
	return nil
}

// ControllerLogs are the paths of the controllers' logs.
func (e *Env) ControllerLogs() []string {
	var logs []string
	for _, p := range e.controllers {
		logs = append(logs, p.logPath)
	}
	return logs
}
