package kubeenv

import (
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// startEtcd starts a single-member etcd on two free ports of 127.0.0.1, with
// its data in the temp dir, and waits until /health reports true.
func (e *Env) startEtcd(path string) error {
	clientPort, err := freePort()
	if err != nil {
		return err
	}
	peerPort, err := freePort()
	if err != nil {
		return err
	}
	clientURL := "http://127.0.0.1:" + strconv.Itoa(clientPort)
	peerURL := "http://127.0.0.1:" + strconv.Itoa(peerPort)
	args := []string{
		"--name=kubeenv",
		"--data-dir=" + filepath.Join(e.dir, "etcd-data"),
		"--listen-client-urls=" + clientURL,
		"--advertise-client-urls=" + clientURL,
		"--listen-peer-urls=" + peerURL,
		"--initial-advertise-peer-urls=" + peerURL,
		"--initial-cluster=kubeenv=" + peerURL,
		"--initial-cluster-state=new",
		"--unsafe-no-fsync=true",
		"--log-level=warn",
	}
	p, err := startProcess(e.launcher, "etcd", path, e.logPath("etcd"), args)
	if err != nil {
		return err
	}
	e.etcd = p
	e.etcdURL = clientURL
	probe := func() error { return probeHTTP(plainClient, clientURL+"/health", "", `"true"`) }
	if err := waitReady(p, probe); err != nil {
		return e.failedStart(p, err)
	}
	return nil
}

// startAPIServer starts kube-apiserver on a free port of 127.0.0.1 against
// the running etcd and waits until /readyz answers ok.
func (e *Env) startAPIServer(path string) error {
	port, err := freePort()
	if err != nil {
		return err
	}
	args, err := e.apiserverArgs(port)
	if err != nil {
		return err
	}
	p, err := startProcess(e.launcher, "kube-apiserver", path, e.logPath("kube-apiserver"), args)
	if err != nil {
		return err
	}
	e.mu.Lock()
	e.apiserver = p
	e.mu.Unlock()
	e.apiserverBin, e.apiserverCmd = path, args
	e.host = "https://127.0.0.1:" + strconv.Itoa(port)
	if err := waitReady(p, e.probeAPIServer); err != nil {
		return e.failedStart(p, err)
	}
	return e.loadServingCA()
}

// apiserverArgs writes the token file and service account keys and returns
// the kube-apiserver command line.
func (e *Env) apiserverArgs(port int) ([]string, error) {
	token, err := randomToken()
	if err != nil {
		return nil, err
	}
	e.adminToken = token
	tokenFile, err := writeTokenFile(e.dir, token)
	if err != nil {
		return nil, err
	}
	keyFile, pubFile, err := writeServiceAccountKeys(e.dir)
	if err != nil {
		return nil, err
	}
	e.saKey = keyFile
	admission := "--disable-admission-plugins=ServiceAccount"
	if e.opts.ServiceAccountAdmission {
		admission = "--enable-admission-plugins=ServiceAccount"
	}
	var audit []string
	if e.opts.AuditServiceAccountsOf != "" {
		policy, err := writeAuditPolicy(e.dir, e.opts.AuditServiceAccountsOf)
		if err != nil {
			return nil, err
		}
		audit = []string{"--audit-policy-file=" + policy, "--audit-log-path=" + e.AuditLog(), "--audit-log-format=json", "--audit-log-mode=blocking"}
	}
	return append([]string{
		"--etcd-servers=" + e.etcdURL,
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(port),
		"--cert-dir=" + e.certDir(),
		"--service-cluster-ip-range=" + ServiceClusterIPRange,
		"--service-account-issuer=" + ServiceAccountIssuer,
		"--service-account-key-file=" + pubFile,
		"--service-account-signing-key-file=" + keyFile,
		"--token-auth-file=" + tokenFile,
		"--authorization-mode=RBAC",
		admission,
		"--endpoint-reconciler-type=none",
		"--allow-privileged=true",
		"--profiling=false",
		"--v=1",
	}, audit...), nil
}

// probeAPIServer checks that the API server's /readyz answers ok.
func (e *Env) probeAPIServer() error {
	return probeHTTP(insecureClient, e.host+"/readyz", e.adminToken, "ok")
}

func (e *Env) certDir() string { return filepath.Join(e.dir, "certs") }

// loadServingCA reads the API server's self-signed certificate chain (leaf
// plus its CA) from --cert-dir, to verify TLS in the client configs.
func (e *Env) loadServingCA() error {
	path := filepath.Join(e.certDir(), "apiserver.crt")
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("read API server certificate: %w", err)
	}
	e.caData = data
	return nil
}

// failedStart kills a process that did not become ready and turns err into
// errPortInUse when its log says a port was taken.
func (e *Env) failedStart(p *process, err error) error {
	if killErr := p.kill(); killErr != nil {
		err = fmt.Errorf("%w (and %v)", err, killErr)
	}
	if strings.Contains(tailFile(p.logPath, 200, 64<<10), "address already in use") {
		return fmt.Errorf("%s: %w: %v", p.name, errPortInUse, err)
	}
	return err
}

// waitReady polls probe until it succeeds, the process exits, or
// readyTimeout passes; errors carry the tail of the process log.
func waitReady(p *process, probe func() error) error {
	deadline := time.Now().Add(readyTimeout)
	for {
		if p.exited() {
			return p.errExited()
		}
		err := probe()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready after %v (last probe: %v); log %s:\n%s",
				p.name, readyTimeout, err, p.logPath, p.logTail())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

var (
	// plainClient probes etcd's /health.
	plainClient = &http.Client{
		Timeout:   5 * time.Second,
		Transport: &http.Transport{DisableKeepAlives: true},
	}
	// insecureClient probes /readyz, before the serving certificate is read.
	insecureClient = &http.Client{
		Timeout: 5 * time.Second,
		Transport: &http.Transport{
			DisableKeepAlives: true,
			TLSClientConfig:   &tls.Config{InsecureSkipVerify: true},
		},
	}
)

// probeHTTP GETs url (with an optional bearer token) and wants a 200 answer
// whose body contains want.
func probeHTTP(c *http.Client, url, token, want string) error {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return fmt.Errorf("probe %s: %w", url, err)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := c.Do(req)
	if err != nil {
		return fmt.Errorf("probe %s: %w", url, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), want) {
		return fmt.Errorf("probe %s: %s: %s", url, resp.Status, strings.TrimSpace(string(body)))
	}
	return nil
}
