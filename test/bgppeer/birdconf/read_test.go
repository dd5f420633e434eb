package birdconf

import "testing"

func TestParseProtocol(t *testing.T) {
	// Captured from bird 2.0.12: "show protocols" (greeting removed), from
	// an integration test's peer and from the lab's passive gateway.
	const peer = `Name       Proto      Table      State  Since         Info
device1    Device     ---        up     21:52:43.408  
kernel1    Kernel     master4    up     21:52:43.408  
gobgp      BGP        ---        up     21:52:48.024  Established   
other      BGP        ---        start  21:52:59.575  Active        Received: Administrative shutdown
`
	const gateway = `Name       Proto      Table      State  Since         Info
router_a   BGP        ---        up     21:59:29.135  Established   
router_b   BGP        ---        start  21:59:27.969  Passive       
`
	for _, tc := range []struct {
		out, name string
		wantUp    bool
		wantState string
	}{
		{peer, "gobgp", true, "up Established"},
		{peer, "other", false, "start Active Received: Administrative shutdown"},
		{peer, "kernel1", false, "up"},
		{gateway, "router_a", true, "up Established"},
		{gateway, "router_b", false, "start Passive"},
	} {
		up, state, err := ParseProtocol(tc.out, tc.name)
		if err != nil || up != tc.wantUp || state != tc.wantState {
			t.Errorf("ParseProtocol(%s) = %v, %q, %v; want %v, %q", tc.name, up, state, err, tc.wantUp, tc.wantState)
		}
	}
	for _, out := range []string{peer, gateway} {
		if _, _, err := ParseProtocol(out, "missing"); err == nil {
			t.Error("ParseProtocol found a missing protocol")
		}
	}
}
