package daemon

import (
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"
)

// freeAddr is a loopback address whose port was free a moment ago.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

func TestWaitAfterCleanupAnswersReadyUntilTerminated(t *testing.T) {
	log, _ := logtest.NewNullLogger()
	addr := freeAddr(t)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- WaitAfterCleanup(ctx, addr, log) }()
	var status int
	var body string
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		resp, err := http.Get("http://" + addr + "/readyz")
		if err != nil {
			continue
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		status, body = resp.StatusCode, string(b)
		break
	}
	if status != http.StatusOK || strings.TrimSpace(body) != "ok" {
		t.Fatalf("/readyz after the cleanup: %d %q, want 200 ok", status, body)
	}
	select {
	case err := <-done:
		t.Fatalf("returned before SIGTERM: %v", err)
	default:
	}
	cancel()
	awaitNil(t, done, 10*time.Second, "still waiting 10 s after its context ended")
}

// awaitNil fails t unless done delivers nil within bound (failing with
// late if nothing came).
func awaitNil(t *testing.T, done <-chan error, bound time.Duration, late string) {
	t.Helper()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(bound):
		t.Fatal(late)
	}
}

// A daemon still running on the address must not answer for the cleanup.
func TestWaitAfterCleanupRefusesAnAddressInUse(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = WaitAfterCleanup(ctx, ln.Addr().String(), logrus.New())
	if err == nil || !strings.Contains(err.Error(), "--metrics-address") {
		t.Fatalf("got %v, want an error naming --metrics-address", err)
	}
}
