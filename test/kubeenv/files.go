package kubeenv

import (
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	mathrand "math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// dirPrefix starts the name of every temp dir; the owner's pid follows so
// that dirs left by a crashed test binary can be removed later.
const dirPrefix = "kubeenv-"

// baseTempDir prefers /dev/shm (etcd fsyncs are free on tmpfs).
func baseTempDir() string {
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		if f, err := os.CreateTemp("/dev/shm", ".kubeenv-probe-"); err == nil {
			f.Close()
			os.Remove(f.Name())
			return "/dev/shm"
		}
	}
	return os.TempDir()
}

// makeTempDir creates a fresh temp dir for one Env, after removing the dirs
// of earlier test binaries that died without calling Stop.
func makeTempDir() (string, error) {
	base := baseTempDir()
	removeStaleDirs(base)
	dir, err := os.MkdirTemp(base, fmt.Sprintf("%s%d-", dirPrefix, os.Getpid()))
	if err != nil {
		return "", fmt.Errorf("create temp dir in %s: %w", base, err)
	}
	return dir, nil
}

// removeStaleDirs removes base/kubeenv-PID-* whose PID no longer exists.
func removeStaleDirs(base string) {
	matches, _ := filepath.Glob(filepath.Join(base, dirPrefix+"*"))
	for _, dir := range matches {
		rest := strings.TrimPrefix(filepath.Base(dir), dirPrefix)
		pidText, _, ok := strings.Cut(rest, "-")
		pid, err := strconv.Atoi(pidText)
		if !ok || err != nil || pid <= 0 {
			continue
		}
		if errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) {
			os.RemoveAll(dir)
		}
	}
}

// freePort returns a TCP port of 127.0.0.1 that is free now, chosen below
// the kernel's ephemeral range (net.ipv4.ip_local_port_range). Outside that
// range no outgoing connection can take the port as its source port, which
// matters when the API server restarts on the same port: while it is down,
// a client's connect() may otherwise pick that very port (a TCP
// self-connect) or another connection may hold it, and the restart fails
// with "address already in use". Another listener may still take the port
// before it is used; callers retry on that.
func freePort() (int, error) {
	low, high := fixedPortRange()
	for range 64 {
		port := low + mathrand.IntN(high-low)
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			continue
		}
		l.Close()
		return port, nil
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// fixedPortRange returns [low, high): the ports from 10240 up to the start
// of the ephemeral range, or 10240-32768 when the range cannot be read or
// leaves too little room below it (then the ports may be ephemeral ones).
func fixedPortRange() (low, high int) {
	low, high = 10240, 32768
	data, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return low, high
	}
	fields := strings.Fields(string(data))
	if len(fields) != 2 {
		return low, high
	}
	ephemeralLow, err := strconv.Atoi(fields[0])
	if err != nil || ephemeralLow < low+1024 {
		return low, high
	}
	return low, ephemeralLow
}

// randomToken returns 32 random hex characters.
func randomToken() (string, error) {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("random token: %w", err)
	}
	return hex.EncodeToString(b), nil
}

// writeServiceAccountKeys writes an RSA private key (sa.key) and its public
// key (sa.pub) into dir, for signing and verifying service account tokens.
func writeServiceAccountKeys(dir string) (keyPath, pubPath string, err error) {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return "", "", fmt.Errorf("generate service account key: %w", err)
	}
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return "", "", fmt.Errorf("marshal service account public key: %w", err)
	}
	keyPath = filepath.Join(dir, "sa.key")
	pubPath = filepath.Join(dir, "sa.pub")
	if err := writePEM(keyPath, "RSA PRIVATE KEY", x509.MarshalPKCS1PrivateKey(key)); err != nil {
		return "", "", err
	}
	if err := writePEM(pubPath, "PUBLIC KEY", pub); err != nil {
		return "", "", err
	}
	return keyPath, pubPath, nil
}

func writePEM(path, blockType string, der []byte) error {
	data := pem.EncodeToMemory(&pem.Block{Type: blockType, Bytes: der})
	if err := os.WriteFile(path, data, 0o600); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// writeTokenFile writes a static token file with one user, admin, in the
// group system:masters (which bypasses RBAC).
func writeTokenFile(dir, token string) (string, error) {
	path := filepath.Join(dir, "tokens.csv")
	line := fmt.Sprintf("%s,%s,%s,\"%s\"\n", token, AdminUser, AdminUser, "system:masters")
	if err := os.WriteFile(path, []byte(line), 0o600); err != nil {
		return "", fmt.Errorf("write token file: %w", err)
	}
	return path, nil
}
