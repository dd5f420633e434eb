package daemon

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	logtest "github.com/sirupsen/logrus/hooks/test"
)

// A replacement pod starts while the old one still holds the port: Listen
// waits for the port and takes it once released, saying so.
func TestListenWaitsForAPortInUse(t *testing.T) {
	log, hook := logtest.NewNullLogger()
	held, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := held.Addr().String()
	got := make(chan error, 1)
	go func() {
		ln, err := Listen(context.Background(), addr, time.Minute, log)
		if err == nil {
			if ln.Addr().String() != addr {
				err = &net.AddrError{Err: "listening on " + ln.Addr().String() + ", not the address asked for", Addr: addr}
			}
			ln.Close()
		}
		got <- err
	}()
	// Listen must still be waiting while the port is held.
	select {
	case err := <-got:
		t.Fatalf("Listen returned while the port was held: %v", err)
	case <-time.After(1500 * time.Millisecond):
	}
	held.Close()
	awaitNil(t, got, 30*time.Second, "Listen did not take the port within 30 s of its release")
	var warned, freed bool
	for _, e := range hook.AllEntries() {
		warned = warned || strings.Contains(e.Message, "the port is in use")
		freed = freed || strings.Contains(e.Message, "the port is free")
	}
	if !warned || !freed {
		t.Fatalf("logged %d entries, want the wait (%v) and its end (%v)", len(hook.AllEntries()), warned, freed)
	}
}

// A port held longer than the wait is the startup error, naming the flag;
// so is one held when the daemon is stopped.
func TestListenGivesUpOnAPortHeldTooLong(t *testing.T) {
	log, _ := logtest.NewNullLogger()
	held, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	if _, err := Listen(context.Background(), held.Addr().String(), 2*time.Second, log); err == nil || !strings.Contains(err.Error(), "--metrics-address") || !strings.Contains(err.Error(), "in use") {
		t.Fatalf("got %v, want an error naming --metrics-address and the port in use", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Listen(ctx, held.Addr().String(), time.Hour, log); err == nil || !strings.Contains(err.Error(), "daemon stopped") {
		t.Fatalf("got %v with the daemon stopped, want an error saying so", err)
	}
}
