package ipsetstate

import (
	"errors"
	"testing"
)

func TestListRulesRetriesOnlyAVanishedSet(t *testing.T) {
	vanished := errors.New("iptables-save v1.8.9 (nf_tables): Set with index 1 in kernel doesn't exist.")
	calls := 0
	out, err := ListRules(func() (string, error) {
		calls++
		if calls < 3 {
			return "", vanished
		}
		return "*mangle", nil
	})
	if err != nil || out != "*mangle" || calls != 3 {
		t.Errorf("vanished twice: got %q, %v after %d calls; want *mangle, nil after 3", out, err, calls)
	}

	other := errors.New("exit status 1: Permission denied")
	calls = 0
	if _, err := ListRules(func() (string, error) { calls++; return "", other }); !errors.Is(err, other) || calls != 1 {
		t.Errorf("another error: got %v after %d calls; want it after 1", err, calls)
	}

	calls = 0
	if _, err := ListRules(func() (string, error) { calls++; return "", vanished }); !errors.Is(err, vanished) || calls != 5 {
		t.Errorf("always vanished: got %v after %d calls; want it after 5", err, calls)
	}
}
