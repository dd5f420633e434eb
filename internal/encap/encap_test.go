package encap

import "testing"

func TestModeValidate(t *testing.T) {
	for _, m := range []Mode{GRE, MPLS} {
		if err := m.Validate(); err != nil {
			t.Errorf("%q: %v", m, err)
		}
	}
	for _, m := range []Mode{"", "GRE", "ipip"} {
		if err := m.Validate(); err == nil {
			t.Errorf("%q: accepted", m)
		}
	}
}
