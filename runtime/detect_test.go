package runtime

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vishvananda/netns"
)

// stubLocator answers every Locate with err (or a namespace when err is nil)
// and counts the calls.
type stubLocator struct {
	name  string
	err   error
	calls int
}

func (s *stubLocator) Name() string { return s.name }
func (s *stubLocator) Close() error { return nil }
func (s *stubLocator) Locate(context.Context, Pod) (Netns, error) {
	s.calls++
	if s.err != nil {
		return Netns{}, s.err
	}
	return Netns{Handle: netns.None(), Via: s.name}, nil
}

func TestWithFallback(t *testing.T) {
	for _, tc := range []struct {
		name         string
		primaryErr   error
		wantFallback bool
		wantVia      string
		wantErrIs    error
	}{
		{name: "primary finds it", wantVia: "primary"},
		{name: "runtime says no sandbox: that answer stands", primaryErr: NotFoundf("no sandbox"), wantErrIs: ErrNotFound},
		{name: "host-network sandbox: never searched by IP", primaryErr: ErrHostNetwork, wantErrIs: ErrHostNetwork},
		{name: "runtime fails: search by IP", primaryErr: errors.New("connection refused"), wantFallback: true, wantVia: "secondary"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, s := &stubLocator{name: "primary", err: tc.primaryErr}, &stubLocator{name: "secondary"}
			ns, err := WithFallback(p, s).Locate(context.Background(), Pod{Name: "x"})
			if (s.calls > 0) != tc.wantFallback {
				t.Fatalf("fallback called %d times, want called=%v", s.calls, tc.wantFallback)
			}
			if tc.wantErrIs != nil {
				if !errors.Is(err, tc.wantErrIs) {
					t.Fatalf("err = %v, want %v", err, tc.wantErrIs)
				}
				return
			}
			if err != nil || ns.Via != tc.wantVia {
				t.Fatalf("got via %q err %v, want via %q", ns.Via, err, tc.wantVia)
			}
		})
	}
}

func TestOpen(t *testing.T) {
	ctx := context.Background()
	loc, how, err := Open(ctx, Options{Runtime: "netns"})
	if err != nil || loc.Name() != "netns" || !strings.Contains(how, "pod IP") {
		t.Fatalf("--runtime=netns: %v %q %v", loc, how, err)
	}
	if _, _, err := Open(ctx, Options{Runtime: "rkt"}); err == nil || !strings.Contains(err.Error(), "auto, docker, cri or netns") {
		t.Fatalf("unknown runtime: err = %v", err)
	}
	dead := "unix://" + filepath.Join(t.TempDir(), "nothing.sock")
	for _, rt := range []string{"docker", "cri"} {
		if _, _, err := Open(ctx, Options{Runtime: rt, Endpoint: dead}); err == nil || !strings.Contains(err.Error(), "nothing.sock") {
			t.Errorf("--runtime=%s at a dead socket: err = %v, want one naming the socket", rt, err)
		}
	}
}
